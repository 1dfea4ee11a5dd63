"""The cut: which transformer layers each pipeline stage holds, and which rank holds each stage.

A model of ``L`` layers runs as ``S = p * v`` stages (``p`` = pipeline-parallel size, ``v`` =
virtual stages per rank for interleaved schedules), each a contiguous run of layers; stage 0 also
holds the embedding, stage ``S - 1`` the final norm, the LM head and the loss.

Balanced by cost (the default): every layer costs 1, the embedding ``embedding_cost`` and the
head + loss ``head_cost`` (torchtitan's "first / last stage less layers", Megatron's
``account_for_embedding/loss_in_pipeline_split``). The cut minimises the most expensive stage;
among the cuts that do, later stages take the extra layers (NxD gives the remainder to the later
stages too): under 1F1B the first stage keeps the most micro-batches in flight, so it is the one
to keep light. Or a user's cut: ``layers_per_stage``, one count per stage, uneven allowed.

Every stage holds at least one layer. Placement is torch's "loop" (Megatron's interleaving):
stage ``k`` runs on pipeline rank ``k % p`` as its local chunk ``k // p``, so rank ``r`` holds
stages ``r, r + p, ..., r + (v - 1) p``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class PipelineCut:
    """``layers[k]``: the global layer indices of stage ``k`` (a ``range``)."""

    layers: tuple[range, ...]
    pipeline_parallel_size: int
    virtual_stages: int = 1

    @property
    def num_stages(self) -> int:
        return len(self.layers)

    @property
    def num_layers(self) -> int:
        return self.layers[-1].stop

    @property
    def layers_per_stage(self) -> tuple[int, ...]:
        return tuple(len(r) for r in self.layers)

    def stages_of_rank(self, pp_rank: int) -> tuple[int, ...]:
        """The stage indices pipeline rank ``pp_rank`` holds, first chunk first (loop placement)."""
        p = self.pipeline_parallel_size
        if not 0 <= pp_rank < p:
            raise ValueError(f"pp_rank must be in 0..{p - 1}, got {pp_rank!r}")
        return tuple(chunk * p + pp_rank for chunk in range(self.virtual_stages))

    def rank_of_stage(self, stage: int) -> int:
        return stage % self.pipeline_parallel_size

    def costs(self, embedding_cost: float = 1.0, head_cost: float = 1.0) -> tuple[float, ...]:
        """Each stage's cost: its layers, plus the embedding on the first and the head on the last."""
        S = self.num_stages
        return tuple(_stage_cost(k, len(r), S, embedding_cost, head_cost) for k, r in enumerate(self.layers))


def cut_layers(
    num_layers: int,
    pipeline_parallel_size: int,
    virtual_stages: int = 1,
    layers_per_stage: Sequence[int] | None = None,
    embedding_cost: float = 1.0,
    head_cost: float = 1.0,
) -> PipelineCut:
    """The cut of ``num_layers`` layers into ``pipeline_parallel_size * virtual_stages`` stages.

    ``layers_per_stage``: the user's cut (one positive count per stage, summing to
    ``num_layers``); None: balanced by cost (module docstring). Raises a one-line ValueError for a
    cut that cannot be made.
    """
    for name, value in (
        ("num_layers", num_layers),
        ("pipeline_parallel_size", pipeline_parallel_size),
        ("virtual_stages", virtual_stages),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    for name, cost in (("embedding_cost", embedding_cost), ("head_cost", head_cost)):
        if isinstance(cost, bool) or not isinstance(cost, (int, float)) or not 0 <= cost < float("inf"):
            raise ValueError(f"{name} must be a finite number >= 0, got {cost!r}")
    stages = pipeline_parallel_size * virtual_stages
    if layers_per_stage is None:
        if num_layers < stages:
            raise ValueError(
                f"cannot cut {num_layers} layers into {stages} stages (pipeline_parallel_size="
                f"{pipeline_parallel_size} x virtual_stages={virtual_stages}): every stage needs a layer"
            )
        counts = _balanced(num_layers, stages, float(embedding_cost), float(head_cost))
    else:
        counts = _checked(layers_per_stage, num_layers, stages)
    starts = [sum(counts[:k]) for k in range(stages)]
    layers = tuple(range(a, a + n) for a, n in zip(starts, counts))
    return PipelineCut(layers, pipeline_parallel_size, virtual_stages)


def _checked(layers_per_stage: Sequence[int], num_layers: int, stages: int) -> list[int]:
    counts = list(layers_per_stage) if isinstance(layers_per_stage, (list, tuple)) else None
    if counts is None or any(not isinstance(n, int) or isinstance(n, bool) for n in counts):
        raise ValueError(f"layers_per_stage must be a list of ints, one per stage, got {layers_per_stage!r}")
    if len(counts) != stages:
        raise ValueError(f"layers_per_stage has {len(counts)} entries for {stages} stages; give one count per stage")
    if min(counts) < 1:
        raise ValueError(f"layers_per_stage={counts}: every stage needs at least one layer")
    if sum(counts) != num_layers:
        raise ValueError(f"layers_per_stage={counts} sums to {sum(counts)}, the model has {num_layers} layers")
    return counts


def _stage_cost(k: int, n: int, stages: int, embedding: float, head: float) -> float:
    return n + (embedding if k == 0 else 0.0) + (head if k == stages - 1 else 0.0)


def _balanced(num_layers: int, stages: int, embedding: float, head: float) -> list[int]:
    """The cut with the smallest most expensive stage; among those, the one whose cheapest stage
    costs most (as even as the bottleneck allows); among those, the later stages take the extra
    layers. 80 layers over 8 stages, the embedding and the head a layer each: 9, 10, 10, 10, 10,
    10, 11, 10 (costs 10 ... 10, 11, 11)."""
    # Any stage's cost is n layers plus nothing, the embedding, the head or both.
    extras = {0.0, embedding, head, embedding + head}
    candidates = sorted({n + e for n in range(1, num_layers + 1) for e in extras})
    fixed = [_stage_cost(k, 0, stages, embedding, head) for k in range(stages)]

    def fewest(k: int, low: float) -> int:  # stage k's fewest layers at cost >= low
        return max(1, math.ceil(low - fixed[k] - 1e-9))

    def most(k: int, high: float) -> int:  # stage k's most layers at cost <= high
        return math.floor(high - fixed[k] + 1e-9)

    def fits(low: float, high: float) -> bool:
        lows = [fewest(k, low) for k in range(stages)]
        highs = [most(k, high) for k in range(stages)]
        return all(a <= b for a, b in zip(lows, highs)) and sum(lows) <= num_layers <= sum(highs)

    high = next(c for c in candidates if fits(0.0, c))
    low = max(c for c in [0.0, *candidates] if c <= high and fits(c, high))
    counts, left = [0] * stages, num_layers
    for k in range(stages - 1, -1, -1):  # the later stages first, each as heavy as the earlier ones allow
        earlier = sum(fewest(j, low) for j in range(k))
        counts[k] = min(most(k, high), left - earlier)
        left -= counts[k]
    return counts
