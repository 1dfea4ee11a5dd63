"""Recompute applied to a model after it is built: :func:`apply_recompute`, the one entry point.

::

    model = LlamaForCausalLM(config, sequence_parallel=True)
    apply_recompute(model, RecomputeConfig(granularity="selective"))   # validates, then applies

Contract for models (ours and yours)::

    class MyModel(nn.Module):
        def __init__(self, ...):
            self.layers = nn.ModuleList([...])          # each layer: (hidden, *extra) -> hidden

        def forward(self, ...):
            ...
            hidden = run_layers(self.layers, hidden, *extra_args, **extra_kwargs)

* Each layer takes the hidden states as its first positional argument and returns the new hidden
  states (one tensor); ``extra_args`` / ``extra_kwargs`` (rotary tables, masks, ...) are passed
  unchanged to every layer.
* :func:`run_layers` is a plain loop unless full ``uniform`` recompute with ``num_layers > 1`` is
  applied; then each group of ``num_layers`` consecutive layers runs as ONE activation
  checkpoint (only the group's input is kept). A model whose forward loops over its layers
  itself still gets selective, ``block`` and ``uniform`` with ``num_layers=1`` recompute; with
  grouped ``uniform`` its layers raise a clear error telling it to use :func:`run_layers`.
  Whole layers are replaced in their ``nn.ModuleList``, so full recompute needs the model or
  its ``ModuleList``, not a plain list of layers.
* ``apply_recompute`` also takes a per-layer list (one ``RecomputeConfig | None`` per layer, as
  the memory planner produces): each entry is applied to its own layer by the strategy it names,
  so any loop over the layers works.
* Each recomputed module is replaced, where it stands, by a :class:`~.module.Recompute` holding
  it (``print(model)`` shows them); parameter names and ``state_dict`` keys are the same with or
  without recompute, and saved checkpoints load either way. :func:`remove_recompute` puts the
  modules back.

Which submodule a selective name means (``module_map``) is in :mod:`.module_map`.

Inside: one function per strategy (``_selective``, ``_full_block``, ``_full_uniform``; and
``_per_layer``, which applies them one layer at a time) lists the units to recompute, changing
nothing; once every check has passed each unit is installed: its module (or each layer of a
group) replaced by a :class:`~.module.Recompute` in every place the model holds it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..parallel import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear, VocabParallelEmbedding
from ..parallel.norms import LayerNorm, RMSNorm
from . import hf, mla, moe
from .config import RecomputeConfig, validate_per_layer
from .module import SEQUENCE_PARALLEL, DiscardScope, Recompute, unwrapped
from .module_map import DISCARDING, Patterns, check_every_name_matched, resolve_module_map, selected_modules
from .offload import install as offload
from .patch import unpatch

Layers = torch.nn.Module | Sequence[torch.nn.Module]  # a model with .layers, or the layers
_SCOPE = "_neuron_ckpt_discard_scope"  # on a layer with output-discarding units: its DiscardScope
Modules = list[torch.nn.Module]

# Our layers that take sequence_parallel: a model built from them runs sequence parallel if they do.
_SEQUENCE_PARALLEL_LAYERS = (
    ColumnParallelLinear, RowParallelLinear, QKVParallelLinear, VocabParallelEmbedding, RMSNorm, LayerNorm,
)  # fmt: skip


# --------------------------------------------------------------------------------------------
# Public API.


def apply_recompute(
    model: Layers,
    config: RecomputeConfig | Sequence[RecomputeConfig | None] | None,
    module_map: Patterns | None = None,
    sequence_parallel: bool | None = None,
) -> list[str]:
    """Make ``model``'s layers recompute (and offload) as ``config`` says; returns the recomputed
    units, e.g. ``["0.core_attn", ...]`` (selective), ``["0", "1"]`` (block / uniform 1),
    ``["0-1", "2-3"]`` (uniform 2), then the offloaded ones (``"0.mlp (offload)"``, ``"0 (offload)"``
    for a whole layer; :mod:`.offload`).

    ``model``: a module whose transformer layers are ``model.layers``, or the layers themselves
    (an ``nn.ModuleList`` or a list). ``config``: one :class:`RecomputeConfig` for every layer
    (None: no recompute, as ``RecomputeConfig()``), or a per-layer list, one
    ``RecomputeConfig | None`` per layer (see :func:`~.config.validate_per_layer`): ``None`` or
    ``RecomputeConfig()`` runs that layer normally, a selective entry recomputes its modules in
    that layer, a full entry (``num_layers=1``) recomputes that whole layer; units are then named
    by layer index as above.
    ``module_map``: see the module docstring. ``sequence_parallel``: whether the model runs
    sequence parallel (checked against ``distribute_saved_activations``); None reads it from the
    layers: True when one of this library's parallel layers in them was built with
    ``sequence_parallel=True``.

    Validation comes first; nothing is changed when it fails. Applying again replaces the
    previous setting. A ``transformers`` model (a ``PreTrainedModel``: a ``*ForCausalLM`` or its
    base model) is handled by :mod:`.hf` (its decoder layers, core attention, KV cache).
    """
    if hf.is_transformers_model(model):  # its layers, core attention and KV cache: see .hf
        layers, generic, finish = hf.prepare(model, config, module_map, sequence_parallel)
        functions = hf.offload_functions(module_map)
        return _apply(model, layers, generic, module_map, sequence_parallel, functions) + finish()
    return _apply(_container(model), _as_layer_list(model), config, module_map, sequence_parallel)


def remove_recompute(model: Layers) -> None:
    """Undo :func:`apply_recompute` on ``model``: every :class:`~.module.Recompute` is replaced by
    the module it holds."""
    if hf.is_transformers_model(model):
        hf.undo(model)  # type: ignore[arg-type]  # a transformers model: a Module
    roots = [model] if isinstance(model, torch.nn.Module) else list(model)
    for root in roots:
        unpatch(map(unwrapped, root.modules()))
        for parent in list(root.modules()):
            scope = parent.__dict__.pop(_SCOPE, None)
            if scope is not None:
                scope.remove()
            offload.remove(parent)
            for name, child in list(parent._modules.items()):
                if isinstance(child, Recompute):
                    parent._modules[name] = child.module


def _apply(
    root,
    layers: Modules,
    config,
    module_map,
    sequence_parallel: bool | None,
    functions: offload.Functions | None = None,
) -> list[str]:
    """Validate, list the units (changing nothing), then replace each unit's module in ``root``
    (a module holding the layers, or None for a plain list of them) and put offload's hooks on
    the units ``offload_modules`` names (``functions``: offloaded names that are functions, .hf)."""
    if sequence_parallel is None:
        sequence_parallel = _runs_sequence_parallel(layers)
    patterns = resolve_module_map(module_map)
    if config is None:
        config = RecomputeConfig()
    matched: set[str] = set()
    if isinstance(config, RecomputeConfig):
        config.validate(len(layers), sequence_parallel)
        units = _units(layers, config, patterns, matched)
        configs = [config]
    elif isinstance(config, (list, tuple)):
        validate_per_layer(config, len(layers), sequence_parallel)
        units = _per_layer(layers, config, patterns, matched)
        configs = list(config)
    else:
        raise TypeError(
            f"config must be a RecomputeConfig, a per-layer list of them or None, got {type(config).__name__}"
        )
    requested = {m for c in configs if c is not None and c.granularity == "selective" for m in c.modules}
    model_name = type(root).__name__ if root is not None else "the layers"
    check_every_name_matched(requested, matched, patterns, model_name)
    if root is None and any(m is layer for unit in units for m in unit.modules for layer in layers):
        raise TypeError(
            "full recompute replaces whole layers where the model holds them: pass the model or its "
            "nn.ModuleList of layers, not a plain list"
        )
    recomputed = {id(m) for unit in units if unit.kind not in _INSTALLERS for m in unit.modules}
    offloaded = offload.plan(
        layers, offload.per_layer_names(config, len(layers)), patterns, recomputed, functions or {}, model_name
    )
    remove_recompute(root if root is not None else layers)
    slots = _slots(root if root is not None else layers)
    for unit in units:
        unit.install(slots)
    for layer in {id(u.layer): u.layer for u in units if u.discard}.values():
        layer.__dict__[_SCOPE] = DiscardScope(layer)  # type: ignore[arg-type]  # a discarding unit has its layer

    def holders(module: torch.nn.Module) -> list[torch.nn.Module]:  # what stands where module stood
        return [parent._modules[name] for parent, name in slots.get(id(module), [])] or [module]  # type: ignore[misc]  # set slots hold modules

    offloader = offload.install(offloaded, [holders(layer)[0] for layer in layers], layers, holders)
    offload.attach(root if root is not None else layers, offloader)
    return [unit.name for unit in units] + [f"{unit.name} (offload)" for unit in offloaded]


# --------------------------------------------------------------------------------------------
# The strategies: each lists its units, changing nothing.


@dataclass(frozen=True)
class _Unit:
    """What one activation checkpoint covers: one module (a selective submodule or a whole
    layer), or consecutive layers run as one (grouped ``uniform``). ``discard``: an
    output-discarding selective unit (``norm``, ``mlp_act``) of ``layer``, whose forward then
    runs in one ``discard_outputs`` block. ``kind``: the selective name (``moe_act`` and
    ``mla_up_proj`` install themselves, :data:`_INSTALLERS`)."""

    name: str
    modules: tuple[torch.nn.Module, ...]
    config: RecomputeConfig
    distribute: bool  # keep a 1/t slice of the (replicated) input
    discard: bool = False
    layer: torch.nn.Module | None = None
    kind: str | None = None

    def install(self, slots: dict[int, list[tuple[torch.nn.Module, str]]]) -> None:
        if self.kind in _INSTALLERS:
            _INSTALLERS[self.kind](self.modules[0], self.config, slots)
            return
        k = len(self.modules)
        for j, module in enumerate(self.modules):
            span = 1 if k == 1 else (k if j == 0 else 0)
            wrapper = moe.wrapper(module, self.config, self.distribute and k == 1, span, self.discard, self.kind)
            for parent, name in slots[id(module)]:  # a module held in two places: one wrapper
                parent._modules[name] = wrapper


# Units that are not a module replaced by a Recompute: the experts' activation (an act_fn module
# and an _apply_gate method), MLA's up part (inside its attention's forward).
_INSTALLERS: dict[str, Callable[..., None]] = {"moe_act": moe.install_expert_act, "mla_up_proj": mla.install}


def _units(
    layers: Modules, config: RecomputeConfig, patterns: Patterns, matched: set[str], first: int = 0
) -> list[_Unit]:
    """The units of ``config`` applied to ``layers`` (numbered from ``first``); the selective
    names that matched are added to ``matched``."""
    if config.granularity == "selective":
        return _selective(layers, config, patterns, matched, first)
    if config.granularity == "full":
        return (_full_block if config.method == "block" else _full_uniform)(layers, config, first)
    return []


def _selective(
    layers: Modules, config: RecomputeConfig, patterns: Patterns, matched: set[str], first: int
) -> list[_Unit]:
    """Each layer's submodules named in ``config.modules``, one unit each."""
    return [
        _Unit(
            f"{i}.{qualname}",
            (module,),
            config,
            replicated and config.distribute_saved_activations,
            name in DISCARDING,
            layer,
            name,
        )
        for i, layer in enumerate(layers, start=first)
        for qualname, module, replicated, name in selected_modules(layer, i, config.modules, patterns, matched)
    ]


