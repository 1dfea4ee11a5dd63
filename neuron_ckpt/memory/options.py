"""One layer's recompute, priced: bytes kept, the most held during its backward, FLOPs rerun.

:func:`layer_option` prices any recompute choice a layer can run (:func:`~.analytic.resolve`):
its bytes come from the analytic model (:mod:`.terms`), its FLOPs count the forward work that
backward reruns, up to where the rerun stops (:mod:`.rerun`), against the step's model FLOPs
(:func:`step_flops`, the MFU convention of :meth:`~.shape.ModelShape.flops_per_token`).
:func:`stack_options` prices every layer of a stack under one config (grouped and block full
recompute included), :func:`per_layer_options` whatever a budget is given for its layers. The
planner's choices are the presets (:data:`~neuron_ckpt.recompute.PRESETS`) the attention makes worth running
(:func:`offered_presets`: with flash attention, not the selective ones), by name:
:func:`layer_options`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from ..recompute import PRESETS, RecomputeConfig
from .analytic import Recompute, layer_activation_bytes, layer_backward_peak, resolve, supported_presets
from .offload import LayerOffload, layer_offloads
from .rerun import rerun_flops
from .shape import ModelShape, TrainingSetup
from .terms import layer_terms

if TYPE_CHECKING:
    from .moe.model import Model


COPY_TIE_BREAK = 1e-6
"""FLOPs charged per byte offloaded (1e-6: a 1 GiB copy weighs about a thousand FLOPs, nothing
beside any recompute, which reruns at least one elementwise op over the layer's activations)."""


@dataclass(frozen=True)
class LayerOption:
    """One way to run one layer.

    name: a preset (:data:`~neuron_ckpt.recompute.PRESETS`), or the label of another choice (``selective[mlp,norm]``,
        ``full(uniform 2)``, ``full+distributed``: :attr:`~.analytic.PricedRecompute.label`).
    recompute: the :class:`RecomputeConfig` it runs (``RecomputeConfig.preset(name)`` for a preset).
    saved_bytes: activations the layer keeps for backward, per micro-batch, on one device (the
        first layer of a full-recompute group keeps the group's input, the others nothing).
    backward_peak_bytes: the most the layer holds at once during its backward, its own kept bytes
        still held plus what its recompute brings back (for a group: all k layers' activations).
    recompute_matmul_flops / recompute_elementwise_flops: the forward FLOPs backward reruns, per
        micro-batch on one device, in matmuls (what ``FlopCounterMode`` counts) and elementwise
        (an estimate), as the backend reruns them (:mod:`.rerun`); the first layer of a
        full-recompute group carries the group's, the others none.

    With ``offload_modules`` (:mod:`.offload`) ``saved_bytes`` is what stays on the device,
    ``backward_peak_bytes`` counts the layer's reloaded terms, ``reload_bytes`` is what comes
    back ahead of its backward (during the backward of the layer above: that layer's reload
    buffer, :meth:`~.budget.BudgetParts.activations`), ``host_bytes`` / ``host_pinned_bytes`` what it
    copies to host per micro-batch (as the caching host allocator reserves it), and
    ``copy_flops`` the copy time not hidden under compute, in FLOPs at the device's rate
    (:meth:`~.offload_time.HostLink.exposed_copy_flops`; 0 without a host link given).
    """

    name: str
    recompute: RecomputeConfig
    saved_bytes: int
    backward_peak_bytes: int
    recompute_matmul_flops: float
    recompute_elementwise_flops: float
    reload_bytes: int = 0
    host_bytes: int = 0
    host_pinned_bytes: int = 0
    copy_flops: float = 0.0

    @property
    def recompute_flops(self) -> float:
        """Matmul plus elementwise FLOPs rerun."""
        return self.recompute_matmul_flops + self.recompute_elementwise_flops

    @property
    def cost(self) -> float:
        """What the planner minimises: the FLOPs rerun plus the exposed copy time as FLOPs, and a
        hair per byte copied (:data:`COPY_TIE_BREAK`), so that of two plans alike in time the one
        moving less wins: a copy that hides is still host memory and link traffic."""
        return self.recompute_flops + self.copy_flops + self.host_bytes * COPY_TIE_BREAK


def layer_option(
    model: ModelShape, setup: TrainingSetup, recompute: Recompute, layer: int = 0, offload: LayerOffload | None = None
) -> LayerOption:
    """Layer ``layer`` of ``model`` under ``recompute``, priced; with ``offload`` (that layer's
    :class:`~.offload.LayerOffload`; by default read from ``recompute``'s ``offload_modules``)
    what it leaves on the device."""
    priced = resolve(model, setup, recompute)
    spec = priced.layer(layer, model.layers)
    kept, events = layer_terms(model, setup, spec)
    saved = sum(t.nbytes for t in kept)
    rerun = rerun_flops(model, setup, spec)
    name = priced.layer_label(layer, model.layers)
    if offload is None and priced.config.offload_modules:
        offload = layer_offloads(model, setup, priced.config)[layer]
    back = layer_backward_peak(saved, events)
    if offload is None or not offload.host:
        return LayerOption(name, priced.config, saved, back, rerun.matmul, rerun.elementwise)
    return LayerOption(
        f"{name}+offload[{','.join(offload.names)}]",
        priced.config,
        offload.device,
        back + offload.twice,  # reloaded, its terms are back (``back`` counts them)
        rerun.matmul,
        rerun.elementwise,
        reload_bytes=offload.offloaded,
        host_bytes=offload.host,
        host_pinned_bytes=offload.pinned,
    )


def stack_options(model: ModelShape, setup: TrainingSetup, recompute: Recompute) -> list[LayerOption]:
    """Every layer of ``model`` under one recompute choice, in layer order (each kind of layer
    priced once: a layer's option depends on its :class:`~.analytic.LayerSpec`, label and offload only)."""
    priced, n = resolve(model, setup, recompute), model.layers
    offloads = layer_offloads(model, setup, priced.config) if priced.config.offload_modules else [None] * n
    kinds: dict[tuple, LayerOption] = {}
    out = []
    for i, x in enumerate(offloads):
        key = (priced.layer(i, n), priced.layer_label(i, n), x and (x.names, x.host, x.offloaded, x.pinned))
        if key not in kinds:
            kinds[key] = layer_option(model, setup, recompute, i, x)
        out.append(kinds[key])
    return out


Layers = str | RecomputeConfig | Sequence[str | RecomputeConfig | None]


def per_layer_options(
    model: Model, setup: TrainingSetup, layers: Layers, options: dict[str, LayerOption]
) -> list[LayerOption]:
    """Each layer's option, in layer order, for what :func:`~.budget.memory_budget` takes as
    ``layers``: a preset name from ``options`` (the offered ones) for every layer, a config for the
    whole stack priced layer by layer, or one entry per layer (a name, a config covering its own
    layer, or None for no recompute). A transformers model: its own
    (:meth:`~.moe.model.TransformersModel.per_layer_options`)."""
    if not isinstance(model, ModelShape):
        return model.per_layer_options(setup, layers, options)

    def named(name: str) -> LayerOption:
        if name not in options:
            why = (
                " (with flash attention selective recompute has no s^2 tensor to drop)"
                if (setup.attention == "flash" and name in PRESETS)
                else ""
            )
            raise ValueError(
                f"layers: option {name!r} is not offered for {model.kind}{why}; choose from {list(options)}"
            )
        return options[name]

    if isinstance(layers, str):
        return [named(layers)] * model.layers
    if isinstance(layers, RecomputeConfig):
        return stack_options(model, setup, layers)
    if isinstance(layers, (list, tuple)):
        entries = list(layers)
    else:
        raise ValueError(f"layers must be a preset name, a RecomputeConfig or one entry per layer, got {layers!r}")
    if len(entries) != model.layers:
        raise ValueError(f"layers: need one option per layer ({model.layers}), got {len(entries)}")
    one = replace(model, layers=1)
    resolved: list[RecomputeConfig] = []
    for i, entry in enumerate(entries):
        if isinstance(entry, str):
            resolved.append(named(entry).recompute)
        elif entry is None or isinstance(entry, RecomputeConfig):
            config = entry or RecomputeConfig()
            if config.granularity == "full" and config.num_layers != 1:
                raise ValueError(
                    f"layers[{i}]: in a per-layer list a full-recompute entry covers its own layer "
                    f"only: use num_layers=1, got num_layers={config.num_layers}"
                )
            resolved.append(config)
        else:
            raise ValueError(f"layers[{i}] must be a preset name, a RecomputeConfig or None, got {entry!r}")
    # The list's offloads at once (the first layer offloading ``layer`` copies the rotary tables too).
    offloads: list[LayerOffload | None] = [None] * len(resolved)
    if any(c.offload_modules for c in resolved):
        offloads = list(layer_offloads(model, setup, resolved))
    return [
        named(entry) if isinstance(entry, str) and not (x and x.host) else layer_option(one, setup, config, 0, x)
        for entry, config, x in zip(entries, resolved, offloads)
    ]


def offered_presets(model: ModelShape, setup: TrainingSetup) -> tuple[str, ...]:
    """The presets worth planning with: with flash attention, none that recomputes the core
    attention. The kernel keeps no ``s^2`` tensor, so recomputing it would rerun the attention
    forward to drop only its fp32 logsumexp (:func:`selective_saving_with_flash`); NeMo
    hard-enables it for the same reason, and NxD's selective checkpoint skips the flash path."""
    names = supported_presets(model)
    if setup.attention == "flash":
        names = tuple(n for n in names if RecomputeConfig.preset(n).granularity != "selective")
    return names


def selective_saving_with_flash(model: ModelShape, setup: TrainingSetup) -> int:
    """Bytes per layer that selective recompute would save with flash attention (the logsumexp)."""
    flash = replace(setup, attention="flash")
    return layer_activation_bytes(model, flash, "none") - layer_activation_bytes(model, flash, "selective")


def offered_configs(model: ModelShape, setup: TrainingSetup) -> list[RecomputeConfig]:
    """The recompute choices the planner weighs for one layer: :func:`offered_presets`, and with
    flash attention each selective preset without its core attention (``selective[mlp_act]``,
    ``selective[mlp_act,norm]``): the output-discarding modules still save what they save there."""
    configs = [RecomputeConfig.preset(name) for name in offered_presets(model, setup)]
    if setup.attention == "flash":
        for name in supported_presets(model):
            modules = tuple(m for m in RecomputeConfig.preset(name).modules if m != "core_attn")
            if RecomputeConfig.preset(name).granularity == "selective" and modules:
                configs.insert(-1, RecomputeConfig(granularity="selective", modules=modules))
    return configs


def layer_options(
    model: Model, setup: TrainingSetup, recompute_modules: Sequence[str] | None = None
) -> dict[str, LayerOption]:
    """The recompute options for one layer of ``model`` run as ``setup`` says (those
    :func:`offered_configs` lists; with ``recompute_modules``: none, selective recompute of those
    modules, and full), by name: the preset's, or the label of another choice. A transformers
    model: every kind's (:meth:`~.moe.model.TransformersModel.layer_options`)."""
    if not isinstance(model, ModelShape):
        return model.layer_options(setup)
    if (why := model.valid_tp(setup.tp, setup.local_seq_len if setup.sequence_parallel else None)) is not None:
        raise ValueError(why)
    configs = offered_configs(model, setup)
    if recompute_modules is not None:
        chosen = RecomputeConfig(granularity="selective", modules=tuple(recompute_modules))
        configs = [RecomputeConfig.preset("none"), chosen, RecomputeConfig.preset("full")]
    options = (layer_option(model, setup, config) for config in configs)
    return {option.name: option for option in options}


def canonical_order(counts: dict[str, int], options: dict[str, LayerOption]) -> tuple[str, ...]:
    """Layer order that keeps the backward peak lowest for these counts: the layers that bring the
    most back in backward (backward peak less kept bytes) first, no recompute last (an exchange
    argument: of two neighbours, the one with more to bring back goes first)."""
    ranked = sorted(counts, key=lambda n: options[n].saved_bytes - options[n].backward_peak_bytes)
    return tuple(name for name in ranked for _ in range(counts[name]))


def step_flops(model: Model, setup: TrainingSetup) -> float:
    """Model FLOPs of one micro-batch's forward + backward on one device: ``flops_per_token``
    (``6N + 12LHQT``, ``T`` the whole sequence) over the ``s*b/(t c)`` tokens per rank (a
    transformers model: :meth:`~.moe.model.TransformersModel.step_flops`)."""
    if not isinstance(model, ModelShape):
        return model.step_flops(setup)
    s = setup.seq_len
    return model.flops_per_token(s) * setup.local_seq_len * setup.micro_batch / setup.tp


__all__ = [
    "LayerOption",
    "Layers",
    "canonical_order",
    "layer_option",
    "layer_options",
    "offered_configs",
    "offered_presets",
    "per_layer_options",
    "selective_saving_with_flash",
    "stack_options",
    "step_flops",
]
