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
* ``apply_recompute`` also takes a per-layer list (one ``RecomputeConfig | None`` per layer, as
  the memory planner produces): each entry is applied to its own layer by the strategy it names,
  so any loop over the layers works.
* Nothing is renamed or re-parented: recompute replaces the ``forward`` of the chosen module
  instances (an instance attribute), so ``state_dict`` keys, ``isinstance`` checks and
  parameters are the same with or without recompute, and saved checkpoints load either way.
  :func:`remove_recompute` undoes it.

Which submodule a selective name means (``module_map``) is in :mod:`.module_map`.

Inside: one function per strategy (``_selective``, ``_full_block``, ``_full_uniform``; and
``_per_layer``, which applies them one layer at a time) lists the units to recompute, changing
nothing; once every check has passed each unit is installed: a module's forward replaced by a
``_Recomputed``, or the layers of a group tied to one ``_Group`` that :func:`run_layers` runs as
a single activation checkpoint.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Sequence, Union

import torch

from ..parallel import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear, VocabParallelEmbedding
from ..parallel.norms import LayerNorm, RMSNorm
from . import hf
from .activation_checkpoint import checkpoint
from .config import RecomputeConfig, validate_per_layer
from .module_map import Patterns, resolve_module_map, selected_modules

Layers = Union[torch.nn.Module, Sequence[torch.nn.Module]]  # a model with .layers, or the layers
Modules = list[torch.nn.Module]

# Our layers that take sequence_parallel: a model built from them runs sequence parallel if they do.
_SEQUENCE_PARALLEL_LAYERS = (
    ColumnParallelLinear, RowParallelLinear, QKVParallelLinear, VocabParallelEmbedding, RMSNorm, LayerNorm,
)  # fmt: skip


# --------------------------------------------------------------------------------------------
# Public API.


def apply_recompute(
    model: Layers,
    config: Union[RecomputeConfig, Sequence[RecomputeConfig | None], None],
    module_map: Patterns | None = None,
    sequence_parallel: bool | None = None,
) -> list[str]:
    """Make ``model``'s layers recompute as ``config`` says; returns the recomputed units, e.g.
    ``["0.core_attn", ...]`` (selective), ``["0", "1"]`` (block / uniform 1), ``["0-1", "2-3"]``
    (uniform 2).

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
        return apply_recompute(layers, generic, module_map, sequence_parallel) + finish()
    layers = _as_layer_list(model)
    if sequence_parallel is None:
        sequence_parallel = _runs_sequence_parallel(layers)
    patterns = resolve_module_map(module_map)
    if config is None:
        config = RecomputeConfig()
    if isinstance(config, RecomputeConfig):
        config.validate(len(layers), sequence_parallel)
        units = _units(layers, config, patterns)
    elif isinstance(config, (list, tuple)):
        validate_per_layer(config, len(layers), sequence_parallel)
        units = _per_layer(layers, config, patterns)
    else:
        raise TypeError(
            f"config must be a RecomputeConfig, a per-layer list of them or None, got {type(config).__name__}"
        )
    remove_recompute(layers)
    for unit in units:
        unit.install()
    return [unit.name for unit in units]


def run_layers(layers: Sequence[torch.nn.Module], hidden_states: Any, *args: Any, **kwargs: Any) -> Any:
    """``for layer in layers: hidden_states = layer(hidden_states, *args, **kwargs)``, running each
    group set up by full ``uniform`` recompute as one activation checkpoint."""
    i = 0
    while i < len(layers):
        wrapper = layers[i].__dict__.get("forward")
        group = wrapper.group if isinstance(wrapper, _Recomputed) else None
        if group is not None and group.starts_with(layers[i]):
            hidden_states = group(hidden_states, *args, **kwargs)
            i += len(group)
        else:
            hidden_states = layers[i](hidden_states, *args, **kwargs)
            i += 1
    return hidden_states


def remove_recompute(model: Layers) -> None:
    """Undo :func:`apply_recompute` on ``model``'s layers (and every submodule)."""
    if hf.is_transformers_model(model):
        hf.undo(model)
        model = hf.decoder_layers(model)
    for layer in _as_layer_list(model):
        for module in layer.modules():
            wrapper = module.__dict__.get("forward")
            while isinstance(wrapper, _Recomputed):
                if wrapper.previous is None:
                    del module.__dict__["forward"]
                else:
                    module.__dict__["forward"] = wrapper.previous
                wrapper = module.__dict__.get("forward")


