"""Collectives along any tensor dimension, without autograd.

The one module that knows the difference between eager backends (gloo, nccl) and XLA:
eager calls go through torch.distributed (``all_gather_single`` / ``reduce_scatter_single`` on
torch >= 2.13, ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` on older torch such as the
Neuron SDK's 2.9); XLA calls go through ``torch_xla.core.xla_model`` with replica groups, which
lower to HLO collectives. Under ``torch.compile`` (dynamo tracing) the eager backends go through
the functional collectives of ``torch.distributed._functional_collectives`` instead, which dynamo
traces into the graph (``async_op=True`` calls are graph breaks); eager runs are unchanged. A
group of size 1 is a no-op everywhere.

One contract on every backend: a collective returns its result and never modifies its input
(XLA's collectives are functional; the eager ones write into a fresh tensor, so callers need no
``.clone()``). The result is a new tensor, except that a group of size 1 returns the input itself
(nothing to communicate) and :func:`split` returns a chunk that may share the input's storage:
an in-place write to those results reaches the input.

Autograd-aware versions (conjugate pairs) are in :mod:`neuron_ckpt.distributed.mappings`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import runtime
from .parallel_state import Group

# torch 2.13 renamed the single-tensor collectives and deprecated the old names; 2.9 has only
# the old ones.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _compiling() -> bool:
    """True while dynamo traces: collectives must then be functional, never ``async_op``."""
    return torch.compiler.is_compiling()


def _funcol():
    import torch.distributed._functional_collectives as funcol

    return funcol


def _xm():
    import torch_xla.core.xla_model as xm

    return xm


REDUCE_OPS = ("sum", "max")


def all_reduce(tensor: torch.Tensor, group: Group, op: str = "sum") -> torch.Tensor:
    """Reduce ``tensor`` over ``group`` elementwise with ``op`` (``"sum"`` or ``"max"``).

    Returns a new tensor and leaves ``tensor`` unchanged, on every backend (a group of size 1
    returns ``tensor`` itself). An all-reduce has no dimension: every rank ends with the whole
    reduced tensor.
    """
    if op not in REDUCE_OPS:
        raise ValueError(f"all_reduce: op must be one of {REDUCE_OPS}, got {op!r}")
    if group.size == 1:
        return tensor
    if runtime.is_xla():
        xm = _xm()
        reduce_type = xm.REDUCE_SUM if op == "sum" else xm.REDUCE_MAX
        return xm.all_reduce(reduce_type, tensor, groups=[list(g) for g in group.replica_groups])
    if _compiling():
        return _funcol().all_reduce(tensor.contiguous(), op, group.process_group)
    # dist.all_reduce works in place: reduce a contiguous copy, never the caller's tensor.
    out = tensor.clone(memory_format=torch.contiguous_format)
    reduce_op = dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX
    dist.all_reduce(out, op=reduce_op, group=group.process_group)
    return out


def all_gather(tensor: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along ``dim``, in rank order."""
    if group.size == 1:
        return tensor
    dim = dim % tensor.dim()
    if runtime.is_xla():
        return _xm().all_gather(
            tensor.contiguous(), dim=dim, groups=[list(g) for g in group.replica_groups], pin_layout=False
        )
    # The flat collective concatenates along dim 0: move ``dim`` first, gather, move it back.
    if _compiling():
        return _funcol().all_gather_tensor(tensor.movedim(dim, 0).contiguous(), 0, group.process_group).movedim(0, dim)
    return all_gather_start(tensor.movedim(dim, 0), group).wait().movedim(0, dim)


def reduce_scatter(tensor: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """Sum ``tensor`` over ``group`` and keep this rank's 1/size chunk along ``dim``."""
    if group.size == 1:
        return tensor
    dim = dim % tensor.dim()
    if tensor.shape[dim] % group.size:
        raise ValueError(
            f"reduce_scatter: size {tensor.shape[dim]} of dim {dim} is not divisible by the group size {group.size}"
        )
    if runtime.is_xla():
        return _xm().reduce_scatter(
            _xm().REDUCE_SUM,
            tensor.contiguous(),
            scale=1.0,
            scatter_dim=dim,
            shard_count=group.size,
            groups=[list(g) for g in group.replica_groups],
            pin_layout=False,
        )
    if _compiling():
        flat = tensor.movedim(dim, 0).contiguous()
        return _funcol().reduce_scatter_tensor(flat, "sum", 0, group.process_group).movedim(0, dim)
    return reduce_scatter_start(tensor.movedim(dim, 0), group).wait().movedim(0, dim)


class Pending:
    """A collective started with ``async_op``; :meth:`wait` returns its result.

    Lets a caller overlap communication with computation (backward of the sequence-parallel
    linear layers). On XLA, under ``torch.compile`` and for groups of one the result is ready at
    once: the compiler schedules those collectives itself.
    """

    def __init__(self, result: torch.Tensor, work=None):
        self._result, self._work = result, work

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            self._work.wait()
            self._work = None
        return self._result


def all_gather_start(tensor: torch.Tensor, group: Group) -> Pending:
    """Start :func:`all_gather` along dim 0; ``.wait()`` for the result."""
    if group.size == 1 or runtime.is_xla() or _compiling():
        return Pending(all_gather(tensor, 0, group))
    tensor = tensor.contiguous()
    out = torch.empty((group.size * tensor.shape[0],) + tensor.shape[1:], dtype=tensor.dtype, device=tensor.device)
    return Pending(out, _all_gather_single(out, tensor, group=group.process_group, async_op=True))


def reduce_scatter_start(tensor: torch.Tensor, group: Group) -> Pending:
    """Start :func:`reduce_scatter` along dim 0; ``.wait()`` for the result."""
    if group.size == 1 or runtime.is_xla() or _compiling() or tensor.shape[0] % group.size:
        return Pending(reduce_scatter(tensor, 0, group))  # (a size error is raised there)
    tensor = tensor.contiguous()
    out = torch.empty((tensor.shape[0] // group.size,) + tensor.shape[1:], dtype=tensor.dtype, device=tensor.device)
    return Pending(out, _reduce_scatter_single(out, tensor, group=group.process_group, async_op=True))


def split(tensor: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """This rank's 1/size chunk of ``tensor`` along ``dim`` (no communication)."""
    if group.size == 1:
        return tensor
    if tensor.shape[dim] % group.size:
        raise ValueError(
            f"split: size {tensor.shape[dim]} of dim {dim} is not divisible by the group size {group.size}"
        )
    return tensor.chunk(group.size, dim=dim)[group.rank].contiguous()
