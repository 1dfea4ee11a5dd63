"""A transformers model over pipeline stages, each rank planned on its own: :func:`plan_stages`.

The package pipelines its own Llama only (:mod:`neuron_ckpt.pipeline`); for a transformers model
this prices the job as a Megatron-style pipeline would run it, to answer whether a model too big
for one rank's share of tensor and expert parallelism fits with pipeline parallelism (DeepSeek-V3,
Mixtral 8x7B on trn1). Each rank holds one stage (:class:`~.model.Stage`): the layers of
LlamaPipeline's default cut (:func:`~neuron_ckpt.pipeline.cut.cut_layers`: balanced by cost, the
embedding and the head each costing a layer) or ``--stage-layers``, the embedding on the first,
the final norm, LM head and loss on the last (and a copy of a tied embedding), and the activations
of the micro-batches the schedule keeps in flight there (the closed form:
:func:`~neuron_ckpt.memory.pipeline.schedule.closed_form_in_flight`; GPipe and 1F1B) with, beyond
the layers', the stage's received input and sent output held per micro-batch until their
gradients. No runtime's own buffers are counted (there is none here for these models). Expert
data parallelism per stage is ``tp dp / ep`` as without a pipeline (``world / (EP x PP)``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..pipeline.cut import PipelineSetup
from ..pipeline.schedule import closed_form_in_flight
from ..planner import NothingFits, Plan, fits, limit_bytes, plan_recompute
from ..shape import TrainingSetup
from .model import Stage, TransformersModel


def stage_jobs(
    model: TransformersModel, setup: TrainingSetup, pipeline: PipelineSetup
) -> list[tuple[TransformersModel, TrainingSetup]]:
    """Each rank's stage and its job (the micro-batches it holds in flight)."""
    if pipeline.virtual_stages != 1:
        raise ValueError(
            f"--virtual-stages {pipeline.virtual_stages}: a transformers model is priced with one stage per rank "
            "(gpipe or 1f1b)"
        )
    out, first = [], 0
    for rank, n in enumerate(pipeline.cut(model.shape.layers)):
        stage = Stage(first, first + n, embedding=rank == 0, head=rank == pipeline.pp - 1)
        flight = closed_form_in_flight(pipeline.schedule, pipeline.pp, pipeline.microbatches, rank)
        out.append((replace(model, stage=stage), replace(setup, microbatches_in_flight=flight)))
        first += n
    return out


@dataclass(frozen=True)
class StagePlan:
    """One rank's plan, or (``plan`` None) why nothing fits there (``nothing``)."""

    rank: int
    model: TransformersModel
    setup: TrainingSetup
    plan: Plan | None
    nothing: NothingFits | None

    @property
    def budget(self):
        return self.plan.budget if self.plan is not None else self.nothing.least.budget  # type: ignore[union-attr]  # one is set


def plan_stages(
    model: TransformersModel,
    setup: TrainingSetup,
    pipeline: PipelineSetup,
    device_memory: float | int | str | None,
    reserve_gib: float | None = None,
) -> list[StagePlan]:
    """Every rank's cheapest recompute that fits (:func:`~neuron_ckpt.memory.planner.plan_recompute`)."""
    out = []
    for rank, (stage, job) in enumerate(stage_jobs(model, setup, pipeline)):
        try:
            out.append(StagePlan(rank, stage, job, plan_recompute(stage, job, device_memory, reserve_gib), None))
        except NothingFits as exc:
            out.append(StagePlan(rank, stage, job, None, exc))
    return out


def smallest_pp(
    model: TransformersModel,
    setup: TrainingSetup,
    pipeline: PipelineSetup,
    device_memory: float | int | str | None,
    reserve_gib: float | None = None,
) -> int | None:
    """The smallest pipeline degree above ``pipeline.pp`` at which every rank fits (the default
    cut, the same schedule and micro-batches); None when none up to one layer per rank does."""
    limit = limit_bytes(device_memory, reserve_gib)
    for pp in range(pipeline.pp + 1, model.shape.layers + 1):
        try:
            other = replace(pipeline, pp=pp, stage_layers=None)
        except ValueError:  # the schedule refuses it (fewer micro-batches than stages)
            continue
        if all(fits(stage, job, limit) for stage, job in stage_jobs(model, setup, other)):
            return pp
    return None


__all__ = ["StagePlan", "plan_stages", "smallest_pp", "stage_jobs"]
