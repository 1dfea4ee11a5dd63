"""The order in which one pipeline rank runs its forwards and backwards, as torch 2.13 runs it.

A rank's memory depends on how many micro-batches' activations it holds at once, and that is
the schedule's order, not a formula: :func:`rank_order` writes the compute actions of one rank
as ``torch.distributed.pipelining`` executes them (``tests/test_memory_pipeline.py`` checks each
against torch's own schedule classes), and :func:`peak_in_flight` counts from it.

* ``gpipe`` (``ScheduleGPipe._step_microbatches``): every forward, then every backward. Each
  rank holds all ``m`` micro-batches.
* ``1f1b`` (``Schedule1F1B._step_microbatches``): ``min(m, p - i)`` warm-up forwards on rank
  ``i``, then backward-then-forward pairs, then the remaining backwards. Rank ``i`` holds
  ``min(m, p - i)``. torch refuses ``m < p``; Megatron's and NxD's 1F1B (warm-up ``p - i - 1``,
  then forward-then-backward) reach the same peak.
* ``interleaved`` (``ScheduleInterleaved1F1B``): ``v`` model chunks per rank, virtual stage
  ``k = j * p + i`` on rank ``i`` (local chunk ``j``). torch groups the micro-batches in rounds of
  ``r = m // max(1, m // p)`` (its "flexible" interleaving: ``m`` need not be a multiple of
  ``p``, only of the number of rounds), runs ``w = min((v - 1) * r + 2 * (p - 1 - i), m * v)``
  warm-up chunk forwards cycling over the local chunks ``r`` micro-batches at a time, then
  forward-then-backward pairs (backwards from the last local chunk down). Rank ``i`` peaks at
  ``w + 1`` chunk forwards (``w`` when every forward is warm-up).

Where the closed forms differ (:func:`closed_form_in_flight`): the paper (Korthikanti et al.
2022, after Narayanan et al. 2021) multiplies the first stage's ``p`` micro-batches by
``1 + (p - 1) / (p v)``, which is ``v p + p - 1`` chunks of ``L / (v p)`` layers: torch's rank 0
when ``r = p``, i.e. when ``p`` divides ``m`` (Megatron's and NxD's interleaved schedules require
that). When it does not, torch's rounds are longer than ``p`` and every rank holds
``(v - 1) (r - p)`` chunks more (p = 4, m = 10, v = 2: r = 5, rank 0 holds 12 chunks, not 11).
The paper and Megatron's estimator (``theoretical_memory_usage.py``) describe the first stage
only; the other ranks hold fewer (``p - i`` micro-batches under 1F1B).
"""

from __future__ import annotations

from dataclasses import dataclass

from ...checks import require_positive_int

SCHEDULES = ("gpipe", "1f1b", "interleaved")


@dataclass(frozen=True)
class Action:
    """One compute action of a rank: ``kind`` "F" (forward) or "B" (full backward) of
    ``microbatch`` on virtual stage ``stage`` (its global index, ``j * p + rank``)."""

    kind: str
    stage: int
    microbatch: int


def check_schedule(schedule: str, pp: int, microbatches: int, virtual_stages: int = 1) -> None:
    """A one-line ``ValueError`` naming the field unless torch 2.13 runs this schedule."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    for name, value in (("pp", pp), ("microbatches", microbatches), ("virtual_stages", virtual_stages)):
        require_positive_int(name, value)
    if schedule == "interleaved":
        if virtual_stages < 2:
            raise ValueError(f"virtual_stages must be >= 2 for the interleaved schedule, got {virtual_stages}")
        rounds = max(1, microbatches // pp)
        if microbatches % rounds:
            raise ValueError(
                f"microbatches ({microbatches}) must be a multiple of the number of rounds "
                f"max(1, m // pp) = {rounds} for torch's interleaved 1F1B"
            )
    elif virtual_stages != 1:
        raise ValueError(f"virtual_stages ({virtual_stages}) > 1 needs schedule 'interleaved', got {schedule!r}")
    if schedule == "1f1b" and microbatches < pp:
        raise ValueError(
            f"microbatches ({microbatches}) must be >= pp ({pp}) for torch's 1F1B (Schedule1F1B "
            "refuses fewer); use gpipe"
        )


def rank_order(schedule: str, pp: int, microbatches: int, rank: int, virtual_stages: int = 1) -> list[Action]:
    """The forwards and backwards rank ``rank`` runs, in torch 2.13's order (module docstring)."""
    check_schedule(schedule, pp, microbatches, virtual_stages)
    if not (isinstance(rank, int) and 0 <= rank < pp):
        raise ValueError(f"rank must be an int in 0..{pp - 1}, got {rank!r}")
    m = microbatches
    if schedule == "gpipe":
        return [Action("F", rank, i) for i in range(m)] + [Action("B", rank, i) for i in range(m)]
    if schedule == "1f1b":
        warmup = min(m, pp - rank)
        order = [Action("F", rank, i) for i in range(warmup)]
        for i in range(m - warmup):  # steady state: backward first, then forward
            order += [Action("B", rank, i), Action("F", rank, warmup + i)]
        return order + [Action("B", rank, i) for i in range(m - warmup, m)]
    return _interleaved(pp, m, rank, virtual_stages)


