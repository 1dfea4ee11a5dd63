"""Recompute planned per pipeline stage: the cheapest per-layer choice that fits each rank.

Ranks do not share memory, so each is planned on its own: among the options the planner offers a
layer (:func:`~..options.layer_options`), every count of the rank's layers per option is priced
over the rank's schedule (:class:`~.stage_budget.RankModel`), and the one with the fewest
recompute FLOPs that fits is kept (ties: less memory). The layers of a virtual stage run in the
order that keeps the backward peak lowest (:func:`~..options.canonical_order`'s rule); with
several virtual stages per rank (interleaved) the layers that keep the least go to the stage
with the most micro-batches in flight. With one stage per rank this is the search
:func:`~..planner.plan_recompute` makes (``tests/test_planner.py`` checks that one against a
brute force); grouped full recompute is not weighed per stage.

When a rank does not fit with the least memory its layers can keep, :attr:`PipelinePlan.smallest_pp`
is the smallest pipeline degree at which every rank would (same schedule, micro-batches, virtual
stages, tensor- and data-parallel degrees; the default cut).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from ..budget import GIB
from ..options import LayerOption, layer_options
from ..planner import _config_dict, _splits, limit_bytes
from ..shape import ModelShape, TrainingSetup
from .cut import PipelineSetup
from .stage_budget import RankModel, StageBudget


def stage_flops(model: ModelShape, setup: TrainingSetup, layers: int, holds_head: bool) -> float:
    """Model FLOPs of one micro-batch's forward + backward on a rank holding ``layers`` decoder
    layers (and the LM head when ``holds_head``): its share of ``flops_per_token`` (6N + 12LHQT;
    the head's matmul on the last stage, the embedding lookup nowhere) over the ``s b / t`` tokens."""
    s = setup.seq_len
    one, two = (replace(model, layers=n).flops_per_token(s) for n in (1, 2))
    per_layer = two - one
    flops = layers * per_layer + (one - per_layer if holds_head else 0.0)
    return flops * s * setup.micro_batch / setup.tp


@dataclass(frozen=True)
class StagePlan:
    """One rank's recompute: its :class:`~.stage_budget.StageBudget`, what it was planned for and
    its cost (recompute FLOPs, matmul plus elementwise, and recompute_matmul_flops of them in
    matmuls, against the rank's own model FLOPs, per micro-batch)."""

    budget: StageBudget
    limit_bytes: int
    recompute_flops: float
    recompute_matmul_flops: float
    step_flops: float

    @property
    def fits(self) -> bool:
        return self.budget.total_bytes <= self.limit_bytes

    @property
    def overhead(self) -> float:
        return self.recompute_flops / self.step_flops if self.step_flops else 0.0

    @property
    def counts(self) -> dict[str, int]:
        names = [o.name for o in self.budget.options]
        return {name: names.count(name) for name in dict.fromkeys(names)}

    def describe(self) -> str:
        return " + ".join(f"{n} x {name}" for name, n in self.counts.items()) or "no layers"

    def recompute(self) -> list[list[Any]]:
        """Per virtual stage of the rank, what ``apply_recompute`` takes for its layers: one entry
        per layer (None: no recompute)."""
        out, at = [], 0
        for chunk in self.budget.chunks:
            options = self.budget.options[at : at + chunk.layers]
            out.append([o.recompute if o.recompute.enabled else None for o in options])
            at += chunk.layers
        return out

    def to_dict(self) -> dict[str, Any]:
        out = self.budget.to_dict()
        out.update(
            fits=self.fits, recompute=self.counts, recompute_text=self.describe(),
            recompute_configs=[[None if c is None else _config_dict(c) for c in chunk] for chunk in self.recompute()],
            recompute_flops=self.recompute_flops, recompute_matmul_flops=self.recompute_matmul_flops,
            step_flops=self.step_flops, overhead=self.overhead,
        )  # fmt: skip
        return out


@dataclass(frozen=True)
class PipelinePlan:
    """Every rank's :class:`StagePlan`. ``smallest_pp``: when a rank does not fit, the smallest
    pipeline degree where every rank would (None: none up to the model's layers; also None when
    all fit)."""

    pipeline: PipelineSetup
    stages: tuple[StagePlan, ...]
    limit_bytes: int
    smallest_pp: int | None = None

    @property
    def fits(self) -> bool:
        return all(stage.fits for stage in self.stages)

    def message(self) -> str:
        """One line: which ranks do not fit, by how much, and what would."""
        over = [s for s in self.stages if not s.fits]
        if not over:
            return f"every stage fits in {self.limit_bytes / GIB:.2f} GiB per device"
        worst = max(over, key=lambda s: s.budget.total_bytes)
        p = self.pipeline
        text = (
            f"nothing fits in {self.limit_bytes / GIB:.2f} GiB per device on stage"
            f"{'s' if len(over) > 1 else ''} {', '.join(str(s.budget.rank) for s in over)} of pp={p.pp} "
            f"(stage {worst.budget.rank} needs {worst.budget.total_bytes / GIB:.2f} GiB with the least memory: "
            f"{worst.describe()})"
        )
        if self.smallest_pp is not None:
            return text + (
                f"; would fit: pp={self.smallest_pp} (the smallest pipeline degree that fits, "
                f"{p.schedule}, m={p.microbatches}, the default cut)"
            )
        return text + f"; no pipeline degree above {p.pp} fits ({p.schedule}, m={p.microbatches})"

    def recompute(self) -> list[list[Any]]:
        """One entry per virtual stage, in stage order: the per-layer list of its layers' recompute
        (None: none), which :func:`neuron_ckpt.pipeline.apply_pipeline_recompute` takes as a
        per-stage plan."""
        by_stage: dict[int, list[Any]] = {}
        for stage in self.stages:
            by_stage.update(zip((c.stage for c in stage.budget.chunks), stage.recompute()))
        return [by_stage[k] for k in range(self.pipeline.stages)]

    def to_dict(self) -> dict[str, Any]:
        p = self.pipeline
        return {
            "fits": self.fits, "pp": p.pp, "schedule": p.schedule, "virtual_stages": p.virtual_stages,
            "microbatches": p.microbatches, "buffers": p.buffers, "limit_bytes": self.limit_bytes,
            "limit_gib": round(self.limit_bytes / GIB, 4), "smallest_pp": self.smallest_pp,
            "stages": [stage.to_dict() for stage in self.stages],
        }  # fmt: skip


def _assign(
    rank: RankModel, counts: dict[str, int], options: dict[str, LayerOption], weights: list[int]
) -> list[list[tuple[LayerOption, int]]]:
    """Runs of options per local chunk: the layers keeping least to the chunks with the most in
    flight, each chunk's runs in the order that keeps its backward peak lowest."""
    pool = sorted(((options[n], k) for n, k in counts.items() if k), key=lambda r: r[0].saved_bytes)
    runs: list[list[tuple[LayerOption, int]]] = [[] for _ in rank.chunks]
    for j in sorted(range(len(rank.chunks)), key=lambda j: -weights[j]):
        need = rank.chunks[j].layers
        while need:
            option, k = pool[0]
            take = min(k, need)
            runs[j].append((option, take))
            need -= take
            pool[0] = (option, k - take)
            if not pool[0][1]:
                pool.pop(0)
    return [sorted(r, key=lambda run: run[0].saved_bytes - run[0].backward_peak_bytes) for r in runs]


def _search(rank: RankModel, options: dict[str, LayerOption], limit: int, first_fit: bool = False):
    """(cheapest fitting runs or None, least-memory runs) of one rank; ``first_fit``: stop at the
    first split that fits (the smallest-degree search only asks whether one does)."""
    names = list(options)
    weights = [max(state[j] for state in rank.moments.forward) for j in range(len(rank.chunks))]
    best = least = None
    for split in _splits(rank.layers, len(names)):
        counts = dict(zip(names, split))
        runs = _assign(rank, counts, options, weights)
        total = rank.total(runs)
        cost = sum(options[n].recompute_flops * k for n, k in counts.items())
        if least is None or (total, cost) < least[:2]:
            least = (total, cost, runs)
        if total <= limit and (best is None or (cost, total) < best[:2]):
            best = (cost, total, runs)
            if first_fit:
                break
    assert least is not None  # there is at least one choice of runs
    return (best[2] if best else None), least[2]


def _stage_plan(rank: RankModel, runs, limit: int) -> StagePlan:
    per_chunk = [[o for o, n in r for _ in range(n)] for r in runs]
    budget = rank.budget(per_chunk)
    flops = sum(o.recompute_flops for o in budget.options)
    matmul = sum(o.recompute_matmul_flops for o in budget.options)
    holds_head = any(c.last for c in rank.chunks)
    return StagePlan(budget, limit, flops, matmul, stage_flops(rank.model, rank.setup, rank.layers, holds_head))


def _offered(model: ModelShape, setup: TrainingSetup, allowed: tuple[str, ...] | None) -> dict[str, LayerOption]:
    options = layer_options(model, setup)
    chosen = {n: o for n, o in options.items() if allowed is None or n in allowed}
    if not chosen:
        raise ValueError(f"allowed: no known option among {allowed}; choose from {list(options)}")
    return chosen


def _all_fit(model: ModelShape, setup: TrainingSetup, pipeline: PipelineSetup, limit: int, options) -> bool:
    for r in range(pipeline.pp):
        rank = RankModel(model, setup, pipeline, r)
        if _search(rank, options, limit, first_fit=True)[0] is None:
            return False
    return True


def smallest_pp(
    model: ModelShape, setup: TrainingSetup, pipeline: PipelineSetup, limit: int, allowed: tuple[str, ...] | None = None
) -> int | None:
    """The smallest pipeline degree above ``pipeline.pp`` at which every rank fits ``limit`` bytes
    (same schedule, micro-batches and virtual stages, the default cut); None when none up to one
    layer per stage does. Degrees the schedule refuses (1F1B with fewer micro-batches) are skipped."""
    options = _offered(model, setup, allowed)
    for pp in range(pipeline.pp + 1, model.layers // pipeline.virtual_stages + 1):
        try:
            candidate = PipelineSetup(
                pp, pipeline.microbatches, pipeline.schedule, pipeline.virtual_stages, None, pipeline.buffers
            )
        except ValueError:
            continue
        if _all_fit(model, setup, candidate, limit, options):
            return pp
    return None


def plan_pipeline(
    model: ModelShape,
    setup: TrainingSetup,
    pipeline: PipelineSetup,
    device_memory: float | int | str | None,
    reserve_gib: float | None = None,
    allowed: tuple[str, ...] | None = None,
) -> PipelinePlan:
    """Each rank's cheapest per-layer recompute that fits ``device_memory`` (GiB, a preset such
    as ``"trn1"``, or None to detect) less ``reserve_gib`` (default: 10% of the device, as
    :func:`~..planner.plan_recompute`). A rank that cannot fit gets its least-memory choice
    (``fits`` False), and the plan names the smallest pipeline degree that would fit."""
    limit = limit_bytes(device_memory, reserve_gib)
    pipeline.cut(model.layers)  # the cut is checked against the model before anything is priced
    options = _offered(model, setup, allowed)
    stages = []
    for r in range(pipeline.pp):
        rank = RankModel(model, setup, pipeline, r)
        best, least = _search(rank, options, limit)
        stages.append(_stage_plan(rank, best if best is not None else least, limit))
    plan = PipelinePlan(pipeline, tuple(stages), limit)
    if not plan.fits:
        plan = replace(plan, smallest_pp=smallest_pp(model, setup, pipeline, limit, allowed))
    return plan


__all__ = ["PipelinePlan", "StagePlan", "plan_pipeline", "smallest_pp", "stage_flops"]
