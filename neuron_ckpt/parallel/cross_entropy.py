"""Cross entropy over logits whose vocabulary dim is split across the TP group.

Each rank holds ``[..., v/t]`` logits. The loss needs three reductions over the group — the max
(for a stable softmax), the sum of exponentials and the target's logit — all on ``[...]``-sized
tensors, so the ``[..., v]`` logits are never gathered. Two all-reduces, neither along a tensor
dimension (Neuron, like NxD, wants no collective on the last dim): a MAX of the local maxima,
then one SUM of the target logit and the sum of exponentials stacked along a new leading dim.
Computed in fp32 whatever the logits' dtype. Semantics equal
``torch.nn.functional.cross_entropy`` (``ignore_index``; ``mean`` over the tokens not ignored).

What it keeps for backward. The gradient is ``(softmax - onehot(target)) * grad_loss``. For fp32
or fp16 logits the fp32 softmax ``[..., v/t]`` is kept, as Megatron and ``F.cross_entropy`` (an
fp32 log-softmax) keep it. For **bf16** logits it keeps the softmax rounded to bf16 (half the
bytes: often the largest single activation of a Llama step, 4·s·b·v/t bytes in fp32) plus the
fp32 probability of each target (``[...]``). The target entries, where ``p - 1`` would lose
everything to cancellation if ``p`` were rounded, are therefore computed from fp32 exactly as
before; every other entry is ``bf16(p) * grad_loss``, and the gradient reaching the bf16 logits
is rounded to bf16 anyway. So it is bit-identical to the fp32-softmax gradient whenever
``grad_loss`` is a power of two (``sum``, or ``mean`` over 2^k tokens) and otherwise within one
bf16 rounding of it (double rounding; ``tests/test_layers.py`` checks both). The forward works
in place on its fp32 copy of the logits (no second ``[..., v/t]`` fp32 temporary).
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from ..distributed import collectives as C
from ..distributed.parallel_state import Group, get_parallel_state

REDUCTIONS = ("mean", "sum", "none")


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, ignore_index: int, group: Group):
        lean = logits.dtype == torch.bfloat16
        x = logits.float()  # a copy unless the logits are fp32: then work out of place once
        v_local = x.shape[-1]
        start = group.rank * v_local
        # Global max by a MAX all-reduce of the local maxima: a collective with no dimension (an
        # all-gather of them would run along the last dim, which Neuron handles badly). The max
        # only stabilises exp(); it cancels in the loss and its gradient, so it needs no autograd
        # (forward runs under no_grad).
        gmax = C.all_reduce(x.amax(dim=-1), group, op="max").unsqueeze(-1)
        shifted = x.sub_(gmax) if x is not logits else x - gmax
        ignored = target == ignore_index
        local_t = target - start
        mine = (local_t >= 0) & (local_t < v_local) & ~ignored
        idx = torch.where(mine, local_t, torch.zeros_like(local_t)).unsqueeze(-1)
        target_logit = torch.gather(shifted, -1, idx).squeeze(-1) * mine
        exp = shifted.exp_()
        sum_exp = exp.sum(dim=-1)
        both = C.all_reduce(torch.stack([target_logit, sum_exp]), group)
        loss = (both[1].log() - both[0]).masked_fill(ignored, 0.0)
        softmax = exp.div_(both[1].unsqueeze(-1))
        if lean:
            # The target's probability in fp32 (0 where the target is not on this rank), then the
            # softmax in bf16: half the bytes, the same gradient to within its bf16 rounding.
            p_target = torch.gather(softmax, -1, idx).squeeze(-1) * mine
            softmax = softmax.to(torch.bfloat16)
        else:
            p_target = torch.empty(0)
        ctx.save_for_backward(softmax, p_target, idx, mine, ignored)
        return loss

    @staticmethod
    @once_differentiable  # the softmax is saved without its history: a second derivative would be wrong
    def backward(ctx, grad_loss):
        softmax, p_target, idx, mine, ignored = ctx.saved_tensors
        grad = softmax.to(torch.float32, copy=True)
        if p_target.numel():
            at_target = torch.where(mine, p_target - 1.0, torch.gather(grad, -1, idx).squeeze(-1))
            grad.scatter_(-1, idx, at_target.unsqueeze(-1))
        else:
            grad.scatter_add_(-1, idx, -mine.unsqueeze(-1).to(grad.dtype))
        grad.masked_fill_(ignored.unsqueeze(-1), 0.0)
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int = -100,
    reduction: str = "mean",
    group: Group | None = None,
) -> torch.Tensor:
    """Cross entropy of ``[..., v/t]`` vocab-parallel logits against ``[...]`` global token ids."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if logits.shape[:-1] != target.shape:
        raise ValueError(
            f"target shape {tuple(target.shape)} must equal logits shape without the vocab dim "
            f"{tuple(logits.shape[:-1])}"
        )
    group = group if group is not None else get_parallel_state().tp
    loss = _VocabParallelCrossEntropy.apply(logits, target, ignore_index, group)
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / (target != ignore_index).sum()
