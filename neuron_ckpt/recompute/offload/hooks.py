"""Where offload meets the model: a :class:`Group` per offloaded unit (saved-tensor hooks around
its forward), :class:`LayerHooks` per layer (the layer's run, the prefetch trigger, the ``layer``
group), installed by ``apply_recompute`` and removed by ``remove_recompute``.

Saved-tensor hooks nest, and the innermost pair sees every save. A group's pack hook therefore
offloads what it can and hands everything else to the pair that was active when it was entered:
an output the enclosing ``discard_outputs`` block discards (that block's note stays a note), a
parameter, a ``SavedTensorRecorder``'s or ``save_on_cpu``'s hooks outside. A recomputed unit's
hooks sit outside its checkpoint, so they see what the checkpoint keeps (its inputs); the
checkpoint's rerun in backward runs inside it and meets no group.

A group is off (the forward runs as without offload) without grad, in eval mode (``training`` is
False), inside an activation checkpoint (ours or torch's: nothing there is kept), under
``torch.compile``, and outside a layer's run.

**Copies in flight.** When a layer's forward starts, the device storages of the offloading layers
before the previous one are let go, the compute stream first waiting for any copy to host not yet
done (:meth:`~.engine.LayerRun.settle`); every group's and layer's end lets go of those whose copy
is done. So at most the offloaded bytes of two layers (the one running, the one before) are held
on the device for a copy, and a copy gets a whole layer's compute to finish in.

**Prefetch.** Each layer's forward hook puts a hook on the layer's output: when backward reaches
that output (the layer's backward is about to start), it starts the reloads of this layer (if a
prefetch has not already) and of the nearest earlier layer that offloaded anything, so that
layer's copies come back while this one computes. The last layer's reloads start when the head's
and the loss's backward are done: one reason a single config leaves the last layer alone.
"""

from __future__ import annotations

import contextvars
import functools
import weakref
from typing import Any

import torch
from torch.utils import _pytree as pytree

from ..activation_checkpoint import DISCARD_SCOPE, inside_checkpoint
from .engine import Handle, LayerRun, Offloader

# The layer whose forward is running (groups offload into its run), None outside a layer.
_RUN: contextvars.ContextVar[LayerRun | None] = contextvars.ContextVar("neuron_ckpt_offload_run", default=None)

# On a layer's output tensor: a weak reference to the run the next layer's backward prefetches after its own.
_PREVIOUS = "_neuron_ckpt_offload_previous"


def outer_hooks() -> tuple[Any, Any] | None:
    """The saved-tensor hooks active here. torch has no public way to read them; this private call
    (torch 2.8+, used by AOTAutograd; recompute/discard.py reads them the same way) does."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False)


def active(module: torch.nn.Module) -> bool:
    """Whether offload runs in ``module``'s forward now (the module docstring)."""
    if not (module.training and torch.is_grad_enabled()) or inside_checkpoint() or torch.compiler.is_compiling():
        return False
    outer = outer_hooks()
    return outer is None or getattr(outer[0], "__module__", "") != "torch.utils.checkpoint"


