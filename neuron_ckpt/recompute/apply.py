"""Applying a :class:`~.config.RecomputeConfig` to a stack of transformer layers.

Contract for models (ours and yours)::

    class MyModel(nn.Module):
        def __init__(self, ...):
            self.layers = nn.ModuleList([...])          # each layer: (hidden, *extra) -> hidden

        def forward(self, ...):
            ...
            hidden = run_layers(self.layers, hidden, *extra_args, **extra_kwargs)
            ...

    model = MyModel(...)
    apply_recompute(model.layers, RecomputeConfig(granularity="selective"), sequence_parallel=sp)

* Each layer takes the hidden states as its first positional argument and returns the new hidden
  states (one tensor); ``extra_args`` / ``extra_kwargs`` (rotary tables, masks, ...) are passed
  unchanged to every layer.
* :func:`run_layers` is a plain loop unless full ``uniform`` recompute with ``num_layers > 1`` is
  applied; then each group of ``num_layers`` consecutive layers runs as ONE checkpoint (only the
  group's input is kept). A model whose forward loops over its layers itself still gets
  selective, ``block`` and ``uniform`` with ``num_layers=1`` recompute; with grouped ``uniform``
  its layers raise a clear error telling it to use :func:`run_layers`.
* ``apply_recompute`` also takes a per-layer list (one ``RecomputeConfig | None`` per layer, as
  the memory planner produces): each layer then recomputes on its own (selective modules, or the
  whole layer), so any loop over the layers works.
* Nothing is renamed or re-parented: recompute replaces the ``forward`` of the chosen module
  instances (an instance attribute), so ``state_dict`` keys, ``isinstance`` checks and
  parameters are the same with or without recompute, and checkpoints load either way.
  :func:`remove_recompute` undoes it.

Which submodule a selective name means is set by ``module_map`` (name -> attribute name, dotted
path, class, or a tuple of those); entries given override :data:`DEFAULT_MODULE_MAP` one by
one. A name that matches nothing in a layer is an error, so a typo never silently disables
recompute. For a ``transformers`` Llama layer, for example: ``{"core_attn": "self_attn",
"mlp": "mlp", "mlp_act": "act_fn"}`` (HF's attention module includes the projections).

A name must also land on a submodule whose forward runs. A module that uses a child's parameters
without calling it (``LlamaMLP`` multiplies by ``gate_proj`` and ``up_proj`` in one fused matmul)
lists that child in a class attribute ``weights_only_children``; a name matching such a child is
an error, since wrapping a forward that is never called would recompute nothing.
"""

from __future__ import annotations

import functools
import threading
import weakref
from typing import Any, Callable, Sequence, Union

import torch

from ..parallel.attention import CoreAttention
from ..parallel.norms import LayerNorm, RMSNorm
from .function import checkpoint
from .config import MODULE_ALIASES, MODULES, RecomputeConfig, validate_per_layer

Pattern = Union[str, type, tuple]

DEFAULT_MODULE_MAP: dict[str, Pattern] = {
    "core_attn": CoreAttention,
    "mlp": "mlp",
    "mlp_act": ("act_fn", "mlp_act"),
    "norm": (RMSNorm, LayerNorm, torch.nn.LayerNorm, torch.nn.RMSNorm),
}

# Selective modules whose input is the replicated hidden state (without sequence parallel), so
# distribute_saved_activations can split it; core attention and MLP activation inputs are
# already sharded by head / feature over the TP group and are saved as they are.
_REPLICATED_INPUT = ("mlp", "norm")

_GROUP_ATTR = "_recompute_group"


# --------------------------------------------------------------------------------------------
# Instance-level forward replacements.