# --------------------------------------------------------------------------------------------
# The strategies: each lists its units, changing nothing.


@dataclass(frozen=True)
class _Unit:
    """What one activation checkpoint covers: one module (a selective submodule or a whole
    layer), or consecutive layers run as one (grouped ``uniform``)."""

    name: str
    modules: tuple[torch.nn.Module, ...]
    config: RecomputeConfig
    distribute: bool  # keep a 1/t slice of the (replicated) input

    def install(self) -> None:
        if len(self.modules) > 1:
            group = _Group(self.modules, self.config)
            for layer in self.modules:
                layer.forward = _Recomputed(layer, self.config, False, group)
            return
        module = self.modules[0]
        if not isinstance(module.__dict__.get("forward"), _Recomputed):  # a module shared by layers: once
            module.forward = _Recomputed(module, self.config, self.distribute)


def _units(layers: Modules, config: RecomputeConfig, patterns: Patterns, first: int = 0) -> list[_Unit]:
    """The units of ``config`` applied to ``layers`` (numbered from ``first``)."""
    if config.granularity == "selective":
        return _selective(layers, config, patterns, first)
    if config.granularity == "full":
        return (_full_block if config.method == "block" else _full_uniform)(layers, config, first)
    return []


def _selective(layers: Modules, config: RecomputeConfig, patterns: Patterns, first: int) -> list[_Unit]:
    """Each layer's submodules named in ``config.modules``, one unit each."""
    return [
        _Unit(f"{i}.{qualname}", (module,), config, replicated and config.distribute_saved_activations)
        for i, layer in enumerate(layers, start=first)
        for qualname, module, replicated in selected_modules(layer, i, config.modules, patterns)
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
    units = []
    for start in range(0, len(layers), k):
        group = tuple(layers[start : start + k])
        a, b = first + start, first + start + len(group) - 1
        units.append(_Unit(str(a) if k == 1 else f"{a}-{b}", group, config, config.distribute_saved_activations))
    return units


def _per_layer(layers: Modules, configs: Sequence[RecomputeConfig | None], patterns: Patterns) -> list[_Unit]:
    """A per-layer list: each entry applied to its own layer by the strategies above."""
    return [
        unit
        for i, (layer, config) in enumerate(zip(layers, configs))
        if config is not None
        for unit in _units([layer], config, patterns, first=i)
    ]


# --------------------------------------------------------------------------------------------
# Instance-level forward replacements.


class _Recomputed:
    """``module.forward`` replaced: the module's own forward, run through :func:`checkpoint`, or,
    for a layer of a :class:`_Group`, run plainly inside the group's activation checkpoint.

    The wrapper lives in ``module.__dict__`` and refers back to ``module`` only weakly, so a model
    with recompute applied holds no reference cycle: it is freed as soon as its last user drops
    it, not at the next cycle collection (a model kept alive that long keeps its parallel state
    and process groups alive too). A call hands :func:`checkpoint` a function holding the module
    strongly, so a pending backward still recomputes after the model is dropped.
    """

    def __init__(self, module: torch.nn.Module, config: RecomputeConfig, distribute: bool, group: _Group | None = None):
        self.previous = module.__dict__.get("forward")  # an earlier instance-level forward, if any
        self._module = weakref.ref(module)
        self.config, self.distribute, self.group = config, distribute, group

    # copy.deepcopy and pickle follow the module (a copied model's wrapper runs the copy).
    def __getstate__(self) -> dict:
        return {**self.__dict__, "_module": self._module()}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _module=weakref.ref(state["_module"]))

    @property
    def module(self) -> torch.nn.Module:
        module = self._module()
        if module is None:
            raise RuntimeError("the module this recompute wrapper belonged to was freed")
        return module

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self.module
        forward = functools.partial(_own_forward, module, self.previous)
        if self.group is None:
            return checkpoint(
                forward,
                *args,
                fence=(module,),
                use_reentrant=self.config.use_reentrant,
                distribute_saved_activations=self.distribute,
                **kwargs,
            )
        if not self.group.running:
            raise RuntimeError(
                f"full recompute with method='uniform' and num_layers={self.config.num_layers} checkpoints "
                "groups of layers, so the stack must run through "
                "neuron_ckpt.recompute.run_layers(layers, hidden_states, *extra_args); this layer was "
                "called directly"
            )
        return forward(*args, **kwargs)


