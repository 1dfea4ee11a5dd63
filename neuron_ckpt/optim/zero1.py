"""ZeRO stage 1: shard the optimizer state and fp32 master weights over the data-parallel group.

Every data-parallel rank holds the whole model and computes full gradients, but owns only a
1/dp slice of the flattened parameters: it keeps fp32 master weights and optimizer state for that
slice alone. A step is

1. reduce-scatter the gradients over DP, bucket by bucket (each rank receives the DP-mean of its
   slice of every bucket),
2. global gradient norm: squares of the slices, each parameter weighted 1/(TP ranks holding the
   same values), summed over DP then TP, so TP-sharded parameters count once per shard and
   replicated ones once,
3. clip (same formula as ``torch.nn.utils.clip_grad_norm_``),
4. the inner optimizer (AdamW, ...) updates the fp32 slices,
5. all-gather the updated slices over DP, bucket by bucket, into the model parameters.

Layout. The parameters of one (user param group, dtype) are laid end to end in one *flat*
sequence, padded at its end to a multiple of DP. The flat is cut into *buckets* of exactly
``bucket_cap_mb`` worth of elements of the dtype the gradients are reduced in (by default the
cap :func:`~neuron_ckpt.distributed.collectives.default_bucket_cap_mb` gives the DP group's
backend: 128 MiB on XLA, 8 MiB on gloo), rounded down to a multiple of DP (the last bucket is
shorter), so every bucket divides by DP and only the last one of a flat carries padding. A
parameter that straddles a cut is split between two buckets, and one larger than the cap spans
several: the cap bounds every collective, whatever the parameter sizes (Neuron produces NaN
within a few steps for collectives above ~140 MB, and an embedding at TP 1 is 262 MB in bf16).
Each bucket has its own fp32 master slice (the rank's ``1/dp`` of it), which is one parameter of
the inner optimizer.

fp32 gradient accumulation (``accumulate_fp32``; on by default for 16-bit parameters). Each flat
owns a persistent fp32 gradient buffer in the flat layout. A post-accumulate-grad hook adds every
backward's ``p.grad`` into the parameter's view of it and sets ``p.grad = None``, so micro-batch
gradients are summed in fp32 (summing 256 bf16 micro-batch gradients in bf16 loses ~2%), no 16-bit
gradient outlives its backward, and buckets are reduce-scattered straight from the buffer in fp32
with no flattening copy. **After backward, ``p.grad`` is None** for these parameters; read the
accumulated (this rank's, not yet DP-reduced) gradient with :meth:`Zero1Optimizer.accumulated_grad`.
Without it, ``p.grad`` is kept as usual and each bucket is flattened from it at ``step()`` and
reduced in the parameter dtype.

Gradients of TP-replicated parameters that saw only a sequence-parallel slice must already be
complete (the parallel layers all-reduce them in backward, see :mod:`neuron_ckpt.parallel.params`);
this optimizer never reduces over TP.

All collectives go through :mod:`neuron_ckpt.distributed.collectives`, and the step has no host
synchronisation (the norm stays a tensor), so it traces into one graph on XLA.
"""

from __future__ import annotations

import bisect
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, NamedTuple

import torch
from torch.utils.weak import WeakIdKeyDictionary

from ..distributed import collectives
from ..distributed.parallel_state import ParallelState, get_parallel_state
from ..parallel.params import tensor_parallel_duplicates

LAYOUT_VERSION = 2
"""``state_dict()["version"]``. 1: one unbucketed flat buffer per (group, dtype), no version key."""

_MB = 2**20
_SIXTEEN_BIT = (torch.bfloat16, torch.float16)

# Parameter -> the optimizer whose accumulation hook owns its gradient. Two hooks on one
# parameter would be silently wrong (the first sets p.grad = None before the second sees it).
_HOOK_OWNERS: WeakIdKeyDictionary = WeakIdKeyDictionary()


