"""``offload_modules`` applied to a model: which units each layer offloads (:func:`plan`, changing
nothing, refusing what cannot be offloaded), then the hooks (:func:`install`), and taking them off
(:func:`remove`). Called by ``apply_recompute`` / ``remove_recompute`` (:mod:`..apply`)."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from ..config import RecomputeConfig
from ..module import unwrapped
from ..module_map import Patterns, check_every_name_matched, selected_modules
from ..patch import mark
from .copies import Copies, StreamCopies, SyncCopies
from .engine import Offloader, OffloadStats
from .hooks import Group, LayerHooks

_HOOKS = "_neuron_ckpt_offload"  # on a module with offload hooks: its Group / LayerHooks (for remove)
FUNCTION_GROUP = "_neuron_ckpt_offload_function"  # on a module whose forward calls an offloaded function
_OFFLOADER = "_neuron_ckpt_offloader"  # on the root (or each layer of a plain list): the Offloader
MARK = "offload: what it keeps goes to host"

# A function unit (transformers' core attention): the name, and per layer the module calling it or None.
Functions = dict[str, Callable[[torch.nn.Module], torch.nn.Module | None]]


@dataclass(frozen=True)
class Unit:
    """One offloaded unit: layer ``index``'s ``module`` (None: the whole layer) named ``name``
    (``"3.mlp"``, ``"3"``), or a function called by ``module`` (``function=True``)."""

    index: int
    name: str
    module: torch.nn.Module | None
    function: bool = False


def per_layer_names(config: RecomputeConfig | Sequence[RecomputeConfig | None] | None, n: int) -> list[tuple[str, ...]]:
    """The offloaded names of each of ``n`` layers: one config applies to every layer but the last
    (backward needs it first); a per-layer list says it layer by layer."""
    if config is None or isinstance(config, RecomputeConfig):
        names = config.offload_modules if config is not None else ()
        return [names if i < n - 1 else () for i in range(n)]
    return [c.offload_modules if c is not None else () for c in config]


def plan(
    layers: Sequence[torch.nn.Module],
    names: list[tuple[str, ...]],
    patterns: Patterns,
    recomputed: set[int],
    functions: Functions,
    model: str,
) -> list[Unit]:
    """The units to offload, changing nothing. ``recomputed``: ids of the modules recomputed as a
    whole (selective units, full-recompute layers); an offloaded module inside one keeps nothing
    (the checkpoint keeps only its inputs) and is refused. A name no layer has is refused too."""
    units: list[Unit] = []
    matched: set[str] = set()
    for i, (layer, wanted) in enumerate(zip(layers, names)):
        if "layer" in wanted:
            units.append(Unit(i, str(i), None))
            matched.add("layer")
            continue
        for name in [n for n in wanted if n in functions]:
            module = functions[name](layer)
            if module is not None:
                units.append(Unit(i, f"{i}.{name}", module, function=True))
                matched.add(name)
        plain = [n for n in wanted if n not in functions]
        for qualname, module, _, name in selected_modules(layer, i, plain, patterns, matched):
            inside = _recomputed_ancestor(layer, qualname, recomputed)
            if inside is not None:
                raise ValueError(
                    f"offload_modules: {name!r} ({qualname!r} in layer {i}) lies inside {inside!r}, which is "
                    f"recomputed: its checkpoint keeps only its inputs, so there is nothing of {name!r} to offload; "
                    f"offload {inside.rpartition('.')[2]!r} (its checkpoint's inputs) instead"
                )
            units.append(Unit(i, f"{i}.{qualname}", module))
    requested = {n for wanted in names for n in wanted if n != "layer" and n not in functions}
    check_every_name_matched(requested, matched, patterns, model, "offload_modules")
    return units


def _recomputed_ancestor(layer: torch.nn.Module, qualname: str, recomputed: set[int]) -> str | None:
    parts = qualname.split(".")
    if id(layer) in recomputed:
        return "the layer"
    for k in range(1, len(parts)):
        prefix = ".".join(parts[:k])
        if id(unwrapped(layer.get_submodule(prefix))) in recomputed:
            return prefix
    return None


def install(
    units: list[Unit],
    layer_slots: Sequence[torch.nn.Module],
    layers: Sequence[torch.nn.Module],
    holders: Callable[[torch.nn.Module], list[torch.nn.Module]],
) -> Offloader | None:
    """Hooks for ``units`` (from :func:`plan`) on the modules standing where they stand now
    (``holders(module)``: the module or its ``Recompute``), and on every layer's slot module
    (``layer_slots``) when anything is offloaded. Returns the model's offloader, None without units."""
    if not units:
        return None
    offloader = Offloader(_copies_for())
    whole = {u.index for u in units if u.module is None}
    for i, (slot, layer) in enumerate(zip(layer_slots, layers)):
        slot.__dict__[_HOOKS] = LayerHooks(offloader, i, slot, layer, i in whole)
        if i in whole:
            mark(layer, MARK)
    for unit in units:
        if unit.module is None:
            continue
        group = Group(offloader, unit.name)
        function = unit.name.split(".")[-1]
        mark(unit.module, f"offload {function}: what it keeps goes to host" if unit.function else MARK)
        if unit.function:
            for module in unit.module.modules():
                module.__dict__[FUNCTION_GROUP] = group
            continue
        for holder in {id(h): h for h in holders(unit.module)}.values():  # held twice: one wrapper, once
            holder.__dict__[_HOOKS] = _ModuleHooks(group, holder)
    return offloader


