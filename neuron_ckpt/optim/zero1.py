"""ZeRO stage 1: shard the optimizer state and fp32 master weights over the data-parallel group.

Every data-parallel rank holds the whole model and computes full gradients, but owns only a
1/dp slice of the flattened parameters: it keeps fp32 master weights and optimizer state for that
slice alone. Under context parallelism the weights are replicated over CP as well, so "DP" here is
the DP x CP group (``ParallelState.dp_cp``, the DP group itself at CP 1): gradients are averaged
and the state sharded over its ``dp * cp`` ranks (each CP rank's loss is scaled so that this mean
is the gradient of the whole sequence's token mean: ``LlamaForCausalLM``). A step
(:meth:`Zero1Optimizer.step`, in this order) is

1. reduce-scatter the gradients over DP, bucket by bucket (each rank receives the DP-mean of its
   slice of every bucket),
2. global gradient norm: squares of the slices, each parameter weighted 1/(TP ranks holding the
   same values), summed over DP then TP, so TP-sharded parameters count once per shard and
   replicated ones once; under pipeline parallelism also summed over the stages (PP group), a
   tied embedding held by the first and last stage weighted 1/2 on each (counted once), so the
   norm, the clipping and the finite check see the whole model on every rank,
3. clip (same formula as ``torch.nn.utils.clip_grad_norm_``),
4. the inner optimizer (AdamW, ...) updates the fp32 slices,
5. all-gather the updated slices over DP, bucket by bucket, into the model parameters.

The parameters of one (param group, dtype) are laid end to end in one *flat* (:mod:`.flat`), cut
into buckets of at most ``bucket_cap_mb`` (:mod:`.buckets`), each with its fp32 master slice.
With fp32 gradient accumulation (on by default for 16-bit parameters) a :class:`~.grad_buffer.GradBuffer`
per flat sums every backward's gradients in fp32 and **leaves ``p.grad`` None**; buckets are then
reduce-scattered from it in fp32. Without it ``p.grad`` is kept as usual and each bucket is
flattened from it at ``step()`` and reduced in the parameter dtype.

Under expert parallelism the experts (parameters tagged ``expert_parallel``: each EP rank holds
different ones) are flats of their own, sharded over the expert data-parallel group (``edp``, the
ranks holding the same experts) instead of DP: their gradients are reduce-scattered and their
updates all-gathered there, and scaled like the dense ones, by 1/(DP x CP) (an expert's gradient already
sums the tokens of every micro-batch of its EP group, sent to it by the all-to-all; summed over
EDP it covers all DP micro-batches once). In the norm they are summed over EDP, then over EP (each
rank's own experts) and expert TP, and added to the dense sum, so every rank clips by the same
coefficient.

Gradients of TP-replicated parameters that saw only a sequence-parallel slice must already be
complete (the parallel layers all-reduce them in backward, see :mod:`neuron_ckpt.parallel.params`);
this optimizer never reduces over TP. Under pipeline parallelism each stage's ranks build their
own optimizer over their stage's parameters; gradients shared across stages (a tied embedding)
must already be summed over the stages that hold them (``LlamaPipeline.finish_gradients``, which
``LlamaPipeline.step`` runs: it writes into the fp32 buffer when there is one), which is then
always before this step's DP reduce-scatter (Megatron#844 reduce-scattered first). All collectives go through
:mod:`neuron_ckpt.distributed.collectives`, and the step has no host synchronisation (the norm
stays a tensor), so it traces into one graph on XLA.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, cast

import torch

from ..distributed import collectives
from ..distributed.parallel_state import ParallelState, get_parallel_state
from .buckets import Bucket, copy_into_params, cut_buckets, shard_group
from .flat import FlatLayout, flat_layouts, param_groups
from .grad_buffer import GradBuffer, refuse_claimed
from .layout_check import LAYOUT_VERSION, layout_mismatches, refuse_other_version

_SIXTEEN_BIT = (torch.bfloat16, torch.float16)


@dataclass
class _Flat:
    """One (param group, dtype): its layout, the dtype its gradients are reduced in, its buckets
    and its gradient buffer (None without fp32 accumulation)."""

    layout: FlatLayout
    reduce_dtype: torch.dtype
    buckets: list[Bucket]
    grad: GradBuffer | None = None

    def meta(self) -> dict[str, Any]:
        """Its entry of ``state_dict()["meta"]["flats"]`` (saved states are compared to it key by key)."""
        flat = self.layout
        return {
            "group": flat.group,
            "expert": flat.expert,
            "dtype": str(flat.dtype),
            "reduce_dtype": str(self.reduce_dtype),
            "shapes": [tuple(p.shape) for p in flat.params],
            "padding": flat.padded - flat.numel,
            "buckets": [(b.start, b.end) for b in self.buckets],
        }


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

    ``accumulate_fp32`` (None: for bf16/fp16 parameters only) sums gradients in fp32 buffers
    through post-accumulate-grad hooks and reduces them in fp32. **Then ``p.grad`` is None after
    backward**: read this rank's accumulated gradient (before the DP mean) with
    :meth:`accumulated_grad`. A parameter accumulates into one optimizer at a time (a second is
    refused). The hooks are removed when the optimizer is dropped, or by :meth:`remove_hooks`.

    ``isinstance(opt, torch.optim.Optimizer)`` holds, but ``torch.optim.Optimizer.__init__`` is
    not run (it would build param groups of its own): ``param_groups``, ``state`` and ``defaults``
    are the inner optimizer's (``opt.inner``), read through, so an LR scheduler
    (``torch.optim.lr_scheduler.LambdaLR(zero1, ...)``) sets the learning rate the inner step
    reads, also after :meth:`load_state_dict`. Step hooks (``register_step_pre_hook``) are not
    supported. ``step()`` returns the pre-clip global gradient norm (a tensor), also kept as
    ``last_grad_norm``.
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
        if bucket_cap_mb not in (None, "auto") and not _is_cap(bucket_cap_mb):
            raise ValueError(
                "bucket_cap_mb must be None (no cap), 'auto' (the backend's) or a number > 0 (MiB), "
                f"got {bucket_cap_mb!r}"
            )
        if not (accumulate_fp32 is None or isinstance(accumulate_fp32, bool)):
            raise ValueError(
                f"accumulate_fp32 must be None (auto: for bf16/fp16 parameters), True or False, got {accumulate_fp32!r}"
            )
        self.parallel_state = ps = parallel_state or get_parallel_state()
        self.grad_clip_norm = grad_clip_norm
        self._auto_cap = bucket_cap_mb == "auto"
        if self._auto_cap:
            bucket_cap_mb = collectives.default_bucket_cap_mb(ps.dp_cp)
        self.bucket_cap_mb = cast("float | None", bucket_cap_mb)  # "auto" was replaced above
        self.last_grad_norm: torch.Tensor | None = None

        groups = param_groups(params)
        self._flats: list[_Flat] = []
        accumulated = []
        for layout in flat_layouts(groups, ps.dp_cp.size, ps.edp.size if ps.ep is not None else None):
            accumulate = layout.dtype in _SIXTEEN_BIT if accumulate_fp32 is None else accumulate_fp32
            # Accumulate and reduce in at least fp32 (an fp64 parameter keeps fp64).
            reduce_dtype = torch.promote_types(layout.dtype, torch.float32) if accumulate else layout.dtype
            self._flats.append(_Flat(layout, reduce_dtype, cut_buckets(layout, ps, self.bucket_cap_mb, reduce_dtype)))
            if accumulate:
                accumulated.append(self._flats[-1])
        # The gradient buffers (their hooks) last, every parameter checked first: a refused
        # construction leaves no hook behind.
        refuse_claimed([p for f in accumulated for p in f.layout.params])
        for f in accumulated:
            f.grad = GradBuffer(f.layout, f.reduce_dtype)
        self.inner = optimizer_class([{**g, "params": self._masters(i)} for i, g in enumerate(groups)], **defaults)

    # torch.optim.Optimizer.__init__ is not called: it would build param groups of its own, which
    # an LR scheduler would then set in vain. These three are the inner optimizer's, read through,
    # so they stay its own after its load_state_dict replaces them.
    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]  # a property over an attribute
        return self.inner.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]  # a property over an attribute
        return self.inner.state

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]  # a property over an attribute
        return self.inner.defaults

    @property
    def buckets(self) -> list[Bucket]:
        """Every bucket, in the order of ``state_dict()["master"]`` and the inner parameters."""
        return [b for f in self._flats for b in f.buckets]

    def _masters(self, group: int) -> list[torch.Tensor]:
        """The inner optimizer's parameters of param group ``group``: its buckets' masters."""
        return [b.master for f in self._flats if f.layout.group == group for b in f.buckets]

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise NotImplementedError("Zero1Optimizer flattens parameters at construction; pass all groups then")

    def remove_hooks(self) -> None:
        """Stop accumulating into the fp32 buffers: later gradients stay in ``p.grad`` (and are
        still added to the buffers at the next ``step()``)."""
        for flat in self._flats:
            if flat.grad is not None:
                flat.grad.remove_hooks()

    # ---- gradients -------------------------------------------------------------------------

    def accumulated_grad(self, param: torch.Tensor) -> torch.Tensor | None:
        """The gradient ``param`` contributes to the next step on this rank (before the DP mean).

        With fp32 accumulation a view of the fp32 buffer (in ``param``'s shape), else ``param.grad``.
        """
        for flat in self._flats:
            i = flat.layout.index(param)
            if i is not None:
                return param.grad if flat.grad is None else flat.grad.view(i)
        raise ValueError("accumulated_grad: this parameter is not managed by this Zero1Optimizer")

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear ``p.grad`` (None or zeros, as asked) and zero the fp32 accumulation buffers
        (always zeroed in place: they are reused every step; ``p.grad`` is then None)."""
        for flat in self._flats:
            if flat.grad is not None:
                flat.grad.zero_()
                continue
            for p in flat.layout.params:
                if p.grad is None:
                    continue
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.detach_().zero_()

    # ---- step ------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> torch.Tensor:  # type: ignore[override]  # returns the gradient norm
        """One optimizer step; returns the global gradient norm before clipping."""
        if closure is not None:
            with torch.enable_grad():
                closure()
        for flat in self._flats:
            if flat.grad is not None:
                flat.grad.fold_pending()
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
        the step may scale in place (at DP 1 the reduced tensor is the accumulation buffer).
        Expert buckets are summed over EDP and divided by DP x CP too (module docstring)."""
        dp = self.parallel_state.dp_cp
        pending, out = [], []
        for flat in self._flats:
            for b in flat.buckets:
                if flat.grad is not None:
                    full = flat.grad.data[b.start : b.end]
                else:
                    full = flat.layout.gather(b.start, b.end, [p.grad for p in flat.layout.params], flat.layout.dtype)
                pending.append(collectives.reduce_scatter_start(full, shard_group(self.parallel_state, flat.layout)))
                if len(pending) == self._IN_FLIGHT:
                    out.append(pending.pop(0).wait())
        out += [p.wait() for p in pending]
        return [mine.to(torch.float32) / dp.size for mine in out]

    def _global_grad_norm(self, buckets: list[Bucket], grads: list[torch.Tensor]) -> torch.Tensor:
        device = buckets[0].master.device
        sq = {False: torch.zeros((), dtype=torch.float32, device=device), True: torch.zeros((), device=device)}
        experts = [f.layout.expert for f in self._flats for _ in f.buckets]
        for b, g, expert in zip(buckets, grads, experts):
            for start, end, weight in b.norm_segments:
                sq[expert] = sq[expert] + g[start:end].pow(2).sum() * weight
        ps = self.parallel_state
        total = collectives.all_reduce(collectives.all_reduce(sq[False], ps.dp_cp), ps.tp)
        if any(experts):  # each rank's experts: summed over their shards (EDP), the EP ranks and expert TP
            assert ps.ep is not None  # expert flats exist under expert parallelism only
            spread = collectives.all_reduce(collectives.all_reduce(sq[True], ps.edp), ps.ep)
            total = total + collectives.all_reduce(spread, ps.etp)
        if ps.pp is not None and ps.pp.size > 1:  # each stage holds its own parameters: the norm is over all
            total = collectives.all_reduce(total, ps.pp)
        return total.sqrt()

    def _all_gather_params(self) -> None:
        """Gather every bucket's updated slices over DP into the model parameters."""
        pending = []
        for flat in self._flats:
            for b in flat.buckets:
                group = shard_group(self.parallel_state, flat.layout)
                gathered = collectives.all_gather_start(b.master.to(flat.layout.dtype), group)
                pending.append((flat.layout, b, gathered))
                if len(pending) == self._IN_FLIGHT:
                    copy_into_params(*pending.pop(0))
        for args in pending:
            copy_into_params(*args)

    # ---- checkpoint ------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """This rank's slices: inner optimizer state, fp32 master weights and layout metadata.

        Tensors are references, as with torch optimizers; save them before the next step.
        Every rank saves its own (``optim_dp{dp_rank}_tp{tp_rank}.pt``, say; under expert
        parallelism its experts' slices too, which differ by EP rank). Accumulated
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
        touching any state. Only layout version 2 is read (:mod:`.layout_check`). With
        ``bucket_cap_mb="auto"`` the optimizer first takes the cap the state was saved with (a
        state saved under another backend's default, or before the defaults were per backend,
        loads), if its layout then matches.
        Model parameters are not changed: load them from the model checkpoint.
        """
        if not isinstance(state_dict, dict) or not {"inner", "master", "meta"} <= state_dict.keys():
            raise ValueError("Zero1Optimizer.load_state_dict: expected keys 'version', 'inner', 'master', 'meta'")
        refuse_other_version(state_dict)
        problems = self._mismatches(state_dict)
        if problems and self._adopt_saved_cap(state_dict):
            problems = []
        if problems:
            mismatch = "; ".join(problems)
            raise ValueError(f"Zero1Optimizer.load_state_dict: checkpoint does not match: {mismatch}")
        self.inner.load_state_dict(state_dict["inner"])
        with torch.no_grad():
            for b, m in zip(self.buckets, state_dict["master"]):
                b.master.copy_(m)

    def _meta(self) -> dict[str, Any]:
        ps = self.parallel_state
        return {
            "dp_size": ps.dp_size,
            "dp_rank": ps.dp_rank,
            "tp_size": ps.tp_size,
            "tp_rank": ps.tp_rank,
            "pp_size": ps.pp_size,
            "pp_rank": ps.pp_rank,
            "cp_size": ps.cp_size,
            "cp_rank": ps.cp_rank,
            "ep_size": ps.ep_size,
            "ep_rank": ps.ep_rank,
            "bucket_cap_mb": self.bucket_cap_mb,
            "flats": [f.meta() for f in self._flats],
        }

    def _mismatches(self, state_dict: dict[str, Any]) -> list[str]:
        problems = layout_mismatches(state_dict["meta"], self._meta())
        if not problems and len(state_dict["master"]) != len(self.buckets):
            problems = [f"master slices: checkpoint {len(state_dict['master'])}, here {len(self.buckets)}"]
        return problems

    def _adopt_saved_cap(self, state_dict: dict[str, Any]) -> bool:
        """With an ``"auto"`` cap, cut the flats at the cap ``state_dict`` was saved with, if the
        layout then matches; True when it did. The masters, overwritten by the load, are read
        from the parameters; the gradient buffers do not depend on the cuts."""
        cap = state_dict["meta"].get("bucket_cap_mb", "absent")
        if not self._auto_cap or not (cap is None or _is_cap(cap)) or cap == self.bucket_cap_mb:
            return False
        before = [f.buckets for f in self._flats], self.bucket_cap_mb
        cuts = [cut_buckets(f.layout, self.parallel_state, cap, f.reduce_dtype) for f in self._flats]
        for f, buckets in zip(self._flats, cuts):
            f.buckets = buckets
        self.bucket_cap_mb = cap
        if self._mismatches(state_dict):
            for f, buckets in zip(self._flats, before[0]):
                f.buckets = buckets
            self.bucket_cap_mb = before[1]
            return False
        for i, group in enumerate(self.inner.param_groups):  # the inner parameters are the masters
            group["params"] = self._masters(i)
        return True


def _is_cap(cap: Any) -> bool:
    return isinstance(cap, (int, float)) and not isinstance(cap, bool) and cap > 0
