"""ZeRO stage 1: shard the optimizer state and fp32 master weights over the data-parallel group.

Every data-parallel rank holds the whole model and computes full gradients, but owns only a
1/dp slice of the flattened parameters: it keeps fp32 master weights and optimizer state for that
slice alone. A step is

1. reduce-scatter the flattened gradients over DP (each rank receives the DP-mean of its slice),
2. global gradient norm: squares of the slice, each parameter weighted 1/(TP ranks holding the
   same values), summed over DP then TP, so TP-sharded parameters count once per shard and
   replicated ones once,
3. clip (same formula as ``torch.nn.utils.clip_grad_norm_``),
4. the inner optimizer (AdamW, ...) updates the fp32 slice,
5. all-gather the updated slices over DP and copy them into the model parameters.

Parameters are grouped per user param group and dtype into one flat buffer each, padded so the
length divides the DP size. Gradients of TP-replicated parameters that saw only a
sequence-parallel slice must already be complete (the parallel layers all-reduce them in
backward, see :mod:`neuron_ckpt.parallel.params`); this optimizer never reduces over TP.

All collectives go through :mod:`neuron_ckpt.distributed.collectives`, and the step has no host
synchronisation (the norm stays a tensor), so it traces into one graph on XLA.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch

from ..distributed import collectives
from ..distributed.parallel_state import ParallelState, get_parallel_state
from ..parallel.params import tensor_parallel_duplicates


@dataclass
class _FlatShard:
    """Parameters of one (param group, dtype) laid end to end, and this rank's slice of them.

    ``norm_segments`` are ``(start, end, weight)`` ranges of the slice with the 1/duplicates
    weight of the parameter they cover, so the norm needs no per-element weight tensor.
    """

    group: int
    dtype: torch.dtype
    params: list[torch.Tensor]
    offsets: list[int]
    padding: int
    master: torch.Tensor
    norm_segments: list[tuple[int, int, float]] = field(default_factory=list)

    def meta(self) -> dict[str, Any]:
        return {
            "group": self.group,
            "dtype": str(self.dtype),
            "shapes": [tuple(p.shape) for p in self.params],
            "numels": [p.numel() for p in self.params],
            "padding": self.padding,
            "shard_numel": self.master.numel(),
        }


def _flatten(tensors: list[torch.Tensor], padding: int, dtype: torch.dtype) -> torch.Tensor:
    parts = [t.reshape(-1).to(dtype) for t in tensors]
    if padding:
        parts.append(torch.zeros(padding, dtype=dtype, device=tensors[0].device))
    return torch.cat(parts)


def _norm_segments(shard: _FlatShard, lo: int, tp_size: int) -> list[tuple[int, int, float]]:
    """Where each parameter falls inside this rank's slice ``[lo, lo + shard_numel)``."""
    hi = lo + shard.master.numel()
    segments: list[tuple[int, int, float]] = []
    for p, off in zip(shard.params, shard.offsets):
        start, end = max(lo, off), min(hi, off + p.numel())
        if start >= end:
            continue
        weight = 1.0 / tensor_parallel_duplicates(p, tp_size)
        if segments and segments[-1][1] == start - lo and segments[-1][2] == weight:
            segments[-1] = (segments[-1][0], end - lo, weight)
        else:
            segments.append((start - lo, end - lo, weight))
    return segments


def _build_shard(group: int, params: list[torch.Tensor], ps: ParallelState) -> _FlatShard:
    dp = ps.dp_size
    offsets = [0]
    for p in params[:-1]:
        offsets.append(offsets[-1] + p.numel())
    numel = offsets[-1] + params[-1].numel()
    padding = -numel % dp
    shard_numel = (numel + padding) // dp
    lo = ps.dp_rank * shard_numel
    with torch.no_grad():
        flat = _flatten([p.detach() for p in params], padding, params[0].dtype)
        master = flat[lo : lo + shard_numel].to(torch.float32).clone()
    shard = _FlatShard(group, params[0].dtype, params, offsets, padding, master)
    shard.norm_segments = _norm_segments(shard, lo, ps.tp_size)
    return shard