def _full_block(layers: Modules, config: RecomputeConfig, first: int) -> list[_Unit]:
    """The first ``num_layers`` layers, one unit each; the rest run normally."""
    return [
        _Unit(str(i), (layer,), config, config.distribute_saved_activations)
        for i, layer in enumerate(layers[: config.num_layers], start=first)
    ]


def _full_uniform(layers: Modules, config: RecomputeConfig, first: int) -> list[_Unit]:
    """Consecutive groups of ``num_layers`` layers (the last may be shorter), one unit each."""
    k = config.num_layers
    assert k is not None  # full recompute always names it (RecomputeConfig checks)
    units = []
    for start in range(0, len(layers), k):
        group = tuple(layers[start : start + k])
        a, b = first + start, first + start + len(group) - 1
        units.append(_Unit(str(a) if k == 1 else f"{a}-{b}", group, config, config.distribute_saved_activations))
    return units


def _per_layer(
    layers: Modules, configs: Sequence[RecomputeConfig | None], patterns: Patterns, matched: set[str]
) -> list[_Unit]:
    """A per-layer list: each entry applied to its own layer by the strategies above."""
    return [
        unit
        for i, (layer, config) in enumerate(zip(layers, configs))
        if config is not None
        for unit in _units([layer], config, patterns, matched, first=i)
    ]


