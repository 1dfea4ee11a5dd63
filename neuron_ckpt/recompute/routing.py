"""Routing replay: a recomputed mixture-of-experts block sends each token to the experts its
forward sent it to.

Why: rerunning a router in backward can pick other experts than the forward did, and the
gradients then belong to a routing the loss never saw. Peers shipped exactly that: DeepSeek's
``e_score_correction_bias`` updated between forward and backward, top-k ties broken another way
on the rerun. Nothing in autograd notices; the step is silently wrong.

How: every transformers 5.24 router picks its experts with ``torch.topk`` (softmax then top-k in
Mixtral, Qwen and OLMoE, DeepSeek's grouped sigmoid-plus-bias top-k twice, GPT-OSS's top-k on
the logits). :class:`RoutingReplay` is a ``TorchFunctionMode`` active while a recomputed block
runs. Its first run (the forward) records the indices of each ``topk`` call, in order; every
later run (the rerun of each backward) answers the i-th call with the i-th recorded indices and
``input.gather(dim, indices)`` as the values. Those are the values the forward's ``topk``
returned (the same elements), with the same gradient (``topk``'s backward scatters the
gradient into zeros at the indices, and so does the replay's). Whatever the rerun's scores are,
the choice is the forward's.

The replay is an autograd Function that saves exactly what ``topk`` saves (its indices, nothing
else): torch's non-reentrant checkpoint matches the rerun's saved tensors to the forward's one
by one and would refuse a rerun that saved ``gather``'s two. Cost: the recorded indices are kept
until the block's backward (int64, ``k`` per token per ``topk`` call), outside autograd.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_TOPK = (torch.topk, torch.Tensor.topk)


class RoutingReplay(TorchFunctionMode):
    """Enter it around every run of one recomputed block (forward first, then each rerun): the
    first run records each ``topk``'s indices, later runs replay them."""

    def __init__(self) -> None:
        super().__init__()
        self.recorded: list[torch.Tensor] | None = None  # set once the first run finished
        self._recording: list[torch.Tensor] = []
        self._next = 0

    def __enter__(self) -> RoutingReplay:
        self._recording, self._next = [], 0
        return super().__enter__()

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        super().__exit__(exc_type, *exc)
        if self.recorded is None and exc_type is None:
            self.recorded = self._recording

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in _TOPK:
            return func(*args, **kwargs)
        if self.recorded is None:
            result = func(*args, **kwargs)
            # A copy: the block may write into the indices it got (the rerun must not see that).
            self._recording.append(result.indices.clone())
            return result
        return self._replay(*args, **kwargs)

    def _replay(
        self, input: torch.Tensor, k: int, dim: int = -1, largest: bool = True, sorted: bool = True, *, out: Any = None
    ) -> Any:
        assert self.recorded is not None  # replaying: the first run recorded
        if self._next >= len(self.recorded):
            raise RuntimeError(
                f"routing replay: the rerun calls topk {self._next + 1} times, the forward called it "
                f"{len(self.recorded)} times"
            )
        indices = self.recorded[self._next]
        self._next += 1
        expected = list(input.shape)
        expected[dim] = k
        if list(indices.shape) != expected:
            raise RuntimeError(
                f"routing replay: topk call {self._next} of the rerun has shape {tuple(expected)}, the "
                f"forward's had {tuple(indices.shape)}"
            )
        values = _Replayed.apply(input, dim, indices)
        result = torch.return_types.topk((values, indices.clone()))
        if out is not None:
            out[0].copy_(result.values)
            out[1].copy_(result.indices)
            return torch.return_types.topk(out)
        return result


class _Replayed(torch.autograd.Function):
    """``input.gather(dim, indices)`` with ``topk``'s backward, saving only the indices."""

    @staticmethod
    def forward(ctx, input: torch.Tensor, dim: int, indices: torch.Tensor) -> torch.Tensor:
        ctx.dim, ctx.shape = dim, input.shape
        ctx.save_for_backward(indices)
        return input.gather(dim, indices)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (indices,) = ctx.saved_tensors
        return grad.new_zeros(ctx.shape).scatter_(ctx.dim, indices, grad), None, None


__all__ = ["RoutingReplay"]