def _param_groups(params: Iterable[torch.Tensor] | Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    groups = list(params)
    if not groups:
        raise ValueError("Zero1Optimizer got an empty parameter list")
    if not isinstance(groups[0], dict):
        groups = [{"params": groups}]
    seen: set[int] = set()
    out = []
    for g in groups:
        ps = [g["params"]] if isinstance(g["params"], torch.Tensor) else list(g["params"])
        for p in ps:
            if id(p) in seen:
                raise ValueError("Zero1Optimizer: a parameter appears more than once in params")
            seen.add(id(p))
        out.append({**g, "params": [p for p in ps if p.requires_grad]})
    if not any(g["params"] for g in out):
        raise ValueError("Zero1Optimizer: no parameter requires grad")
    return out


class Zero1Optimizer(torch.optim.Optimizer):
    """ZeRO-1 wrapper around any ``torch.optim`` optimizer class.

    ``Zero1Optimizer(model.parameters(), torch.optim.AdamW, grad_clip_norm=1.0, lr=3e-4)``.
    ``params`` may be tensors or param-group dicts (per-group options such as
    ``weight_decay=0.0`` for norms pass through). ``**defaults`` go to ``optimizer_class``.
    Parameters with ``requires_grad=False`` are left alone; a parameter whose ``.grad`` is None
    is treated as having a zero gradient (unlike torch optimizers, which skip it: weight decay
    still applies and the moments still decay, the same on every rank).

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
        **defaults: Any,
    ) -> None:
        if grad_clip_norm is not None and not grad_clip_norm > 0:
            raise ValueError(f"grad_clip_norm must be None or > 0, got {grad_clip_norm!r}")
        self.parallel_state = parallel_state or get_parallel_state()
        self.grad_clip_norm = grad_clip_norm
        self.last_grad_norm: torch.Tensor | None = None
        self.shards: list[_FlatShard] = []
        inner_groups = []
        for i, group in enumerate(_param_groups(params)):
            masters = [s.master for s in self._add_shards(i, group["params"])]
            inner_groups.append({**group, "params": masters})
        self.inner = optimizer_class(inner_groups, **defaults)
        # Share, not copy: schedulers and users edit the hyperparameters the inner step reads.
        self.defaults = self.inner.defaults
        self.param_groups = self.inner.param_groups
        self.state = self.inner.state

    def _add_shards(self, group: int, params: list[torch.Tensor]) -> list[_FlatShard]:
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for p in params:
            by_dtype.setdefault(p.dtype, []).append(p)
        new = [_build_shard(group, ps, self.parallel_state) for ps in by_dtype.values()]
        self.shards.extend(new)
        return new

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise NotImplementedError("Zero1Optimizer flattens parameters at construction; pass all groups then")

    # ---- step ------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> torch.Tensor:  # type: ignore[override]
        """One optimizer step; returns the global gradient norm before clipping."""
        if closure is not None:
            with torch.enable_grad():
                closure()
        grads = [self._reduce_scatter_grad(s) for s in self.shards]
        norm = self._global_grad_norm(grads)
        if self.grad_clip_norm is not None:
            # Same formula as clip_grad_norm_, as a tensor: no host sync on XLA.
            coef = torch.clamp(self.grad_clip_norm / (norm + 1e-6), max=1.0)
            for g in grads:
                g.mul_(coef)
        for s, g in zip(self.shards, grads):
            s.master.grad = g
        self.inner.step()
        for s in self.shards:
            s.master.grad = None
            self._all_gather_params(s)
        self.last_grad_norm = norm
        return norm

    def _reduce_scatter_grad(self, shard: _FlatShard) -> torch.Tensor:
        """This rank's slice of the DP-mean gradient, in fp32 (a fresh tensor it may scale)."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in shard.params]
        flat = _flatten(grads, shard.padding, shard.dtype)
        mine = collectives.reduce_scatter(flat, 0, self.parallel_state.dp)
        return mine.to(torch.float32).div_(self.parallel_state.dp_size)

    def _global_grad_norm(self, grads: list[torch.Tensor]) -> torch.Tensor:
        device = self.shards[0].master.device
        sq = torch.zeros((), dtype=torch.float32, device=device)
        for s, g in zip(self.shards, grads):
            for start, end, weight in s.norm_segments:
                sq = sq + g[start:end].pow(2).sum() * weight
        sq = collectives.all_reduce(sq, self.parallel_state.dp)
        sq = collectives.all_reduce(sq, self.parallel_state.tp)
        return sq.sqrt()

    def _all_gather_params(self, shard: _FlatShard) -> None:
        flat = collectives.all_gather(shard.master.to(shard.dtype), 0, self.parallel_state.dp)
        for p, off in zip(shard.params, shard.offsets):
            p.copy_(flat[off : off + p.numel()].view_as(p))

    def zero_grad(self, set_to_none: bool = True) -> None:
        for s in self.shards:
            for p in s.params:
                if p.grad is None:
                    continue
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.detach_().zero_()

    # ---- checkpoint ------------------------------------------------------------------------

    def _meta(self) -> dict[str, Any]:
        ps = self.parallel_state
        return {
            "dp_size": ps.dp_size,
            "dp_rank": ps.dp_rank,
            "tp_size": ps.tp_size,
            "tp_rank": ps.tp_rank,
            "buffers": [s.meta() for s in self.shards],
        }

    def state_dict(self) -> dict[str, Any]:
        """This rank's slice: inner optimizer state, fp32 master weights and layout metadata.

        Tensors are references, as with torch optimizers; save them before the next step.
        Every rank saves its own (``optim_dp{dp_rank}_tp{tp_rank}.pt``, say).
        """
        return {
            "inner": self.inner.state_dict(),
            "master": [s.master for s in self.shards],
            "meta": self._meta(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a slice saved by :meth:`state_dict` with the same layout.

        Raises ValueError naming every mismatched field (dp_size, tp_size, ranks, dtypes,
        parameter shapes) before touching any state. Model parameters are not changed: load
        them from the model checkpoint.
        """
        if not isinstance(state_dict, dict) or not {"inner", "master", "meta"} <= state_dict.keys():
            raise ValueError("Zero1Optimizer.load_state_dict: expected keys 'inner', 'master', 'meta'")
        problems = _meta_mismatches(state_dict["meta"], self._meta())
        if problems:
            mismatch = "; ".join(problems)
            raise ValueError(f"Zero1Optimizer.load_state_dict: checkpoint does not match: {mismatch}")
        self.inner.load_state_dict(state_dict["inner"])
        # torch's Optimizer.load_state_dict builds new param_groups: share them again, or an LR
        # scheduler attached to this optimizer would stop reaching the inner one.
        self.param_groups, self.state = self.inner.param_groups, self.inner.state
        with torch.no_grad():
            for s, m in zip(self.shards, state_dict["master"]):
                s.master.copy_(m)


def _meta_mismatches(saved: dict[str, Any], here: dict[str, Any]) -> list[str]:
    """Human-readable ``field: checkpoint X, here Y`` for every difference."""
    out = [
        f"{k}: checkpoint {saved.get(k)}, here {here[k]}"
        for k in ("dp_size", "tp_size", "dp_rank", "tp_rank")
        if saved.get(k) != here[k]
    ]
    a, b = saved.get("buffers", []), here["buffers"]
    if len(a) != len(b):
        out.append(f"number of flat buffers (param group x dtype): checkpoint {len(a)}, here {len(b)}")
        return out
    for i, (x, y) in enumerate(zip(a, b)):
        name = f"buffers[{i}]"
        for k in ("group", "dtype", "padding", "shard_numel"):
            if x[k] != y[k]:
                out.append(f"{name}.{k}: checkpoint {x[k]}, here {y[k]}")
        if len(x["shapes"]) != len(y["shapes"]):
            out.append(f"{name} parameter count: checkpoint {len(x['shapes'])}, here {len(y['shapes'])}")
            continue
        for j, (sx, sy) in enumerate(zip(x["shapes"], y["shapes"])):
            if tuple(sx) != tuple(sy):
                out.append(f"{name} parameter {j} shape: checkpoint {tuple(sx)}, here {tuple(sy)}")
    return out