def _interleaved(pp: int, m: int, rank: int, v: int) -> list[Action]:
    """``ScheduleInterleaved1F1B._calculate_single_rank_operations``'s compute actions."""
    per_round = m // max(1, m // pp)
    warmup = min((v - 1) * per_round + 2 * (pp - 1 - rank), m * v)
    total = m * v
    fwd_next = [0] * v
    bwd_next = [0] * v

    def forward(step: int) -> Action:
        j = (step // per_round) % v
        fwd_next[j] += 1
        return Action("F", j * pp + rank, fwd_next[j] - 1)

    def backward(step: int) -> Action:
        j = v - 1 - ((step - warmup) // per_round) % v
        bwd_next[j] += 1
        return Action("B", j * pp + rank, bwd_next[j] - 1)

    order = [forward(step) for step in range(warmup)]
    for step in range(warmup, total):  # forward, then backward
        order += [forward(step), backward(step)]
    return order + [backward(step) for step in range(total, total + warmup)]


@dataclass(frozen=True)
class InFlight:
    """What a rank holds at its most: ``by_stage`` micro-batches in flight on each of its virtual
    stages (global index -> count), and ``total``, their sum (chunk forwards held)."""

    by_stage: dict[int, int]

    @property
    def total(self) -> int:
        return sum(self.by_stage.values())


def holdings(order: list[Action]) -> list[dict[int, int]]:
    """The micro-batches in flight per virtual stage after each action of ``order``."""
    held: dict[int, int] = {}
    states = []
    for action in order:
        held[action.stage] = held.get(action.stage, 0) + (1 if action.kind == "F" else -1)
        if held[action.stage] < 0:
            raise ValueError(
                f"order: backward of micro-batch {action.microbatch} on stage {action.stage} before its forward"
            )
        states.append(dict(held))
    return states


def peak_in_flight(schedule: str, pp: int, microbatches: int, rank: int, virtual_stages: int = 1) -> InFlight:
    """The most chunk forwards rank ``rank`` holds at once over its order (the first such moment)."""
    order = rank_order(schedule, pp, microbatches, rank, virtual_stages)
    best = max(holdings(order), key=lambda held: sum(held.values()))
    stages = [j * pp + rank for j in range(virtual_stages)]
    return InFlight({k: best.get(k, 0) for k in stages})


def closed_form_in_flight(schedule: str, pp: int, microbatches: int, rank: int, virtual_stages: int = 1) -> int:
    """Chunk forwards held at the peak by the textbook formulas: GPipe ``m``; 1F1B
    ``min(m, p - i)``; interleaved Megatron's warm-up ``2 (p - i - 1) + (v - 1) p`` plus one,
    capped at ``m v`` (on rank 0, ``v p + p - 1`` chunks: the paper's ``1 + (p - 1) / (p v)``).
    Equal to :func:`peak_in_flight` except where the module docstring says."""
    check_schedule(schedule, pp, microbatches, virtual_stages)
    m, v = microbatches, virtual_stages
    if schedule == "gpipe":
        return m
    if schedule == "1f1b":
        return min(m, pp - rank)
    return min(2 * (pp - rank - 1) + (v - 1) * pp + 1, m * v)


__all__ = [
    "SCHEDULES",
    "Action",
    "InFlight",
    "check_schedule",
    "closed_form_in_flight",
    "holdings",
    "peak_in_flight",
    "rank_order",
]