class _Piece(NamedTuple):
    """The run of one parameter inside a range of a flat: its elements ``[first, last)`` sit at
    ``offset`` from the start of the range."""

    index: int  # into the flat's params
    first: int
    last: int
    offset: int


@dataclass
class _Bucket:
    """Elements ``[start, end)`` of a flat; ``end - start`` divides by DP.

    ``pieces`` are the runs of the parameters it holds (offsets from ``start``);
    ``norm_segments`` are ``(start, end, weight)`` ranges of this rank's slice with the
    1/duplicates weight of the parameter they cover, so the norm needs no per-element weights.
    """

    start: int
    end: int
    master: torch.Tensor
    pieces: list[_Piece]
    norm_segments: list[tuple[int, int, float]]


@dataclass
class _Flat:
    """The parameters of one (param group, dtype) end to end, cut into buckets."""

    group: int
    dtype: torch.dtype
    reduce_dtype: torch.dtype
    params: list[torch.Tensor]
    offsets: list[int]
    numel: int
    padded: int
    grad: torch.Tensor | None = None  # fp32 accumulation buffer, ``padded`` long
    buckets: list[_Bucket] = field(default_factory=list)

    def pieces(self, lo: int, hi: int) -> list[_Piece]:
        """Runs of parameters inside flat elements ``[lo, hi)``, offsets from ``lo``."""
        out = []
        i = max(bisect.bisect_right(self.offsets, lo) - 1, 0)
        while i < len(self.params) and self.offsets[i] < hi:
            off, n = self.offsets[i], self.params[i].numel()
            a, b = max(lo, off), min(hi, off + n)
            if a < b:
                out.append(_Piece(i, a - off, b - off, a - lo))
            i += 1
        return out

    def gather(self, lo: int, hi: int, tensors: list[torch.Tensor | None], dtype: torch.dtype) -> torch.Tensor:
        """Flat elements ``[lo, hi)`` of ``tensors`` (laid out like the params; None reads as
        zeros) as a new 1-D ``dtype`` tensor; padding reads as zeros."""
        device = self.params[0].device
        parts, covered = [], 0
        for piece in self.pieces(lo, hi):
            t, n = tensors[piece.index], piece.last - piece.first
            parts.append(
                torch.zeros(n, dtype=dtype, device=device) if t is None
                else t.reshape(-1)[piece.first : piece.last].to(dtype)
            )  # fmt: skip
            covered += n
        if covered < hi - lo:
            parts.append(torch.zeros(hi - lo - covered, dtype=dtype, device=device))
        return torch.cat(parts)

    def meta(self) -> dict[str, Any]:
        return {
            "group": self.group,
            "dtype": str(self.dtype),
            "reduce_dtype": str(self.reduce_dtype),
            "shapes": [tuple(p.shape) for p in self.params],
            "padding": self.padded - self.numel,
            "buckets": [(b.start, b.end) for b in self.buckets],
        }


def _bucket_numel(cap_mb: float | None, dtype: torch.dtype, dp: int, padded: int) -> int:
    """Elements per bucket: the cap in ``dtype``, rounded down to a multiple of DP."""
    if cap_mb is None:
        return padded
    itemsize = torch.empty((), dtype=dtype).element_size()
    n = int(cap_mb * _MB) // itemsize // dp * dp
    if n == 0:
        raise ValueError(
            f"bucket_cap_mb={cap_mb} holds {int(cap_mb * _MB) // itemsize} {dtype} elements, fewer than "
            f"dp={dp}: allowed is None or at least {dp * itemsize / _MB:.3g}"
        )
    return n


