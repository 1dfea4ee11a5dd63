"""``PipelineConfig``: how a model runs as a pipeline (the schedule, micro-batches, the cut).

Checked at construction as far as the config alone allows; the checks that need the world (the
pipeline size, the number of layers) run when a pipeline is built, before anything is allocated.
"""

from __future__ import annotations

from dataclasses import dataclass

SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble")
"""The schedules of ``torch.distributed.pipelining`` this library drives (:mod:`.schedule`)."""
MULTI_STAGE = ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble")  # several stages per rank
# torch's V-shaped schedules place two stages per rank in a V (rank 0 holds the first and the
# last stage), which the loop placement of .cut and the tied-embedding group do not describe.
_V_SHAPED = "it places stages in a V (rank 0 holds the first and last stage); this library places them in a loop"
REFUSED = {"ZBVZeroBubble": _V_SHAPED, "DualPipeV": _V_SHAPED}
LOSS_AVERAGES = ("tokens", "micro_batches")

CP_REFUSAL = (
    "context parallelism (context_parallel_size={cp}) does not combine with pipeline parallelism yet: "
    "LlamaPipeline's stages take the whole sequence (no CP split of ids, targets and positions, no loss "
    "over the CP group); train with one or the other (docs/context_parallel.md)"
)
"""Why ``LlamaPipeline`` (and ``train.py --pp N --cp C``) refuse a CP degree above 1, in one line."""


@dataclass(frozen=True)
class PipelineConfig:
    """One pipeline's schedule and cut."""

    schedule: str = "1F1B"
    """``"GPipe"`` (all forwards, then all backwards: every micro-batch's activations in flight),
    ``"1F1B"`` (at most ``p - rank`` in flight), ``"Interleaved1F1B"`` (``virtual_stages`` stages
    per rank, a smaller bubble for more point-to-point traffic), ``"LoopedBFS"`` (``virtual_stages``
    stages per rank, each running all its micro-batches in turn, GPipe-like memory) or
    ``"InterleavedZeroBubble"`` (interleaved, the weight gradients deferred to fill the bubble)."""

    micro_batches: int = 1
    """``m``: the batch one :meth:`LlamaPipeline.step` takes is cut into ``m`` micro-batches along
    the batch dimension. 1F1B needs ``m >= p``; the interleaved schedules need ``m`` to be a
    multiple of ``max(1, m // p)`` (torch's rounds); ``m >= p`` keeps the bubble small."""

    virtual_stages: int = 1
    """Stages per rank (``v``): 1 for GPipe and 1F1B, at least 2 for the multi-stage schedules."""

    layers_per_stage: tuple[int, ...] | None = None
    """The cut, one layer count per stage (``p * v`` entries, stage order); None: balanced by cost."""

    embedding_cost: float = 1.0
    """What the embedding counts in layers when the cut is balanced (first stage)."""

    head_cost: float = 1.0
    """What the final norm, the LM head and the loss count in layers (last stage)."""

    loss_average: str = "tokens"
    """``"tokens"``: the step's loss is the mean over every non-ignored target of the batch (what
    ``LlamaForCausalLM`` returns for the whole batch), computed as each micro-batch's sum over the
    batch's token count, so the gradient is exact whatever each micro-batch holds.
    ``"micro_batches"``: the mean of the micro-batches' means (the training loop's gradient
    accumulation); the two agree when every micro-batch holds as many targets."""

    def __post_init__(self) -> None:
        if self.schedule in REFUSED:
            raise ValueError(f"schedule {self.schedule!r} is not supported: {REFUSED[self.schedule]}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {list(SCHEDULES)}, got {self.schedule!r}")
        for name in ("micro_batches", "virtual_stages"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.multi_stage and self.virtual_stages < 2:
            raise ValueError(f"schedule {self.schedule!r} needs virtual_stages >= 2, got {self.virtual_stages}")
        if not self.multi_stage and self.virtual_stages != 1:
            raise ValueError(
                f"schedule {self.schedule!r} runs one stage per rank: virtual_stages must be 1, got "
                f"{self.virtual_stages} (use a multi-stage schedule: Interleaved1F1B)"
            )
        if self.layers_per_stage is not None:
            object.__setattr__(self, "layers_per_stage", tuple(self.layers_per_stage))
        if self.loss_average not in LOSS_AVERAGES:
            raise ValueError(f"loss_average must be one of {list(LOSS_AVERAGES)}, got {self.loss_average!r}")

    @property
    def multi_stage(self) -> bool:
        return self.schedule in MULTI_STAGE

    def validate(self, pipeline_parallel_size: int) -> None:
        """The checks that need the pipeline size (``p``)."""
        p, m = pipeline_parallel_size, self.micro_batches
        if p < 2:
            raise ValueError(
                f"a pipeline needs pipeline_parallel_size >= 2, got {p}: with one stage use "
                "LlamaForCausalLM (initialize_model_parallel(pipeline_parallel_size=...))"
            )
        if self.schedule == "1F1B" and m < p:
            raise ValueError(f"schedule '1F1B' needs micro_batches >= pipeline_parallel_size={p}, got {m}")
        rounds = max(1, m // p)
        if self.schedule in ("Interleaved1F1B", "InterleavedZeroBubble") and m % rounds:
            raise ValueError(
                f"schedule {self.schedule!r} needs micro_batches to be a multiple of max(1, micro_batches // "
                f"pipeline_parallel_size) = {rounds}, got {m} (e.g. a multiple of {p})"
            )
