"""fp32 gradient accumulation: a flat gradient buffer that backward adds into, as DDP's reducer.

A :class:`GradBuffer` holds one fp32 tensor in the layout of a :class:`~.flat.FlatLayout` (the
parameters of one param group and dtype, end to end, padded to a multiple of DP) and registers a
post-accumulate-grad hook on each of its parameters. After every backward the hook adds the
parameter's ``p.grad`` into the parameter's run of the buffer and sets ``p.grad = None``, so:

- micro-batch gradients are summed in fp32 (summing 256 bf16 micro-batch gradients in bf16
  loses ~2%),
- no 16-bit gradient outlives its backward,
- ZeRO-1 reduce-scatters its buckets straight from the buffer, with no flattening copy.

**After backward ``p.grad`` is None** for these parameters; :meth:`GradBuffer.view` (what
``Zero1Optimizer.accumulated_grad`` returns) reads the accumulated gradient in the parameter's
shape. A gradient assigned to ``p.grad`` without backward is folded in when it is next read or
at ``step()`` (:meth:`GradBuffer.fold_pending`).

Ownership. The buffer keeps its hooks' handles, as DDP's reducer does. A hook holds the buffer's
tensor, not the :class:`GradBuffer`, so dropping the buffer (with the optimizer that holds it)
runs ``__del__`` (at once; at the next garbage collection if it sits in a reference cycle), which
removes the hooks: its fp32 memory is freed and the parameters' later gradients stay in
``p.grad``, even while the model lives on. No registry and no weak reference. A parameter can feed one buffer at a
time (the first hook would set ``p.grad = None`` before a second one saw it): a parameter that
already carries another buffer's hook is refused.
"""

from __future__ import annotations

import torch

from .flat import FlatLayout


class _Fold:
    """The post-accumulate-grad hook of one parameter: add ``p.grad`` into elements
    ``[offset, offset + p.numel())`` of ``data`` and drop it."""

    def __init__(self, data: torch.Tensor, offset: int) -> None:
        self.data, self.offset = data, offset

    @torch.no_grad()
    def __call__(self, p: torch.Tensor) -> None:
        if p.grad is not None:
            self.data[self.offset : self.offset + p.numel()].add_(p.grad.reshape(-1))
            p.grad = None


def refuse_claimed(params: list[torch.Tensor]) -> None:
    """ValueError if any of ``params`` already accumulates into a live :class:`GradBuffer`.

    The claim is read off the hooks torch keeps on the tensor (``Tensor._post_accumulate_grad_hooks``,
    where ``register_post_accumulate_grad_hook`` puts them), so it cannot outlive the hook: a
    removed hook or a dropped buffer releases the parameter, and a copy of the model starts free.
    """
    for p in params:
        hooks = getattr(p, "_post_accumulate_grad_hooks", None) or {}
        if any(isinstance(h, _Fold) for h in hooks.values()):
            raise ValueError(
                f"Zero1Optimizer: a parameter of shape {tuple(p.shape)} already accumulates into "
                "another Zero1Optimizer; call remove_hooks() on that one first"
            )


def gradient_holder(p: torch.Tensor) -> torch.Tensor | None:
    """The tensor ``p``'s gradient for the next step is in: a view (in ``p``'s shape) of the fp32
    buffer of the :class:`GradBuffer` that claims ``p`` (a ``p.grad`` not yet folded is folded in
    first), else ``p.grad`` (None when there is none).

    For code that must change a gradient between backward and the optimizer step whichever way
    it is held, e.g. the tied embedding's sum over pipeline stages (:mod:`neuron_ckpt.pipeline.tied`):
    with fp32 accumulation ``p.grad`` is None there, and writing a new ``p.grad`` would add to the
    buffer rather than replace it.
    """
    hooks = getattr(p, "_post_accumulate_grad_hooks", None) or {}  # where refuse_claimed reads the claim
    fold = next((h for h in hooks.values() if isinstance(h, _Fold)), None)
    if fold is None:
        return p.grad
    fold(p)
    return fold.data[fold.offset : fold.offset + p.numel()].view_as(p)


class GradBuffer:
    """The fp32 (at least; fp64 parameters keep fp64) gradient of ``layout``'s parameters,
    accumulated over backward passes until :meth:`zero_`. ``data`` is the flat buffer
    (``layout.padded`` long, the padding stays zero)."""

    def __init__(self, layout: FlatLayout, dtype: torch.dtype) -> None:
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        refuse_claimed(layout.params)
        self.layout = layout
        self.data = torch.zeros(layout.padded, dtype=dtype, device=layout.params[0].device)
        self._handles = [
            p.register_post_accumulate_grad_hook(_Fold(self.data, off)) for p, off in zip(layout.params, layout.offsets)
        ]

    def __del__(self) -> None:
        self.remove_hooks()

    def remove_hooks(self) -> None:
        """Stop accumulating during backward: later gradients stay in ``p.grad`` until
        :meth:`fold_pending` (``Zero1Optimizer.step``) or :meth:`view` adds them in."""
        for h in self._handles:
            h.remove()
        self._handles = []

    def fold(self, i: int) -> None:
        """Add parameter ``i``'s ``p.grad`` (if any) into the buffer and set it to None."""
        _Fold(self.data, self.layout.offsets[i])(self.layout.params[i])

    def fold_pending(self) -> None:
        """Fold the gradients the hooks did not see (assigned directly, or hooks removed)."""
        for i, p in enumerate(self.layout.params):
            if p.grad is not None:
                self.fold(i)

    def view(self, i: int) -> torch.Tensor:
        """Parameter ``i``'s accumulated gradient, a view of the buffer in the parameter's shape."""
        p, off = self.layout.params[i], self.layout.offsets[i]
        if p.grad is not None:  # set without backward: fold it in first
            self.fold(i)
        return self.data[off : off + p.numel()].view_as(p)

    def zero_(self) -> None:
        """Zero the buffer in place (it is reused every step) and drop any ``p.grad`` left."""
        self.data.zero_()
        for p in self.layout.params:
            p.grad = None