def _build_flat(
    group: int,
    params: list[torch.Tensor],
    ps: ParallelState,
    cap_mb: float | None,
    accumulate: bool,
    grad: torch.Tensor | None = None,
) -> _Flat:
    """The flat of ``params``, cut at ``cap_mb``; with ``accumulate``, its fp32 gradient buffer is
    ``grad`` (one of the same flat, kept when the flat is cut again) or a new one of zeros."""
    dp, r = ps.dp_size, ps.dp_rank
    offsets = [0]
    for p in params[:-1]:
        offsets.append(offsets[-1] + p.numel())
    numel = offsets[-1] + params[-1].numel()
    dtype = params[0].dtype
    # Accumulate in at least fp32 (an fp64 parameter keeps fp64).
    reduce_dtype = torch.promote_types(dtype, torch.float32) if accumulate else dtype
    flat = _Flat(group, dtype, reduce_dtype, params, offsets, numel, numel + -numel % dp)
    step = _bucket_numel(cap_mb, reduce_dtype, dp, flat.padded)
    values = [p.detach() for p in params]
    with torch.no_grad():
        for start in range(0, flat.padded, step):
            end = min(start + step, flat.padded)
            shard = (end - start) // dp
            lo = start + r * shard
            master = flat.gather(lo, lo + shard, values, torch.float32)
            norm = _norm_segments(flat, lo, lo + shard, ps.tp_size)
            flat.buckets.append(_Bucket(start, end, master, flat.pieces(start, end), norm))
        if accumulate:
            device = params[0].device
            flat.grad = grad if grad is not None else torch.zeros(flat.padded, dtype=reduce_dtype, device=device)
    return flat


def _norm_segments(flat: _Flat, lo: int, hi: int, tp_size: int) -> list[tuple[int, int, float]]:
    """Where each parameter falls inside this rank's slice ``[lo, hi)`` of the flat."""
    segments: list[tuple[int, int, float]] = []
    for piece in flat.pieces(lo, hi):
        weight = 1.0 / tensor_parallel_duplicates(flat.params[piece.index], tp_size)
        end = piece.offset + piece.last - piece.first
        if segments and segments[-1][1] == piece.offset and segments[-1][2] == weight:
            segments[-1] = (segments[-1][0], end, weight)
        else:
            segments.append((piece.offset, end, weight))
    return segments


