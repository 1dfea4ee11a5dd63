"""Backward reads the gathered keys and values again by a second all-gather, not by keeping them.

Attention over the whole context needs every CP rank's K and V, ``c`` times this rank's own. The
ops of attention keep what they read for backward, so left alone autograd would keep the gathered
``[s]`` K and V of every layer until backward (``c`` times the local ones). Inside
:class:`regathered` the ops that save a view of the gathered tensor keep a note instead; the
note keeps this rank's own rows (once for all notes of one call), and the first note unpacked in
backward all-gathers them again, which every other note of the call then shares until the last
is unpacked. TransformerEngine's all-gather CP does the same (it saves the local K and V and
gathers them again in backward). Cost: one more all-gather of K and V per layer in backward;
saved: ``(c - 1)`` times the local K and V per layer, kept from forward to backward.

Where it turns itself off and the gathered tensors are kept as usual: without grad; inside an
activation checkpoint's forward or rerun (the checkpoint keeps nothing of the attention, and its
rerun gathers again anyway: that rerun *is* the second all-gather); under ``torch.compile``
(the compiler's partitioner decides what to keep); inside torch's own non-reentrant checkpoint.

Every other tensor saved in the block goes to the hooks active outside it (an output-discarding
block, a ``SavedTensorRecorder``...), and so do the local rows a note keeps, so a memory
measurement sees exactly what is kept. On XLA the local rows pass an optimization barrier before
the second all-gather, so the compiler cannot fold it into the forward's (which would keep the
gathered tensors alive after all); views are replayed on the regathered tensor from their view
chain, since torch-xla reports a view's strides as contiguous (as in :mod:`neuron_ckpt.recompute.discard`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def _root(t: torch.Tensor) -> torch.Tensor:
    return t if t._base is None else t._base


class _Note:
    """What an op keeps instead of a view of the gathered tensor: how to view the regathered one."""

    __slots__ = ("call", "geometry", "view")

    def __init__(self, call: regathered, t: torch.Tensor, root: torch.Tensor):
        self.call = call
        self.view: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.geometry: tuple | None = None
        if t is root:
            return
        if t.device.type == "xla":
            self.view = t._view_func  # type: ignore[attr-defined]  # private: torch's only replay of a view chain
        else:
            self.geometry = (t.size(), t.stride(), t.storage_offset())

    def tensor(self) -> torch.Tensor:
        root = self.call.root_for_backward()
        if self.view is not None:
            return self.view(root)
        return root if self.geometry is None else root.as_strided(*self.geometry)


class regathered:
    """``with regathered(gathered, local, rebuild):`` ops in the block that keep ``gathered`` (or a
    view of it) keep a note; backward rebuilds it as ``rebuild(local)`` (module docstring).

    ``gathered``: the tensor attention reads, made from ``local`` by an all-gather (and any
    reordering); ``rebuild``: the same computation without autograd, run in backward.
    """

    def __init__(self, gathered: torch.Tensor, local: torch.Tensor, rebuild: Callable[[torch.Tensor], torch.Tensor]):
        self.root = _root(gathered)
        self.version = self.root._version
        self.local: torch.Tensor | None = local.detach()
        self.rebuild = rebuild
        self.hooks: Any = None
        self.outer: tuple[Callable, Callable] | None = None
        self.kept: Any = None  # the local rows as the outer hooks packed them, at the first note
        self.pending = 0  # notes not yet unpacked
        self.cached: torch.Tensor | None = None

    @staticmethod
    def applies() -> bool:
        """Whether the gathered tensors would be kept by this block's ops (module docstring)."""
        from ...recompute.activation_checkpoint import inside_checkpoint  # recompute imports parallel

        return torch.is_grad_enabled() and not torch.compiler.is_compiling() and not inside_checkpoint()

    def __enter__(self) -> regathered:
        if not self.applies():
            return self
        # The hooks active outside the block, to pass everything else on to (the private call
        # :mod:`neuron_ckpt.recompute.discard` uses too: torch has no public one).
        outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        if outer is not None and getattr(outer[0], "__module__", "") == "torch.utils.checkpoint":
            return self  # torch's own non-reentrant checkpoint keeps nothing of the block
        self.outer = outer
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.hooks is not None:
            self.hooks.__exit__(*exc)
            self.hooks = None

    def _pack(self, t: torch.Tensor) -> Any:
        root = _root(t)
        if root is self.root and root._version == self.version:
            if self.local is not None:  # the first note: keep the local rows (through the outer hooks)
                self.kept = self.outer[0](self.local) if self.outer is not None else self.local
                self.local = None
            self.pending += 1
            return _Note(self, t, root)
        return self.outer[0](t) if self.outer is not None else t

    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, _Note):
            return packed.tensor()
        return self.outer[1](packed) if self.outer is not None else packed

    def root_for_backward(self) -> torch.Tensor:
        """The regathered tensor: gathered by the first note unpacked, shared until the last."""
        root = self.cached
        if root is None:
            local = self.outer[1](self.kept) if self.outer is not None else self.kept
            if local.device.type == "xla":
                import torch_xla.core.xla_model as xm

                xm.optimization_barrier_([local])
            with torch.no_grad():
                root = _root(self.rebuild(local))
        self.pending -= 1
        self.cached = root if self.pending > 0 else None
        return root


__all__ = ["regathered"]