class Group:
    """One offloaded unit (``"3.mlp"``): while it is entered, what its forward saves goes to host."""

    def __init__(self, offloader: Offloader, unit: str):
        self.offloader, self.unit = offloader, unit
        self._entered: list[torch.autograd.graph.saved_tensors_hooks | None] = []

    def enter(self, module: torch.nn.Module) -> None:
        run = _RUN.get()
        hooks = None
        if run is not None and active(module):
            outer = outer_hooks()
            hooks = torch.autograd.graph.saved_tensors_hooks(
                functools.partial(self.pack, run, outer), functools.partial(_unpack, outer)
            )
            hooks.__enter__()
        self._entered.append(hooks)

    def exit(self) -> None:
        hooks = self._entered.pop()
        if hooks is not None:
            hooks.__exit__(None, None, None)
            self.offloader.poll()

    def pack(self, run: LayerRun, outer: tuple[Any, Any] | None, t: torch.Tensor) -> Any:
        scope = DISCARD_SCOPE.get()
        if not (hasattr(scope, "holds") and scope.holds(t)):  # a discarded output stays a note
            handle = self.offloader.pack(t, run, self.unit)
            if handle is not None:
                return handle
        return outer[0](t) if outer is not None else t.detach()  # detached: no cycle through its grad_fn

    # As module hooks (a module's forward) and as a block (a function: transformers' attention).
    def pre_hook(self, module: torch.nn.Module, args: Any) -> None:
        self.enter(module)

    def post_hook(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        self.exit()

    def block(self, module: torch.nn.Module) -> _Block:
        return _Block(self, module)


class _Block:
    def __init__(self, group: Group, module: torch.nn.Module):
        self.group, self.module = group, module

    def __enter__(self) -> None:
        self.group.enter(self.module)

    def __exit__(self, *exc: Any) -> None:
        self.group.exit()


def _unpack(outer: tuple[Any, Any] | None, packed: Any) -> torch.Tensor:
    if isinstance(packed, Handle):
        return packed.tensor()
    return outer[1](packed) if outer is not None else packed


class LayerHooks:
    """Forward pre-hook and forward hook of layer ``index`` (on the module standing in its slot: a
    ``Recompute`` under full recompute, so they run outside its checkpoint): the layer's run,
    the ``layer`` group when the whole layer is offloaded, and the prefetch trigger.

    The pre-hook is prepended and the forward hook appended, so a ``layer`` group encloses the
    layer's ``discard_outputs`` block (installed earlier on the same module) and sees only what
    that block does not discard."""

    def __init__(self, offloader: Offloader, index: int, slot: torch.nn.Module, layer: torch.nn.Module, whole: bool):
        self.offloader, self.index, self.layer = offloader, index, layer
        self.group = Group(offloader, str(index)) if whole else None
        self._runs: list[tuple[LayerRun, contextvars.Token] | None] = []
        self.handles = [
            slot.register_forward_pre_hook(self.enter, prepend=True),
            slot.register_forward_hook(self.exit, always_call=True),
        ]

    def enter(self, module: torch.nn.Module, args: Any) -> None:
        if not active(module):
            self._runs.append(None)
            return
        first = args[0] if args and torch.is_tensor(args[0]) else None
        previous = first.__dict__.get(_PREVIOUS) if first is not None else None
        before = previous() if previous is not None else None
        if before is not None and before.previous is not None:  # the window: two offloading layers in flight
            older = before.previous()
            if older is not None:
                older.settle(self.offloader.stats)
        self.offloader.poll()
        excluded = {t.untyped_storage().data_ptr() for t in (*self.layer.parameters(), *self.layer.buffers())}
        run = LayerRun(self.index, previous, excluded)
        self._runs.append((run, _RUN.set(run)))
        if self.group is not None:
            self.group.enter(module)

    def exit(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        entry = self._runs.pop()
        if entry is None:
            return
        run, token = entry
        if self.group is not None:
            self.group.exit()
        _RUN.reset(token)
        self.offloader.poll()
        out = next((t for t in pytree.tree_leaves(output) if torch.is_tensor(t)), None)
        if out is None or not out.requires_grad:
            return
        out.__dict__[_PREVIOUS] = run.nearest()
        own = weakref.ref(run) if run.copies else None
        out.register_hook(functools.partial(_prefetch, self.offloader, own, run.previous))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def _prefetch(offloader: Offloader, own: weakref.ref | None, previous: weakref.ref | None, grad: torch.Tensor) -> None:
    """On the layer output's gradient: this layer's reloads (if no prefetch started them) and the
    previous offloading layer's, as a prefetch."""
    for ref, prefetch in ((own, False), (previous, True)):
        run = ref() if ref is not None else None
        if run is not None:
            run.reload(offloader.stats, prefetch)