def _param_groups(params: Iterable[torch.Tensor] | Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    groups = list(params)
    if not groups:
        raise ValueError("Zero1Optimizer got an empty parameter list")
    if not isinstance(groups[0], dict):
        groups = [{"params": groups}]
    seen: dict[int, dict[str, Any]] = {}  # id -> the options of the group that holds it
    out = []
    for g in groups:
        ps = [g["params"]] if isinstance(g["params"], torch.Tensor) else list(g["params"])
        options = {k: v for k, v in g.items() if k != "params"}
        kept = []
        for p in ps:
            if id(p) in seen:  # a shared parameter (a tied embedding / LM head) listed twice: one slot
                if seen[id(p)] != options:
                    raise ValueError(
                        f"Zero1Optimizer: a parameter of shape {tuple(p.shape)} (shared, e.g. a tied embedding) is "
                        f"in two param groups with different options ({seen[id(p)]} and {options}): list it once"
                    )
                continue
            if p.requires_grad and not p.is_contiguous():
                raise ValueError(f"Zero1Optimizer: parameters must be contiguous, got one of shape {tuple(p.shape)}")
            seen[id(p)] = options
            kept.append(p)
        out.append({**g, "params": [p for p in kept if p.requires_grad]})
    if not any(g["params"] for g in out):
        raise ValueError("Zero1Optimizer: no parameter requires grad")
    return out


def _accumulate_hook(opt_ref: weakref.ref, flat_index: int, param_index: int) -> Callable[[torch.Tensor], None]:
    # A weak reference: the hook lives on the parameter, which must not keep a dropped optimizer
    # (and its fp32 buffers) alive.
    def hook(p: torch.Tensor) -> None:
        opt = opt_ref()
        if opt is not None and p.grad is not None:
            opt._fold_grad(opt._flats[flat_index], param_index)

    return hook


class Zero1Optimizer(torch.optim.Optimizer):
    """ZeRO-1 wrapper around any ``torch.optim`` optimizer class.

    ``Zero1Optimizer(model.parameters(), torch.optim.AdamW, grad_clip_norm=1.0, lr=3e-4)``.
    ``params`` may be tensors or param-group dicts (per-group options such as
    ``weight_decay=0.0`` for norms pass through). ``**defaults`` go to ``optimizer_class``.
    A parameter listed more than once (a tied embedding / LM head, collected module by module)
    gets one slot; listed in two groups with different options it is refused.
    Parameters with ``requires_grad=False`` are left alone; a parameter whose gradient is missing
    is treated as having a zero gradient (unlike torch optimizers, which skip it: weight decay
    still applies and the moments still decay, the same on every rank).

    ``bucket_cap_mb`` (MiB; None: one bucket per param group and dtype) bounds the bytes of every
    reduce-scatter and all-gather, counted in the dtype gradients are reduced in. ``"auto"`` (the
    default) takes the DP group's backend's cap
    (:data:`~neuron_ckpt.distributed.collectives.DEFAULT_BUCKET_CAP_MB`: 128 on XLA, 8 on gloo),
    and then adopts the cap a loaded state was saved with. ``bucket_cap_mb`` reads the number used.
    ``accumulate_fp32`` (None: for bf16/fp16 parameters only) accumulates gradients in fp32
    buffers through post-accumulate-grad hooks, which leave ``p.grad`` None after backward (see
    :meth:`accumulated_grad`) and reduce in fp32. The hooks are removed when the optimizer is
    garbage-collected or by :meth:`remove_hooks`.

    ``param_groups`` is the inner optimizer's list, so an LR scheduler
    (``torch.optim.lr_scheduler.LambdaLR(zero1, ...)``) sets the learning rate that is used.
    ``step()`` returns the pre-clip global gradient norm (a tensor), also kept as
    ``last_grad_norm``. Step hooks (``register_step_pre_hook``) are not supported.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        optimizer_class: type[torch.optim.Optimizer] = torch.optim.AdamW,
        parallel_state: ParallelState | None = None,
        grad_clip_norm: float | None = None,
        bucket_cap_mb: float | None | str = "auto",
        accumulate_fp32: bool | None = None,
        **defaults: Any,
    ) -> None:
        if grad_clip_norm is not None and not grad_clip_norm > 0:
            raise ValueError(f"grad_clip_norm must be None or > 0, got {grad_clip_norm!r}")
        cap_ok = isinstance(bucket_cap_mb, (int, float)) and not isinstance(bucket_cap_mb, bool) and bucket_cap_mb > 0
        if bucket_cap_mb not in (None, "auto") and not cap_ok:
            raise ValueError(
                "bucket_cap_mb must be None (no cap), 'auto' (the backend's) or a number > 0 (MiB), "
                f"got {bucket_cap_mb!r}"
            )
        if not (accumulate_fp32 is None or isinstance(accumulate_fp32, bool)):
            raise ValueError(
                f"accumulate_fp32 must be None (auto: for bf16/fp16 parameters), True or False, got {accumulate_fp32!r}"
            )
        self.parallel_state = parallel_state or get_parallel_state()
        self.grad_clip_norm = grad_clip_norm
        self._auto_cap = bucket_cap_mb == "auto"
        if self._auto_cap:
            bucket_cap_mb = collectives.default_bucket_cap_mb(self.parallel_state.dp)
        self.bucket_cap_mb: float | None = bucket_cap_mb
        self.last_grad_norm: torch.Tensor | None = None
        self._flats: list[_Flat] = []
        inner_groups = []
        for i, group in enumerate(_param_groups(params)):
            by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
            for p in group["params"]:
                by_dtype.setdefault(p.dtype, []).append(p)
            masters = []
            for dtype, ps in by_dtype.items():
                accumulate = dtype in _SIXTEEN_BIT if accumulate_fp32 is None else accumulate_fp32
                flat = _build_flat(i, ps, self.parallel_state, bucket_cap_mb, accumulate)
                self._flats.append(flat)
                masters += [b.master for b in flat.buckets]
            inner_groups.append({**group, "params": masters})
        self._hooks = self._register_hooks()
        self.inner = optimizer_class(inner_groups, **defaults)
        # Share, not copy: schedulers and users edit the hyperparameters the inner step reads.
        self.defaults = self.inner.defaults
        self.param_groups = self.inner.param_groups
        self.state = self.inner.state

    def _register_hooks(self) -> list[Any]:
        handles = []
        me = weakref.ref(self)
        for fi, flat in enumerate(self._flats):
            if flat.grad is None:
                continue
            for pi, p in enumerate(flat.params):
                owner = _HOOK_OWNERS.get(p)
                if owner is not None and owner() is not None:
                    for h in handles:
                        h.remove()
                    raise ValueError(
                        f"Zero1Optimizer: a parameter of shape {tuple(p.shape)} already accumulates into "
                        "another Zero1Optimizer; call remove_hooks() on that one first"
                    )
                _HOOK_OWNERS[p] = me
                handles.append(p.register_post_accumulate_grad_hook(_accumulate_hook(me, fi, pi)))
        self._me = me
        weakref.finalize(self, _remove_handles, handles, self._hooked_params(), me)
        return handles

    def _hooked_params(self) -> list[torch.Tensor]:
        return [p for f in self._flats if f.grad is not None for p in f.params]

    def remove_hooks(self) -> None:
        """Stop accumulating into the fp32 buffers: later gradients stay in ``p.grad`` (and are
        still added to the buffers at the next ``step()``)."""
        _remove_handles(self._hooks, self._hooked_params(), self._me)
        self._hooks = []

    @property
    def buckets(self) -> list[_Bucket]:
        """Every bucket, in the order of ``state_dict()["master"]`` and the inner parameters."""
        return [b for f in self._flats for b in f.buckets]

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise NotImplementedError("Zero1Optimizer flattens parameters at construction; pass all groups then")

    # ---- gradients -------------------------------------------------------------------------

    @torch.no_grad()
    def _fold_grad(self, flat: _Flat, i: int) -> None:
        p = flat.params[i]
        off = flat.offsets[i]
        flat.grad[off : off + p.numel()].add_(p.grad.reshape(-1))
        p.grad = None

    def accumulated_grad(self, param: torch.Tensor) -> torch.Tensor | None:
        """The gradient ``param`` contributes to the next step on this rank (before the DP mean).

        With fp32 accumulation a view of the fp32 buffer (in ``param``'s shape), else ``param.grad``.
        """
        for flat in self._flats:
            for i, p in enumerate(flat.params):
                if p is param:
                    if flat.grad is None:
                        return p.grad
                    if p.grad is not None:  # set without backward: fold it in first
                        self._fold_grad(flat, i)
                    return flat.grad[flat.offsets[i] : flat.offsets[i] + p.numel()].view_as(p)
        raise ValueError("accumulated_grad: this parameter is not managed by this Zero1Optimizer")

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear ``p.grad`` (None or zeros, as asked) and zero the fp32 accumulation buffers
        (always zeroed in place: they are reused every step)."""
        for flat in self._flats:
            if flat.grad is not None:
                flat.grad.zero_()
            for p in flat.params:
                if p.grad is None:
                    continue
                if set_to_none or flat.grad is not None:
                    p.grad = None
                else:
                    p.grad.detach_().zero_()

    # ---- step ------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> torch.Tensor:  # type: ignore[override]
        """One optimizer step; returns the global gradient norm before clipping."""
        if closure is not None:
            with torch.enable_grad():
                closure()
        for flat in self._flats:
            if flat.grad is not None:
                # Gradients the hooks did not see (assigned directly, or hooks removed).
                for i, p in enumerate(flat.params):
                    if p.grad is not None:
                        self._fold_grad(flat, i)
        grads = self._reduce_scatter_grads()
        buckets = self.buckets
        norm = self._global_grad_norm(buckets, grads)
        if self.grad_clip_norm is not None:
            # Same formula as clip_grad_norm_, as a tensor: no host sync on XLA.
            coef = torch.clamp(self.grad_clip_norm / (norm + 1e-6), max=1.0)
            for g in grads:
                g.mul_(coef)
        for b, g in zip(buckets, grads):
            b.master.grad = g
        self.inner.step()
        for b in buckets:
            b.master.grad = None
        self._all_gather_params()
        self.last_grad_norm = norm
        return norm

    # Eager backends run a started collective in the background: keep this many buckets in
    # flight, so flattening (or copying out) one overlaps another's communication while the
    # transient copies stay bounded by a few buckets. On XLA collectives are graph nodes and the
    # compiler schedules them; the loops below then trace the same ops in the same order.
    _IN_FLIGHT = 4

    def _reduce_scatter_grads(self) -> list[torch.Tensor]:
        """Every bucket's slice of the DP-mean gradient on this rank, in fp32, as fresh tensors
        the step may scale in place (at DP 1 the reduced tensor is the accumulation buffer)."""
        dp = self.parallel_state.dp
        pending, out = [], []
        for flat in self._flats:
            for b in flat.buckets:
                if flat.grad is not None:
                    full = flat.grad[b.start : b.end]
                else:
                    full = flat.gather(b.start, b.end, [p.grad for p in flat.params], flat.dtype)
                pending.append(collectives.reduce_scatter_start(full, dp))
                if len(pending) == self._IN_FLIGHT:
                    out.append(pending.pop(0).wait())
        out += [p.wait() for p in pending]
        return [mine.to(torch.float32) / dp.size for mine in out]

    def _global_grad_norm(self, buckets: list[_Bucket], grads: list[torch.Tensor]) -> torch.Tensor:
        sq = torch.zeros((), dtype=torch.float32, device=buckets[0].master.device)
        for b, g in zip(buckets, grads):
            for start, end, weight in b.norm_segments:
                sq = sq + g[start:end].pow(2).sum() * weight
        sq = collectives.all_reduce(sq, self.parallel_state.dp)
        sq = collectives.all_reduce(sq, self.parallel_state.tp)
        return sq.sqrt()

    def _all_gather_params(self) -> None:
        """Gather every bucket's updated slices over DP into the model parameters."""
        pending = []
        for flat in self._flats:
            for b in flat.buckets:
                pending.append((flat, b, collectives.all_gather_start(b.master.to(flat.dtype), self.parallel_state.dp)))
                if len(pending) == self._IN_FLIGHT:
                    _copy_into_params(*pending.pop(0))
        for args in pending:
            _copy_into_params(*args)

    # ---- checkpoint ------------------------------------------------------------------------

    def _meta(self) -> dict[str, Any]:
        ps = self.parallel_state
        return {
            "dp_size": ps.dp_size,
            "dp_rank": ps.dp_rank,
            "tp_size": ps.tp_size,
            "tp_rank": ps.tp_rank,
            "bucket_cap_mb": self.bucket_cap_mb,
            "flats": [f.meta() for f in self._flats],
        }

    def state_dict(self) -> dict[str, Any]:
        """This rank's slices: inner optimizer state, fp32 master weights and layout metadata.

        Tensors are references, as with torch optimizers; save them before the next step.
        Every rank saves its own (``optim_dp{dp_rank}_tp{tp_rank}.pt``, say). Accumulated
        gradients are not state (as ``p.grad`` is not).
        """
        return {
            "version": LAYOUT_VERSION,
            "inner": self.inner.state_dict(),
            "master": [b.master for b in self.buckets],
            "meta": self._meta(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load slices saved by :meth:`state_dict` with the same layout.

        Raises ValueError naming every mismatched field (version, dp_size, tp_size, ranks,
        dtypes, parameter shapes, bucket boundaries with the bucket cap that made them) before
        touching any state. A version-1 state (before bucketing) loads into an optimizer with one
        bucket per param group and dtype (``bucket_cap_mb=None``), whose layout is the same.
        With ``bucket_cap_mb="auto"`` the optimizer first takes the cap the state was saved with
        (a state saved under another backend's default, or before the defaults were per backend,
        loads), if its layout then matches.
        Model parameters are not changed: load them from the model checkpoint.
        """
        if not isinstance(state_dict, dict) or not {"inner", "master", "meta"} <= state_dict.keys():
            raise ValueError("Zero1Optimizer.load_state_dict: expected keys 'version', 'inner', 'master', 'meta'")
        try:
            problems = self._mismatches(state_dict)
        except ValueError:
            if not self._adopt_saved_cap(state_dict):
                raise
            problems = []
        if problems and self._adopt_saved_cap(state_dict):
            problems = []
        if problems:
            mismatch = "; ".join(problems)
            raise ValueError(f"Zero1Optimizer.load_state_dict: checkpoint does not match: {mismatch}")
        self.inner.load_state_dict(state_dict["inner"])
        # torch's Optimizer.load_state_dict builds new param_groups: share them again, or an LR
        # scheduler attached to this optimizer would stop reaching the inner one.
        self.param_groups, self.state = self.inner.param_groups, self.inner.state
        with torch.no_grad():
            for b, m in zip(self.buckets, state_dict["master"]):
                b.master.copy_(m)

    def _mismatches(self, state_dict: dict[str, Any]) -> list[str]:
        """What differs between the layout ``state_dict`` was saved with and this one (ValueError
        for a version this optimizer does not read, or a version-1 state it cannot hold)."""
        version = state_dict.get("version", 1)
        if version == 1:
            saved = self._meta_from_v1(state_dict["meta"])
        elif version == LAYOUT_VERSION:
            saved = state_dict["meta"]
        else:
            raise ValueError(
                f"Zero1Optimizer.load_state_dict: version: checkpoint {version!r}, "
                f"this optimizer reads 1 and {LAYOUT_VERSION}"
            )
        problems = _meta_mismatches(saved, self._meta())
        if not problems and len(state_dict["master"]) != len(self.buckets):
            problems = [f"master slices: checkpoint {len(state_dict['master'])}, here {len(self.buckets)}"]
        return problems

    def _adopt_saved_cap(self, state_dict: dict[str, Any]) -> bool:
        """With an ``"auto"`` cap, cut the flats at the cap ``state_dict`` was saved with, if the
        layout then matches; True when it did. The masters, overwritten by the load, are read
        from the parameters; the accumulated gradients are kept (the buffers do not depend on
        the cuts)."""
        version = state_dict.get("version", 1)
        cap = None if version == 1 else state_dict["meta"].get("bucket_cap_mb", "absent")
        cap_ok = cap is None or (isinstance(cap, (int, float)) and not isinstance(cap, bool) and cap > 0)
        if not self._auto_cap or not cap_ok or cap == self.bucket_cap_mb or version not in (1, LAYOUT_VERSION):
            return False
        ps, before = self.parallel_state, (self._flats, self.bucket_cap_mb)
        with torch.no_grad():
            self._flats = [_build_flat(f.group, f.params, ps, cap, f.grad is not None, f.grad) for f in self._flats]
        self.bucket_cap_mb = cap
        try:
            fits = not self._mismatches(state_dict)
        except ValueError:
            fits = False
        if not fits:
            self._flats, self.bucket_cap_mb = before
            return False
        # The inner optimizer's parameters are the masters: point each group at the new ones.
        for i, group in enumerate(self.inner.param_groups):
            group["params"] = [b.master for f in self._flats if f.group == i for b in f.buckets]
        return True

    def _meta_from_v1(self, old: dict[str, Any]) -> dict[str, Any]:
        """Version 1 (one flat buffer per (group, dtype), sliced over DP) is this layout with one
        bucket per flat; refuse it where this optimizer has more."""
        split = [f"param group {f.group} {f.dtype}: {len(f.buckets)}" for f in self._flats if len(f.buckets) > 1]
        if split:
            raise ValueError(
                "Zero1Optimizer.load_state_dict: version: checkpoint 1 (saved before bucketing: one flat "
                f"buffer per param group and dtype), here {LAYOUT_VERSION} with more than one bucket for "
                f"{', '.join(split)}. Load it into Zero1Optimizer(..., bucket_cap_mb=None), which has the "
                "version-1 layout, or start the optimizer state fresh"
            )
        flats = [
            {**{k: b[k] for k in ("group", "dtype", "shapes", "padding")},
             "reduce_dtype": None, "buckets": [(0, sum(_numel(s) for s in b["shapes"]) + b["padding"])]}
            for b in old.get("buffers", [])
        ]  # fmt: skip
        ranks = {k: old.get(k) for k in ("dp_size", "dp_rank", "tp_size", "tp_rank")}
        return {**ranks, "bucket_cap_mb": None, "flats": flats}


def _copy_into_params(flat: _Flat, b: _Bucket, gathered: collectives.Pending) -> None:
    full = gathered.wait()
    for piece in b.pieces:
        p, src = flat.params[piece.index], full[piece.offset : piece.offset + piece.last - piece.first]
        if piece.last - piece.first == p.numel():
            p.copy_(src.view_as(p))
        else:  # the part of a parameter split between buckets that lies in this one
            p.view(-1)[piece.first : piece.last].copy_(src)


def _numel(shape: Iterable[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _remove_handles(handles: list[Any], params: list[torch.Tensor], owner: weakref.ref) -> None:
    for h in handles:
        h.remove()
    for p in params:
        if _HOOK_OWNERS.get(p) is owner:  # not a later optimizer's claim
            del _HOOK_OWNERS[p]


def _meta_mismatches(saved: dict[str, Any], here: dict[str, Any]) -> list[str]:
    """Human-readable ``field: checkpoint X, here Y`` for every difference."""
    out = [
        f"{k}: checkpoint {saved.get(k)}, here {here[k]}"
        for k in ("dp_size", "tp_size", "dp_rank", "tp_rank")
        if saved.get(k) != here[k]
    ]
    a, b = saved.get("flats", []), here["flats"]
    if len(a) != len(b):
        out.append(f"number of flat buffers (param group x dtype): checkpoint {len(a)}, here {len(b)}")
        return out
    for i, (x, y) in enumerate(zip(a, b)):
        name = f"flats[{i}]"
        for k in ("group", "dtype", "padding"):
            if x[k] != y[k]:
                out.append(f"{name}.{k}: checkpoint {x[k]}, here {y[k]}")
        if len(x["shapes"]) != len(y["shapes"]):
            out.append(f"{name} parameter count: checkpoint {len(x['shapes'])}, here {len(y['shapes'])}")
            continue
        shapes_differ = False
        for j, (sx, sy) in enumerate(zip(x["shapes"], y["shapes"])):
            if tuple(sx) != tuple(sy):
                shapes_differ = True
                out.append(f"{name} parameter {j} shape: checkpoint {tuple(sx)}, here {tuple(sy)}")
        bx, by = [tuple(t) for t in x["buckets"]], [tuple(t) for t in y["buckets"]]
        if bx != by and not shapes_differ:
            # Same parameters, different cuts: the cap, or the dtype it is counted in, changed.
            first = next((k for k, (u, v) in enumerate(zip(bx, by)) if u != v), min(len(bx), len(by)))
            out.append(
                f"{name}.buckets: checkpoint {len(bx)} (bucket_cap_mb={saved.get('bucket_cap_mb')}, reduced in "
                f"{x['reduce_dtype']}), here {len(by)} (bucket_cap_mb={here['bucket_cap_mb']}, reduced in "
                f"{y['reduce_dtype']}); first difference at bucket {first}: checkpoint "
                f"{bx[first] if first < len(bx) else None}, here {by[first] if first < len(by) else None}"
            )
    return out
