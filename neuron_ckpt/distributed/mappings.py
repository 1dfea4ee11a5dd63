"""Autograd mappings between parallel regions, as conjugate pairs.

Each mapping's backward is the conjugate of its forward, so the pairs read off the names:

=====================================  ===================  =====================
public function                        forward              backward
=====================================  ===================  =====================
copy_to_tensor_parallel_region         identity             all-reduce
reduce_from_tensor_parallel_region     all-reduce           identity
scatter_to_tensor_parallel_region      split (last dim)     all-gather (last dim)
gather_from_tensor_parallel_region     all-gather (last)    split (last dim)
scatter_to_sequence_parallel_region    split (dim 0)        all-gather (dim 0)
gather_from_sequence_parallel_region   all-gather (dim 0)   reduce-scatter (dim 0)
reduce_scatter_to_sequence_parallel_   reduce-scatter (0)   all-gather (dim 0)
region
gather_from_context_parallel_region    all-gather (dim 0)   reduce-scatter (dim 0)
all_to_all_in_expert_parallel_region   all-to-all (dim 0)   all-to-all, splits
                                                            swapped
=====================================  ===================  =====================

Sequence-parallel activations are ``[s, b, h]``: the sequence is dim 0 (the sequence functions
take ``dim=1`` for transformers' ``[b, s, h]``). All functions take the
group explicitly (a :class:`~neuron_ckpt.distributed.parallel_state.Group`); ``None`` means the
tensor-parallel group of the current parallel state (the context-parallel group for the context
function).

The context-parallel pair is the sequence-parallel one over the CP group: each CP rank holds its
share of the sequence's keys and values, attention needs all of them, and each rank's gradient of
the gathered tensor is partial (its own queries' share), so backward sums over CP and keeps this
rank's rows (:mod:`neuron_ckpt.parallel.context_parallel`).

The backwards that communicate are once-differentiable: their collectives keep no autograd
history, so a double backward through them would silently drop terms; it raises instead.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from . import collectives as C
from .parallel_state import Group, get_parallel_state


def _tp(group: Group | None) -> Group:
    return group if group is not None else get_parallel_state().tp


def _cp(group: Group | None) -> Group:
    if group is not None:
        return group
    cp = get_parallel_state().cp
    if cp is None:
        raise ValueError("gather_from_context_parallel_region: context parallelism is off (context_parallel_size 1)")
    return cp


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        return C.all_reduce(g, ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return C.all_reduce(x, group) if group.size > 1 else x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _Split(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return C.split(x, dim, group)

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        return C.all_gather(g, ctx.dim, ctx.group).contiguous(), None, None


class _GatherSplitBack(torch.autograd.Function):
    """All-gather forward; backward keeps this rank's chunk (the consumer is replicated)."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return C.all_gather(x, dim, group).contiguous()

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        return C.split(g, ctx.dim, ctx.group), None, None


class _GatherReduceScatterBack(torch.autograd.Function):
    """All-gather forward; backward reduce-scatters (the consumer is tensor parallel)."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return C.all_gather(x, dim, group).contiguous()

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        return C.reduce_scatter(g, ctx.dim, ctx.group), None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return C.reduce_scatter(x, dim, group)

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        return C.all_gather(g, ctx.dim, ctx.group).contiguous(), None, None


class _AllToAll(torch.autograd.Function):
    """Rows sent by ``input_splits``, received by ``output_splits``; backward sends the gradient
    back the way the rows came (the splits swapped)."""

    @staticmethod
    def forward(ctx, x, group, output_splits, input_splits):
        ctx.group, ctx.output_splits, ctx.input_splits = group, output_splits, input_splits
        return C.all_to_all(x, group, output_splits, input_splits)

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        return C.all_to_all(g.contiguous(), ctx.group, ctx.input_splits, ctx.output_splits), None, None, None


def copy_to_tensor_parallel_region(x: torch.Tensor, group: Group | None = None) -> torch.Tensor:
    """Enter a TP region with a replicated input: identity forward, all-reduce of the gradient."""
    return _CopyToRegion.apply(x, _tp(group))


def reduce_from_tensor_parallel_region(x: torch.Tensor, group: Group | None = None) -> torch.Tensor:
    """Leave a TP region by summing partial results: all-reduce forward, identity backward."""
    return _ReduceFromRegion.apply(x, _tp(group))


def scatter_to_tensor_parallel_region(x: torch.Tensor, group: Group | None = None) -> torch.Tensor:
    """Keep this rank's slice of the last dim; the gradient is all-gathered back."""
    return _Split.apply(x, -1, _tp(group))


def gather_from_tensor_parallel_region(x: torch.Tensor, group: Group | None = None) -> torch.Tensor:
    """All-gather the last dim; the gradient is split back to this rank's slice."""
    return _GatherSplitBack.apply(x, -1, _tp(group))


def scatter_to_sequence_parallel_region(x: torch.Tensor, group: Group | None = None, dim: int = 0) -> torch.Tensor:
    """``[s, b, h] -> [s/t, b, h]`` (this rank's chunk); the gradient is all-gathered. ``dim``: the
    sequence dimension (1 for transformers' ``[b, s, h]``)."""
    return _Split.apply(x, dim, _tp(group))


def gather_from_sequence_parallel_region(
    x: torch.Tensor, group: Group | None = None, tensor_parallel_output_grad: bool = True, dim: int = 0
) -> torch.Tensor:
    """``[s/t, b, h] -> [s, b, h]`` (along ``dim``, the sequence dimension).

    When the gathered tensor feeds tensor-parallel compute (the usual case) every rank's
    gradient is partial, so backward reduce-scatters it; when it feeds replicated compute
    (``tensor_parallel_output_grad=False``) backward only keeps this rank's chunk.
    """
    fn = _GatherReduceScatterBack if tensor_parallel_output_grad else _GatherSplitBack
    return fn.apply(x, dim, _tp(group))


def reduce_scatter_to_sequence_parallel_region(
    x: torch.Tensor, group: Group | None = None, dim: int = 0
) -> torch.Tensor:
    """``[s, b, h]`` partial sums ``-> [s/t, b, h]`` summed (along ``dim``); the gradient is all-gathered."""
    return _ReduceScatter.apply(x, dim, _tp(group))


def gather_from_context_parallel_region(
    x: torch.Tensor, group: Group | None = None, dim: int = 0, partial_grad: bool = True
) -> torch.Tensor:
    """This CP rank's rows ``-> every CP rank's rows`` along ``dim``, in CP rank order.

    ``partial_grad`` (the usual case, K and V for attention): each rank's gradient of the gathered
    tensor is a partial sum, so backward reduce-scatters it; ``False``: every rank holds the whole
    gradient (a replicated consumer, e.g. gathered logits) and backward keeps this rank's rows.
    """
    fn = _GatherReduceScatterBack if partial_grad else _GatherSplitBack
    return fn.apply(x, dim, _cp(group))


def all_to_all_in_expert_parallel_region(
    x: torch.Tensor, group: Group, output_splits: list[int] | None = None, input_splits: list[int] | None = None
) -> torch.Tensor:
    """Exchange rows of ``x`` over the expert-parallel ``group`` (``input_splits[j]`` rows to rank
    ``j``, ``output_splits[j]`` rows from it; None: equal chunks); the gradient goes back the same
    way. The tokens' trip to their experts and back (:mod:`neuron_ckpt.parallel.experts`)."""
    return _AllToAll.apply(x, group, output_splits, input_splits)