class _Recomputed:
    """``module.forward`` replaced: the original forward, run through :func:`checkpoint`.

    The wrapper lives in ``module.__dict__`` and refers back to ``module`` only weakly, so a model
    with recompute applied holds no reference cycle: it is freed as soon as its last user drops
    it, not at the next cycle collection (a model kept alive that long keeps its parallel state
    and process groups alive too). A call hands :func:`checkpoint` a :class:`_Run` holding the
    module strongly, so a pending backward still recomputes after the model is dropped.
    """

    def __init__(self, module: torch.nn.Module, config: RecomputeConfig, distribute: bool):
        self.previous = module.__dict__.get("forward")  # an earlier instance-level forward, if any
        self._module = weakref.ref(module)
        self.config, self.distribute = config, distribute

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

    @property
    def recompute_modules(self) -> list[torch.nn.Module]:
        return [self.module]

    def run(self, *args: Any, **kwargs: Any) -> Any:
        return _Run(self.module, self.previous)(*args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return checkpoint(
            _Run(self.module, self.previous),
            *args,
            use_reentrant=self.config.use_reentrant,
            distribute_saved_activations=self.distribute,
            **kwargs,
        )


class _Run:
    """One call of a wrapped module's own forward; what :func:`checkpoint` keeps for backward."""

    __slots__ = ("module", "previous")

    def __init__(self, module: torch.nn.Module, previous: Callable[..., Any] | None):
        self.module, self.previous = module, previous

    @property
    def recompute_modules(self) -> list[torch.nn.Module]:  # read by checkpoint's XLA barrier
        return [self.module]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # Looked up at call time, so class-level patches (profilers, counters) still apply.
        if self.previous is not None:
            return self.previous(*args, **kwargs)
        return type(self.module).forward(self.module, *args, **kwargs)


_running_group = threading.local()


class _GroupMember(_Recomputed):
    """A layer of a grouped ``uniform`` checkpoint: only :func:`run_layers` may call it."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not getattr(_running_group, "active", False):
            raise RuntimeError(
                f"full recompute with method='uniform' and num_layers={self.config.num_layers} checkpoints "
                "groups of layers, so the stack must run through "
                "neuron_ckpt.recompute.run_layers(layers, hidden_states, *extra_args); this layer was "
                "called directly"
            )
        return self.run(*args, **kwargs)


class _LayerGroup:
    """Consecutive layers run as one checkpoint; kept on the first of them, which it refers to
    weakly (no cycle). :meth:`bound` gives the callable :func:`checkpoint` keeps."""

    def __init__(self, layers: list[torch.nn.Module], config: RecomputeConfig):
        self._layers, self.config = [weakref.ref(layer) for layer in layers], config

    def __len__(self) -> int:
        return len(self._layers)

    def __getstate__(self) -> dict:
        return {"config": self.config, "_layers": [ref() for ref in self._layers]}

    def __setstate__(self, state: dict) -> None:
        self.config, self._layers = state["config"], [weakref.ref(layer) for layer in state["_layers"]]

    def bound(self) -> "_GroupRun":
        layers = [ref() for ref in self._layers]
        if any(layer is None for layer in layers):
            raise RuntimeError("a layer of this recompute group was freed")
        return _GroupRun(layers)


class _GroupRun:
    __slots__ = ("recompute_modules",)

    def __init__(self, layers: list[torch.nn.Module]):
        self.recompute_modules = layers

    def __call__(self, hidden: Any, *args: Any, **kwargs: Any) -> Any:
        outer = getattr(_running_group, "active", False)
        _running_group.active = True
        try:
            for layer in self.recompute_modules:
                hidden = layer(hidden, *args, **kwargs)
        finally:
            _running_group.active = outer
        return hidden


def _wrap(module: torch.nn.Module, wrapper_cls: type, config: RecomputeConfig, distribute: bool) -> None:
    module.forward = wrapper_cls(module, config, distribute)


# --------------------------------------------------------------------------------------------
# Public API.


def run_layers(layers: Sequence[torch.nn.Module], hidden_states: Any, *args: Any, **kwargs: Any) -> Any:
    """``for layer in layers: hidden_states = layer(hidden_states, *args, **kwargs)``, running each
    group set up by full ``uniform`` recompute as one checkpoint."""
    i = 0
    while i < len(layers):
        group = getattr(layers[i], _GROUP_ATTR, None)
        if group is not None:
            c = group.config
            hidden_states = checkpoint(
                group.bound(),
                hidden_states,
                *args,
                use_reentrant=c.use_reentrant,
                distribute_saved_activations=c.distribute_saved_activations,
                **kwargs,
            )
            i += len(group)
        else:
            hidden_states = layers[i](hidden_states, *args, **kwargs)
            i += 1
    return hidden_states


def apply_recompute(
    layers: Union[torch.nn.ModuleList, Sequence[torch.nn.Module], torch.nn.Module],
    config: Union[RecomputeConfig, Sequence[RecomputeConfig | None]],
    module_map: dict[str, Pattern] | None = None,
    sequence_parallel: bool = False,
) -> list[str]:
    """Make ``layers`` recompute as ``config`` says; returns the recomputed units, e.g. ``["0.core_attn",
    ...]`` (selective), ``["0", "1"]`` (block / uniform 1), ``["0-1", "2-3"]`` (uniform 2).

    ``layers``: the transformer layers in order (an ``nn.ModuleList``, a list, or a module with a
    ``.layers`` attribute). ``module_map``: see the module docstring. ``sequence_parallel``: whether
    the model runs sequence parallel (checked against ``distribute_saved_activations``).
    Validation comes first; nothing is changed when it fails. Applying again replaces the
    previous setting.

    ``config`` may also be a per-layer list, one ``RecomputeConfig | None`` per layer (see
    :func:`~.config.validate_per_layer`): ``None`` or ``RecomputeConfig()`` runs that layer
    normally, a selective entry recomputes its modules in that layer, a full entry
    (``num_layers=1``) recomputes that whole layer. Units are named as above, by layer index.
    """
    if isinstance(config, (list, tuple)):
        return _apply_per_layer(_as_layer_list(layers), config, module_map, sequence_parallel)
    if not isinstance(config, RecomputeConfig):
        raise TypeError(
            f"config must be a RecomputeConfig or a per-layer list of them, got {type(config).__name__}"
        )
    layers = _as_layer_list(layers)
    config.validate(len(layers), sequence_parallel)
    patterns = _module_map(module_map) if config.granularity == "selective" else {}
    targets = _selective_targets(layers, config, patterns) if patterns else []

    remove_recompute(layers)
    if config.granularity == "selective":
        for qualname, module, distribute in targets:
            if not isinstance(module.__dict__.get("forward"), _Recomputed):  # shared across layers
                _wrap(module, _Recomputed, config, distribute and config.distribute_saved_activations)
        return [q for q, _, _ in targets]
    if config.granularity != "full":
        return []
    k, n = config.num_layers, len(layers)
    if config.method == "block" or k == 1:
        count = k if config.method == "block" else n
        for layer in layers[:count]:
            _wrap(layer, _Recomputed, config, config.distribute_saved_activations)
        return [str(i) for i in range(count)]
    units = []
    for start in range(0, n, k):
        members = list(layers[start : start + k])
        for layer in members:
            _wrap(layer, _GroupMember, config, False)
        setattr(members[0], _GROUP_ATTR, _LayerGroup(members, config))
        units.append(f"{start}-{start + len(members) - 1}")
    return units


def layer_runner(
    model: torch.nn.Module,
    config: Union[RecomputeConfig, Sequence[RecomputeConfig | None]],
    module_map: dict[str, Pattern] | None = None,
    sequence_parallel: bool | None = None,
) -> Callable[..., Any]:
    """For a model that keeps its layers in ``model.layers``: apply ``config`` (one config, or a
    per-layer list) to them and return ``run(hidden_states, *args, **kwargs) -> hidden_states``
    (:func:`run_layers` bound to them).

    ``sequence_parallel`` defaults to ``model.sequence_parallel`` (False if absent).
    """
    if sequence_parallel is None:
        sequence_parallel = bool(getattr(model, "sequence_parallel", False))
    apply_recompute(model, config, module_map, sequence_parallel)
    return functools.partial(run_layers, model.layers)


def remove_recompute(layers: Union[torch.nn.ModuleList, Sequence[torch.nn.Module], torch.nn.Module]) -> None:
    """Undo :func:`apply_recompute` on ``layers`` (and every submodule)."""
    for layer in _as_layer_list(layers):
        for module in layer.modules():
            module.__dict__.pop(_GROUP_ATTR, None)
            wrapper = module.__dict__.get("forward")
            while isinstance(wrapper, _Recomputed):
                if wrapper.previous is None:
                    del module.__dict__["forward"]
                else:
                    module.__dict__["forward"] = wrapper.previous
                wrapper = module.__dict__.get("forward")


def _apply_per_layer(
    layers: list[torch.nn.Module],
    configs: Sequence[RecomputeConfig | None],
    module_map: dict[str, Pattern] | None,
    sequence_parallel: bool,
) -> list[str]:
    """:func:`apply_recompute` with one entry per layer; every layer is its own unit."""
    validate_per_layer(configs, len(layers), sequence_parallel)
    patterns = _module_map(module_map) if any(c is not None and c.granularity == "selective" for c in configs) else {}
    wraps: list[tuple[str, torch.nn.Module, RecomputeConfig, bool]] = []  # all found before any change
    for i, (layer, c) in enumerate(zip(layers, configs)):
        if c is None or not c.enabled:
            continue
        if c.granularity == "full":
            wraps.append((str(i), layer, c, c.distribute_saved_activations))
            continue
        for qualname, module, replicated in _selective_targets([layer], c, patterns, first_index=i):
            wraps.append((qualname, module, c, replicated and c.distribute_saved_activations))
    remove_recompute(layers)
    units = []
    for unit, module, c, distribute in wraps:
        if not isinstance(module.__dict__.get("forward"), _Recomputed):  # a module shared by layers: once
            _wrap(module, _Recomputed, c, distribute)
        units.append(unit)
    return units


# --------------------------------------------------------------------------------------------
# Helpers.


def _as_layer_list(layers: Any) -> list[torch.nn.Module]:
    if isinstance(layers, torch.nn.Module) and not isinstance(layers, (torch.nn.ModuleList, torch.nn.Sequential)):
        if not isinstance(getattr(layers, "layers", None), (torch.nn.ModuleList, list, tuple)):
            raise TypeError(
                f"layers must be an nn.ModuleList, a sequence of modules or a module with a .layers "
                f"attribute; got {type(layers).__name__} without .layers"
            )
        layers = layers.layers
    layers = list(layers)
    for i, layer in enumerate(layers):
        if not isinstance(layer, torch.nn.Module):
            raise TypeError(f"layers[{i}] must be an nn.Module, got {type(layer).__name__}")
    if not layers:
        raise ValueError("layers is empty: nothing to recompute")
    return layers


def _module_map(module_map: dict[str, Pattern] | None) -> dict[str, Pattern]:
    merged = dict(DEFAULT_MODULE_MAP)
    for name, pattern in (module_map or {}).items():
        canonical = MODULE_ALIASES.get(name, name)
        if canonical not in MODULES:
            raise ValueError(f"module_map: unknown module {name!r}; known modules: {list(MODULES)}")
        if not _valid_pattern(pattern):
            raise ValueError(
                f"module_map[{name!r}] must be an attribute name / dotted path (str), a module class, "
                f"or a tuple of those; got {pattern!r}"
            )
        merged[canonical] = pattern
    return merged


def _valid_pattern(pattern: Any) -> bool:
    if isinstance(pattern, (tuple, list)):
        return bool(pattern) and all(_valid_pattern(p) for p in pattern)
    return (isinstance(pattern, str) and bool(pattern)) or (
        isinstance(pattern, type) and issubclass(pattern, torch.nn.Module)
    )


def _matches(qualname: str, module: torch.nn.Module, pattern: Pattern) -> bool:
    if isinstance(pattern, (tuple, list)):
        return any(_matches(qualname, module, p) for p in pattern)
    if isinstance(pattern, str):
        return qualname == pattern or qualname.endswith("." + pattern)
    return isinstance(module, pattern)


def _children_without_forward(layer: torch.nn.Module) -> list[str]:
    """Qualified names of the submodules of ``layer`` whose forward never runs: those a module
    lists in its ``weights_only_children`` (it uses their parameters directly)."""
    idle = []
    for q, m in layer.named_modules():
        for child in getattr(m, "weights_only_children", ()):
            idle.append(f"{q}.{child}" if q else child)
    return idle


def _selective_targets(
    layers: list[torch.nn.Module], config: RecomputeConfig, patterns: dict[str, Pattern], first_index: int = 0
) -> list[tuple[str, torch.nn.Module, bool]]:
    """``(qualified name, module, input is replicated)`` to wrap; outermost match wins."""
    targets = []
    for i, layer in enumerate(layers, start=first_index):
        found: dict[str, tuple[torch.nn.Module, bool]] = {}
        idle = _children_without_forward(layer)
        for name in config.modules:
            hits = [(q, m) for q, m in layer.named_modules() if q and _matches(q, m, patterns[name])]
            if not hits:
                raise ValueError(
                    f"modules: {name!r} matched no submodule of layer {i} ({type(layer).__name__}) with "
                    f"pattern {patterns[name]!r}; pass module_map={{{name!r}: <attribute name or class>}}. "
                    f"Submodules: {[q for q, _ in layer.named_modules() if q][:20]}"
                )
            for q, m in hits:
                owner = next((o for o in idle if q == o or q.startswith(o + ".")), None)
                if owner is not None:
                    parent = layer.get_submodule(owner.rpartition(".")[0]) if "." in owner else layer
                    raise ValueError(
                        f"modules: {name!r} matched {q!r} in layer {i} ({type(layer).__name__}) with pattern "
                        f"{patterns[name]!r}, but {type(parent).__name__} never runs the forward of "
                        f"{owner.rpartition('.')[2]!r} (it reads only its weights, in a fused matmul), so "
                        f"recomputing it would recompute nothing; pass module_map={{{name!r}: <a submodule "
                        "whose forward runs>}}"
                    )
                if all(m is not other for other, _ in found.values()):  # a shared instance once
                    found.setdefault(q, (m, name in _REPLICATED_INPUT))
        for q, (m, replicated) in found.items():
            if any(q.startswith(other + ".") for other in found):
                continue  # an enclosing module is recomputed already
            targets.append((f"{i}.{q}", m, replicated))
    return targets