def _own_forward(module: torch.nn.Module, previous: Callable[..., Any] | None, *args: Any, **kwargs: Any) -> Any:
    # Looked up at call time, so class-level patches (profilers, counters) still apply.
    if previous is not None:
        return previous(*args, **kwargs)
    return type(module).forward(module, *args, **kwargs)


class _Group:
    """Consecutive layers run as one activation checkpoint by :func:`run_layers`. Their wrappers
    refer to it; it refers to them weakly (no cycle). ``running`` is True while the group runs
    its layers (forward or recompute): only then do they run."""

    def __init__(self, layers: Sequence[torch.nn.Module], config: RecomputeConfig):
        self._layers, self.config, self.running = [weakref.ref(layer) for layer in layers], config, False

    def __getstate__(self) -> dict:
        return {"config": self.config, "layers": self.layers()}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["layers"], state["config"])

    def __len__(self) -> int:
        return len(self._layers)

    def layers(self) -> Modules:
        layers = [ref() for ref in self._layers]
        if any(layer is None for layer in layers):
            raise RuntimeError("a layer of this recompute group was freed")
        return layers

    def starts_with(self, layer: torch.nn.Module) -> bool:
        return self._layers[0]() is layer

    def __call__(self, hidden: Any, *args: Any, **kwargs: Any) -> Any:
        layers = self.layers()
        return checkpoint(
            functools.partial(_run_group, self, layers),
            hidden,
            *args,
            fence=layers,
            use_reentrant=self.config.use_reentrant,
            distribute_saved_activations=self.config.distribute_saved_activations,
            **kwargs,
        )


def _run_group(group: _Group, layers: Modules, hidden: Any, *args: Any, **kwargs: Any) -> Any:
    outer, group.running = group.running, True
    try:
        for layer in layers:
            hidden = layer(hidden, *args, **kwargs)
    finally:
        group.running = outer
    return hidden


# --------------------------------------------------------------------------------------------
# Helpers.


def _as_layer_list(model: Layers) -> Modules:
    layers = model
    if isinstance(model, torch.nn.Module) and not isinstance(model, (torch.nn.ModuleList, torch.nn.Sequential)):
        try:
            layers = model.layers
        except AttributeError:
            layers = None
        if not isinstance(layers, (torch.nn.ModuleList, list, tuple)):
            raise TypeError(
                f"layers must be an nn.ModuleList, a sequence of modules or a module with a .layers "
                f"attribute; got {type(model).__name__} without .layers"
            )
    layers = list(layers)
    for i, layer in enumerate(layers):
        if not isinstance(layer, torch.nn.Module):
            raise TypeError(f"layers[{i}] must be an nn.Module, got {type(layer).__name__}")
    if not layers:
        raise ValueError("layers is empty: nothing to recompute")
    return layers


def _runs_sequence_parallel(layers: Modules) -> bool:
    return any(
        m.sequence_parallel for layer in layers for m in layer.modules() if isinstance(m, _SEQUENCE_PARALLEL_LAYERS)
    )