# --------------------------------------------------------------------------------------------
# Helpers.


def _as_layer_list(model: Layers) -> Modules:
    layers = model
    if isinstance(model, torch.nn.Module) and not isinstance(model, (torch.nn.ModuleList, torch.nn.Sequential)):
        try:
            layers = model.layers  # type: ignore[assignment]  # a ModuleList or ModuleDict
        except AttributeError:
            layers = None  # type: ignore[assignment]  # refused just below
        if isinstance(layers, torch.nn.ModuleDict):  # a pipeline stage's layers, keyed by global index
            layers = list(layers.values())
        if not isinstance(layers, (torch.nn.ModuleList, list, tuple)):
            raise TypeError(
                f"layers must be an nn.ModuleList, a sequence of modules or a module with a .layers "
                f"attribute; got {type(model).__name__} without .layers"
            )
    layers = [unwrapped(layer) for layer in layers]  # type: ignore[union-attr]  # a sequence by now
    for i, layer in enumerate(layers):
        if not isinstance(layer, torch.nn.Module):
            raise TypeError(f"layers[{i}] must be an nn.Module, got {type(layer).__name__}")
    if not layers:
        raise ValueError("layers is empty: nothing to recompute")
    return layers


def _container(model: Layers) -> torch.nn.Module | None:
    """The module whose tree holds the layers: the model, a ModuleList, or None for a plain list."""
    return model if isinstance(model, torch.nn.Module) else None


def _slots(roots: torch.nn.Module | Sequence[torch.nn.Module]) -> dict[int, list[tuple[torch.nn.Module, str]]]:
    """``id(module) -> [(parent, child name), ...]``: every place the tree holds each module."""
    slots: dict[int, list[tuple[torch.nn.Module, str]]] = {}
    for root in [roots] if isinstance(roots, torch.nn.Module) else roots:
        for parent in root.modules():
            for name, child in parent._modules.items():
                if child is not None:
                    slots.setdefault(id(child), []).append((parent, name))
    return slots


def _runs_sequence_parallel(layers: Modules) -> bool:
    if any(unwrapped(layer).__dict__.get(SEQUENCE_PARALLEL, False) for layer in layers):
        return True
    return any(
        unwrapped(m).sequence_parallel for layer in layers for m in layer.modules()
        if isinstance(unwrapped(m), _SEQUENCE_PARALLEL_LAYERS)
    )  # fmt: skip
