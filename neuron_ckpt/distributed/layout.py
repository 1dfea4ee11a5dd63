"""Where every rank sits: the five parallel dimensions (TP, CP, EP, DP, PP) as rank lists.

One function, :func:`parallel_layout`, lays a world out; it is pure (it creates no process group)
and every size is checked in one line before anything else happens.
:func:`~neuron_ckpt.distributed.parallel_state.initialize_model_parallel` creates the groups it
lists. Two grids share the world, as in Megatron-Core ("MoE parallel folding"):

* the **dense grid**, for attention, norms, embeddings and dense MLPs, in the order
  ``tp-cp-dp-pp``, TP innermost::

      rank = pp_rank * (dp * cp * tp) + dp_rank * (cp * tp) + cp_rank * tp + tp_rank

* the **expert grid**, for the routed experts of a mixture-of-experts layer, laid over the same
  ranks of each pipeline stage in the order ``etp-ep-edp`` (expert TP innermost)::

      rank = pp_rank * (dp * cp * tp) + edp_rank * (ep * etp) + ep_rank * etp + etp_rank

  so expert parallelism is carved from the stage's TP x CP x DP plane, and the pipeline groups
  of both grids are the same.

The groups, by name (the vocabulary the whole package uses):

========= ====================================================================================
``tp``    tensor parallel: contiguous ranks (a TP group sits inside a node)
``cp``    context parallel: the ranks that split one sequence (stride ``tp``)
``dp``    data parallel: the ranks that read different batches
``dp_cp`` data x context parallel: where dense gradients are reduced and ZeRO-1 shards dense
          optimizer state (weights are replicated over CP, which reads the same batch)
``pp``    pipeline parallel: one rank per stage, same (dp, cp, tp) coordinates
``embedding`` the first and last rank of each PP group (tied embedding and head)
``ep``    expert model parallel: the ranks over which a layer's experts are spread
``edp``   expert data parallel: the ranks holding the same experts, where expert gradients
          are reduced and ZeRO-1 shards expert state; ``world / (etp * ep * pp)`` ranks
``etp``   expert tensor parallel: the ranks that split one expert's width
========= ====================================================================================

Expert tensor parallelism is not a free choice here: ``expert_tensor_parallel_size`` is the TP
degree when ``expert_model_parallel_size`` is 1 (every rank runs every expert at 1/t of its width,
:func:`neuron_ckpt.apply_tensor_parallel` as it always has) and 1 when experts are spread (each EP
rank runs its experts whole). transformers 5.x ("with EP on, experts are never tensor-sharded")
and torchtitan (which removed ETP: skinny expert matmuls, and the TP ranks of an EP group all-to-all
the same tokens) chose the same; Megatron's default ``ETP = TP`` with EP needs an extra
all-gather-v and reduce-scatter-v per layer that trn1 cannot run (no uneven collectives).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from ..checks import positive_int_problem

Groups = tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class ParallelLayout:
    """Every group of each kind as rank lists, and the sizes they came from (module docstring)."""

    world_size: int
    tensor_parallel_size: int
    context_parallel_size: int
    data_parallel_size: int
    pipeline_parallel_size: int
    expert_model_parallel_size: int
    expert_tensor_parallel_size: int
    tp: Groups
    cp: Groups
    dp: Groups
    dp_cp: Groups
    pp: Groups
    embedding: Groups
    ep: Groups
    edp: Groups
    etp: Groups

    @property
    def expert_data_parallel_size(self) -> int:
        return len(self.edp[0])


def _groups(sizes: list[tuple[str, int]], axes: set[str]) -> Groups:
    """The groups of a grid whose axes are ``sizes`` (innermost first) that vary over ``axes``:
    one group for each position of the other axes (outermost varying slowest), its ranks in
    increasing order."""
    strides, stride = {}, 1
    for name, size in sizes:
        strides[name] = stride
        stride *= size
    fixed = [(n, s) for n, s in reversed(sizes) if n not in axes]  # outermost first
    free = [(n, s) for n, s in sizes if n in axes]
    out = []
    for where in itertools.product(*(range(s) for _, s in fixed)):
        base = sum(i * strides[n] for (n, _), i in zip(fixed, where))
        ranks = (
            base + sum(i * strides[n] for (n, _), i in zip(free, pos))
            for pos in itertools.product(*(range(s) for _, s in free))
        )
        out.append(tuple(sorted(ranks)))
    return tuple(out)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def parallel_layout(
    world_size: int,
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    *,
    context_parallel_size: int = 1,
    expert_model_parallel_size: int = 1,
    expert_tensor_parallel_size: int | None = None,
) -> ParallelLayout:
    """The groups of a world of ``world_size`` ranks (module docstring); a one-line ValueError
    naming the sizes when they do not fit. ``expert_tensor_parallel_size`` None takes the only
    value allowed: ``tensor_parallel_size`` without expert parallelism, 1 with it."""
    named = {
        "world_size": world_size,
        "tensor_parallel_size": tensor_parallel_size,
        "pipeline_parallel_size": pipeline_parallel_size,
        "context_parallel_size": context_parallel_size,
        "expert_model_parallel_size": expert_model_parallel_size,
    }
    if expert_tensor_parallel_size is not None:
        named["expert_tensor_parallel_size"] = expert_tensor_parallel_size
    for name, value in named.items():
        if problem := positive_int_problem(name, value):
            raise ValueError(problem)
    t, c, p, e = tensor_parallel_size, context_parallel_size, pipeline_parallel_size, expert_model_parallel_size
    if world_size % (t * c * p):
        parts = [f"{n}={v}" for n, v in named.items() if n != "world_size" and "expert" not in n and v > 1]
        sizes = " x ".join(parts or [f"tensor_parallel_size={t}"]) + (f" = {t * c * p}" if len(parts) > 1 else "")
        raise ValueError(f"{sizes} does not divide the world size {world_size}; allowed: {_divisors(world_size)}")
    d = world_size // (t * c * p)
    allowed_etp = t if e == 1 else 1
    et = allowed_etp if expert_tensor_parallel_size is None else expert_tensor_parallel_size
    if et != allowed_etp:
        why = (
            "experts are split at the TP degree without expert parallelism"
            if e == 1
            else "experts run whole on their EP rank when expert_model_parallel_size > 1"
        )
        raise ValueError(f"expert_tensor_parallel_size must be {allowed_etp} ({why}), got {et}")
    stage = world_size // p
    if stage % (et * e):
        raise ValueError(
            f"expert_model_parallel_size={e} does not divide the {stage} ranks of a pipeline stage "
            f"(world_size {world_size} / pipeline_parallel_size {p}); allowed: {_divisors(stage // et)}"
        )
    dense = [("tp", t), ("cp", c), ("dp", d), ("pp", p)]
    expert = [("etp", et), ("ep", e), ("edp", stage // (et * e)), ("pp", p)]
    pp = _groups(dense, {"pp"})
    return ParallelLayout(
        world_size=world_size,
        tensor_parallel_size=t,
        context_parallel_size=c,
        data_parallel_size=d,
        pipeline_parallel_size=p,
        expert_model_parallel_size=e,
        expert_tensor_parallel_size=et,
        tp=_groups(dense, {"tp"}),
        cp=_groups(dense, {"cp"}),
        dp=_groups(dense, {"dp"}),
        dp_cp=_groups(dense, {"dp", "cp"}),
        pp=pp,
        embedding=tuple(tuple(sorted({g[0], g[-1]})) for g in pp),
        ep=_groups(expert, {"ep"}),
        edp=_groups(expert, {"edp"}),
        etp=_groups(expert, {"etp"}),
    )


__all__ = ["ParallelLayout", "parallel_layout"]
