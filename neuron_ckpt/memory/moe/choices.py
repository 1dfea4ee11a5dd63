"""The recompute options the planner weighs for each kind of transformers layer, priced as
:class:`~neuron_ckpt.memory.options.LayerOption`\\ s: :func:`kind_options`.

A layer of a kind may recompute any set of the modules it has (:func:`~.layer.applies`: ``norm``,
``core_attn``, ``mlp`` / ``mlp_act`` on a dense layer, ``moe`` / ``moe_act`` / ``shared_experts``
on an MoE one, ``mla_up_proj`` with DeepSeek-V3's attention), none, or the whole layer. Each set
is priced from one :func:`~.layer.layer_tensors` of the kind: the bytes it keeps (routing replay
included), the FLOPs its backward reruns (:meth:`~.rules.LayerTensors.rerun`) and the most it
holds during its backward: what it keeps plus the most one of its units brings back (what that
unit's rerun rematerialises: the layer's bytes without the unit, and without the units inside
it, less its bytes with it; the whole layer for ``full``; an estimate, not measured). Sets another
set beats, keeping no less, holding no less and rerunning no fewer FLOPs, are dropped (the one
with fewer modules kept among equals): the search stays exact over what is left.
"""

from __future__ import annotations

import functools
import itertools

from ...recompute import RecomputeConfig
from ..options import LayerOption
from .layer import MODULES, applies, layer_tensors
from .rules import LayerTensors
from .sequence import always_on
from .shape import MoESetup, MoEShape


def config_of(modules: tuple[str, ...]) -> RecomputeConfig:
    """The :class:`RecomputeConfig` ``apply_recompute`` takes for a layer recomputing ``modules``."""
    if not modules:
        return RecomputeConfig()
    if modules == ("full",):
        return RecomputeConfig.preset("full")
    return RecomputeConfig(granularity="selective", modules=modules)


def label(modules: tuple[str, ...]) -> str:
    return "+".join(modules) or "none"


def _kept(layer: LayerTensors, modules: tuple[str, ...], setup: MoESetup) -> int:
    terms, outside = layer.kept(modules + always_on(setup))
    return sum(t.nbytes for t in (*terms, *outside))


def _inside(layer: LayerTensors, inner: str, outer: str) -> bool:
    """Whether every unit of ``inner`` sits inside a unit of ``outer`` (then it is off with it)."""
    units = layer.units.get(inner, [])
    return bool(units) and all(any(u.inside(o) for o in layer.units.get(outer, [])) for u in units)


def price(layer: LayerTensors, modules: tuple[str, ...], setup: MoESetup, name: str) -> LayerOption:
    """A layer recomputing ``modules`` as a :class:`LayerOption` called ``name``."""
    kept = _kept(layer, modules, setup)
    again = 0
    for m in modules:
        others = tuple(n for n in modules if n != m and not _inside(layer, n, m))
        again = max(again, _kept(layer, others, setup) - kept)
    rerun = layer.rerun(modules + always_on(setup))
    return LayerOption(name, config_of(modules), kept, kept + again, rerun.matmul, rerun.elementwise)


def _beats(a: LayerOption, b: LayerOption) -> bool:
    """``a`` keeps, holds and reruns no more than ``b``."""
    return (
        a.saved_bytes <= b.saved_bytes
        and a.backward_peak_bytes <= b.backward_peak_bytes
        and a.recompute_flops <= b.recompute_flops
    )


@functools.cache
def kind_options(shape: MoEShape, setup: MoESetup, kind: str, prefix: str = "") -> tuple[LayerOption, ...]:
    """The options of a ``kind`` layer, none first and full last, each named ``prefix`` + its
    modules joined by ``+`` (``"none"``, ``"norm+moe_act"``, ``"full"``); none of them beaten by
    another (module docstring)."""
    layer = layer_tensors(shape, setup, kind)
    have = [m for m in MODULES if applies(shape, kind, m)]
    sets = [s for n in range(len(have) + 1) for s in itertools.combinations(have, n)] + [("full",)]
    priced = [price(layer, s, setup, prefix + label(s)) for s in sets]
    kept: list[LayerOption] = []
    for i, option in enumerate(priced):
        beaten = any(
            _beats(other, option) and (j < i or not _beats(option, other)) for j, other in enumerate(priced) if j != i
        )
        if not beaten or option.name == prefix + "none":  # no recompute is always offered
            kept.append(option)
    return tuple(kept)


__all__ = ["config_of", "kind_options", "label", "price"]