class _ModuleHooks:
    def __init__(self, group: Group, module: torch.nn.Module):
        self.handles = [
            module.register_forward_pre_hook(group.pre_hook),
            module.register_forward_hook(group.post_hook, always_call=True),
        ]

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def remove(module: torch.nn.Module) -> None:
    """Take offload's hooks and marks off ``module`` (one module; the caller walks the tree)."""
    hooks = module.__dict__.pop(_HOOKS, None)
    if hooks is not None:
        hooks.remove()
    module.__dict__.pop(FUNCTION_GROUP, None)  # remove_recompute walks every module
    module.__dict__.pop(_OFFLOADER, None)


def attach(root: torch.nn.Module | Sequence[torch.nn.Module], offloader: Offloader | None) -> None:
    """Keep ``offloader`` on the model (or on each layer of a plain list), for :func:`offload_stats`."""
    for module in [root] if isinstance(root, torch.nn.Module) else root:
        if offloader is not None:
            module.__dict__[_OFFLOADER] = offloader


def offload_stats(model: torch.nn.Module) -> OffloadStats:
    """What offload moved in ``model`` since the stats were last reset (``.reset()``): bytes per
    unit, copies, reloads, prefetched reloads. A model without offload: an error naming it."""
    for module in [model, *model.modules()]:
        offloader = module.__dict__.get(_OFFLOADER)
        if offloader is not None:
            return offloader.stats
    raise ValueError(
        f"{type(model).__name__} offloads nothing: apply_recompute(model, RecomputeConfig(offload_modules=[...]))"
    )


# --------------------------------------------------------------------------------------------
# Which copies a device gets: streams on an accelerator, at once on CPU, or what a test says.

_OVERRIDE: contextvars.ContextVar[Copies | None] = contextvars.ContextVar("neuron_ckpt_offload_copies", default=None)


@contextlib.contextmanager
def copies_override(copies: Copies) -> Iterator[None]:
    """Every storage offloaded in this block is copied by ``copies`` (tests: a backend that defers
    copies and poisons what is read too early; the copy keeps its backend for the reload)."""
    token = _OVERRIDE.set(copies)
    try:
        yield
    finally:
        _OVERRIDE.reset(token)


def _copies_for() -> Callable[[torch.device], Copies]:
    streams: dict[torch.device, Copies] = {}
    sync = SyncCopies()

    def choose(device: torch.device) -> Copies:
        override = _OVERRIDE.get()
        if override is not None:
            return override
        if device.type == "cpu":
            return sync
        if device not in streams:
            streams[device] = StreamCopies(device)
        return streams[device]

    return choose
