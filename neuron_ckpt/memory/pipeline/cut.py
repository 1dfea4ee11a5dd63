"""How a job is pipelined: the degree, the schedule, the micro-batches and where the layers are cut.

:class:`PipelineSetup` sits beside :class:`~neuron_ckpt.memory.shape.TrainingSetup` (which keeps
describing one rank's tensor- and data-parallel job) and is checked against the model by
:meth:`PipelineSetup.cut`. Virtual stages are numbered as torch places them ("loop"): virtual
stage ``k`` runs on rank ``k % p``, so rank ``i`` holds stages ``i, i + p, ..., i + (v - 1) p``.
Stage 0 holds the embedding, the last stage the final norm, the LM head and the loss.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...checks import is_int
from .schedule import SCHEDULES, check_schedule

BUFFERS = ("torch", "none")


@dataclass(frozen=True)
class PipelineSetup:
    """A pipeline-parallel job, per model replica.

    pp: pipeline ranks. microbatches: m, micro-batches per step per data-parallel replica (NxD's
        recipes: global batch / dp / micro-batch size). schedule: one of :data:`SCHEDULES`.
    virtual_stages: model chunks per rank (v >= 2 with "interleaved", else 1).
    stage_layers: decoder layers of each virtual stage in stage order (``p v`` counts summing to
        the model's layers; the first and last stage may hold none, beside the embedding and the
        head); None: the cut :class:`~neuron_ckpt.pipeline.LlamaPipeline` makes by default
        (:func:`~neuron_ckpt.pipeline.cut.cut_layers`: balanced by cost, the embedding and the head
        each costing a layer), so the plan describes the pipeline a user builds.
    buffers: "torch" counts what ``torch.distributed.pipelining.PipelineStage`` (2.13) allocates
        for the schedule beyond autograd's saved tensors (one receive buffer per micro-batch for the
        input, one for the output's gradient, and each in-flight output held until its backward:
        :mod:`.stage_budget`); "none" leaves them out (another runtime, such as NxD's).
    """

    pp: int
    microbatches: int
    schedule: str = "1f1b"
    virtual_stages: int = 1
    stage_layers: tuple[int, ...] | None = None
    buffers: str = "torch"

    def __post_init__(self) -> None:
        check_schedule(self.schedule, self.pp, self.microbatches, self.virtual_stages)
        if self.buffers not in BUFFERS:
            raise ValueError(f"buffers must be one of {BUFFERS}, got {self.buffers!r}")
        if self.stage_layers is not None:
            layers = tuple(self.stage_layers) if isinstance(self.stage_layers, (list, tuple)) else None
            if layers is None or not all(is_int(n) and n >= 0 for n in layers):
                raise ValueError(f"stage_layers must be a tuple of ints >= 0, got {self.stage_layers!r}")
            if len(layers) != self.stages:
                raise ValueError(
                    f"stage_layers: need one count per virtual stage (pp x virtual_stages = "
                    f"{self.stages}), got {len(layers)}"
                )
            empty = [k for k, n in enumerate(layers) if n == 0 and 0 < k < self.stages - 1]
            if empty:
                raise ValueError(
                    f"stage_layers: stage {empty[0]} has no layers; only the first and the last "
                    "stage may (they hold the embedding, the head)"
                )
            object.__setattr__(self, "stage_layers", layers)

    @property
    def stages(self) -> int:
        """Virtual stages in all: ``p v``."""
        return self.pp * self.virtual_stages

    def rank_stages(self, rank: int) -> list[int]:
        """The virtual stages rank ``rank`` runs, in its local order."""
        return [j * self.pp + rank for j in range(self.virtual_stages)]

    def cut(self, layers: int) -> tuple[int, ...]:
        """Decoder layers per virtual stage for a model of ``layers`` layers (ValueError when the
        cut does not add up, or the model has fewer layers than middle stages)."""
        if self.stage_layers is None:
            if layers < self.stages:
                raise ValueError(
                    f"pp x virtual_stages ({self.stages}) is more than the model's {layers} layers: "
                    "every stage needs one"
                )
            from ...pipeline.cut import cut_layers

            return cut_layers(layers, self.pp, self.virtual_stages).layers_per_stage
        if sum(self.stage_layers) != layers:
            raise ValueError(f"stage_layers add up to {sum(self.stage_layers)}, the model has {layers} layers")
        return self.stage_layers

    def first_layers(self, layers: int) -> list[int]:
        """The index of each virtual stage's first decoder layer."""
        starts, at = [], 0
        for n in self.cut(layers):
            starts.append(at)
            at += n
        return starts


__all__ = ["BUFFERS", "SCHEDULES", "PipelineSetup"]
