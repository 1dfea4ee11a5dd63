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

:func:`all_to_all` (expert parallelism's token exchange) takes uneven split sizes on the eager
backends (gloo and nccl both run ``all_to_all_single`` with ``input/output_split_sizes``; gloo's
list ``all_to_all`` refuses unequal tensors). XLA has no uneven all-to-all (torch-xla's process
group ignores the split sizes and the subgroup, and trn1's runtime lists no all-to-all at all),
so there it is refused in one line: experts on XLA use the all-gather dispatch
(:mod:`neuron_ckpt.parallel.experts`), built from the all-gather and reduce-scatter above.

Forms per backend. What a collective computes is fixed; the calls it is made of may differ where
one form is measurably faster on a backend. gloo's reduce-scatter and all-gather run at a fraction
of the bandwidth of its all-to-all and broadcast for the same bytes, and a fresh output above
glibc's 32 MiB mmap threshold is new pages to fault in on every call (docs/zero1.md has the
figures), so on gloo an eager call on host tensors is built from those (:func:`uses_gloo_forms`):

* reduce-scatter: one ``all_to_all_single`` sends every chunk to the rank that owns it, into a
  reused buffer; the owner adds its ``size`` chunks up in rank order into the result;
* all-gather: the input copied into its chunk of a reused output, then one ``broadcast`` per rank
  of its chunk; the result is that output.

Each rank sends (size-1)/size of the full tensor, as a ring reduce-scatter or all-gather does.
Sums are added in rank order: over two ranks bit for bit gloo's reduce-scatter (a + b = b + a),
over more possibly another order than gloo's (a few ulps in fp32). A reused buffer is handed out
again only once no tensor refers to it (:class:`_Buffers`), so a result is as independent as a
fresh one. XLA (lowering unchanged), ``torch.compile`` and the other eager backends (nccl, ...)
use the collective of the same name.

Autograd-aware versions (conjugate pairs) are in :mod:`neuron_ckpt.distributed.mappings`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

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

DEFAULT_BUCKET_CAP_MB = {"xla": 128.0, "gloo": 8.0}
"""The largest collective (MiB) a bucketing caller (ZeRO-1) should issue, by backend; a backend
not listed (nccl, xccl, ...; not measured) takes :data:`OTHER_BUCKET_CAP_MB`. xla: 128, a round
size below the ~140 MB above which Neuron's collectives produce NaN (neuronx-distributed's limit).
gloo: the fastest cap of ``scripts/bench_zero1.py`` (docs/zero1.md): larger buckets step slower on
the host (copies and AdamW out of cache, fewer collectives in flight), smaller ones pay latency."""

OTHER_BUCKET_CAP_MB = 128.0


def backend(group: Group) -> str | None:
    """``"xla"``, the eager backend of ``group``'s process group (``"gloo"``, ``"nccl"``...), or
    None for a group with no process group (a single process without torch.distributed)."""
    if runtime.is_xla():
        return "xla"
    pg = group.process_group
    return None if pg is None else str(dist.get_backend(pg))


def default_bucket_cap_mb(group: Group) -> float:
    """:data:`DEFAULT_BUCKET_CAP_MB` for ``group``'s backend."""
    return DEFAULT_BUCKET_CAP_MB.get(backend(group) or "", OTHER_BUCKET_CAP_MB)


def uses_gloo_forms(tensor: torch.Tensor, group: Group) -> bool:
    """True where :func:`all_gather` and :func:`reduce_scatter` of ``tensor`` over ``group`` run
    as broadcasts and an all-to-all (module docstring): eager, on host tensors, over a gloo group
    of more than one rank."""
    return group.size > 1 and tensor.device.type == "cpu" and not _compiling() and backend(group) == dist.Backend.GLOO


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


def all_to_all(
    tensor: torch.Tensor,
    group: Group,
    output_splits: list[int] | None = None,
    input_splits: list[int] | None = None,
) -> torch.Tensor:
    """Send rows ``[sum(input_splits[:j]), ...)`` of ``tensor`` (dim 0) to rank ``j`` of ``group``
    and return what every rank sent here, in rank order (``output_splits[j]`` rows from rank ``j``).

    Splits None: equal chunks of ``tensor.shape[0] / size`` rows each way. Eager backends only (module
    docstring); a group of size 1 returns ``tensor``.
    """
    if group.size == 1:
        return tensor
    if (output_splits is None) != (input_splits is None):
        raise ValueError("all_to_all: give both output_splits and input_splits, or neither (equal splits)")
    if input_splits is None and tensor.shape[0] % group.size:
        raise ValueError(
            f"all_to_all: {tensor.shape[0]} rows do not split equally over the group size {group.size}; pass splits"
        )
    if runtime.is_xla():
        raise ValueError(
            "all_to_all: XLA has no uneven all-to-all (torch-xla ignores split sizes; trn1 has no all-to-all): "
            "use the all-gather expert dispatch (ExpertDispatch(form='all_gather'))"
        )
    rows = sum(output_splits) if output_splits is not None else tensor.shape[0]
    if _compiling():
        return _funcol().all_to_all_single(tensor.contiguous(), output_splits, input_splits, group.process_group)
    out = tensor.new_empty((rows,) + tuple(tensor.shape[1:]))
    dist.all_to_all_single(out, tensor.contiguous(), output_splits, input_splits, group=group.process_group)
    return out


class Pending:
    """A collective started with ``async_op``; :meth:`wait` returns its result.

    Lets a caller overlap communication with computation (backward of the sequence-parallel
    linear layers). On XLA, under ``torch.compile`` and for groups of one the result is ready at
    once: the compiler schedules those collectives itself. ``result`` is the tensor, or a function
    that makes it once ``works`` (one async work, a list of them, or None) are done.
    """

    def __init__(self, result: torch.Tensor | Callable[[], torch.Tensor], works=None):
        self._result = result
        self._works = list(works) if isinstance(works, (list, tuple)) else [works] if works is not None else []

    def wait(self) -> torch.Tensor:
        for w in self._works:
            w.wait()
        self._works = []
        if callable(self._result):
            self._result = self._result()
        return self._result


def all_gather_start(tensor: torch.Tensor, group: Group) -> Pending:
    """Start :func:`all_gather` along dim 0; ``.wait()`` for the result."""
    if group.size == 1 or runtime.is_xla() or _compiling():
        return Pending(all_gather(tensor, 0, group))
    shape = (group.size * tensor.shape[0],) + tensor.shape[1:]
    if uses_gloo_forms(tensor, group):
        out = _BUFFERS.take(shape, tensor.dtype, tensor.device)
        chunks = out.chunk(group.size)
        chunks[group.rank].copy_(tensor)
        pg = group.process_group
        return Pending(out, [dist.broadcast(c, group.ranks[r], group=pg, async_op=True) for r, c in enumerate(chunks)])
    tensor = tensor.contiguous()
    out = torch.empty(shape, dtype=tensor.dtype, device=tensor.device)
    return Pending(out, _all_gather_single(out, tensor, group=group.process_group, async_op=True))


def reduce_scatter_start(tensor: torch.Tensor, group: Group) -> Pending:
    """Start :func:`reduce_scatter` along dim 0; ``.wait()`` for the result."""
    if group.size == 1 or runtime.is_xla() or _compiling() or tensor.shape[0] % group.size:
        return Pending(reduce_scatter(tensor, 0, group))  # (a size error is raised there)
    if uses_gloo_forms(tensor, group):
        # Every rank's chunks to their owners in one call, then the owner adds them up.
        received = _BUFFERS.take(tensor.shape, tensor.dtype, tensor.device)
        work = dist.all_to_all_single(received, tensor.contiguous(), group=group.process_group, async_op=True)
        return Pending(lambda: _sum_chunks(received, group.size), work)
    tensor = tensor.contiguous()
    out = torch.empty((tensor.shape[0] // group.size,) + tensor.shape[1:], dtype=tensor.dtype, device=tensor.device)
    return Pending(out, _reduce_scatter_single(out, tensor, group=group.process_group, async_op=True))


def _sum_chunks(t: torch.Tensor, n: int) -> torch.Tensor:
    """The sum of ``t``'s ``n`` chunks along dim 0, added in rank order, as a new tensor."""
    chunks = t.chunk(n)
    out = chunks[0] + chunks[1]
    for c in chunks[2:]:
        out += c
    return out


class _Buffers:
    """Buffers the gloo forms reuse instead of allocating, by (shape, dtype, device).

    :meth:`take` hands out a buffer only while no tensor but this pool refers to its storage (a
    returned all-gather result or any view of it that is still alive keeps it taken), so a caller
    sees a tensor as independent as a fresh one. At most ``per_key`` buffers are kept per key and
    ``keys`` keys (least recently used first out); past that, buffers are fresh ones. The pool
    holds about the transient peak of the collectives in flight (ZeRO-1: a few buckets), for the
    life of the process.
    """

    def __init__(self, per_key: int = 6, keys: int = 32):
        self.per_key, self.keys = per_key, keys
        self._kept: OrderedDict[tuple, list[torch.Tensor]] = OrderedDict()

    @staticmethod
    def _refs(t: torch.Tensor) -> int:
        # Tensors (views included) holding the storage: torch's own private count, the one
        # inductor's CUDA-graph trees read. More Python references to one tensor are not more.
        return torch._C._storage_Use_Count(t.untyped_storage()._cdata)

    def take(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        key = (tuple(shape), dtype, device)
        kept = self._kept.pop(key, [])
        self._kept[key] = kept  # most recently used last
        while len(self._kept) > self.keys:
            self._kept.popitem(last=False)
        idle = self._refs(torch.empty(0))  # the count of a storage only its own tensor holds
        for t in kept:
            if self._refs(t) == idle:
                return t.view(shape)
        t = torch.empty(shape, dtype=dtype, device=device)
        if len(kept) < self.per_key:
            kept.append(t)
        # A view: a new tensor on the same storage, which counts as a user of it while it (or
        # anything made from it) lives; the pool's own tensor does not leave the pool.
        return t.view(shape)


_BUFFERS = _Buffers()


def split(tensor: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """This rank's 1/size chunk of ``tensor`` along ``dim`` (no communication)."""
    if group.size == 1:
        return tensor
    if tensor.shape[dim] % group.size:
        raise ValueError(
            f"split: size {tensor.shape[dim]} of dim {dim} is not divisible by the group size {group.size}"
        )
    return tensor.chunk(group.size, dim=dim)[group.rank].contiguous()
