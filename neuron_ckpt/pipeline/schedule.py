"""The glue to ``torch.distributed.pipelining``: torch's stages and schedules run ours.

Each local stage module becomes a ``PipelineStage`` with static shapes (torch 2.13 then skips its
shape-inference forward, which would run every stage once more on the first step), talking over
this rank's pipeline group; the schedule is torch's class of the configured name, built with
``scale_grads=False`` because the loss function already divides by the batch's token count
(:mod:`.loss`); torch's default (``True``) divides every gradient by ``m`` once more.

What runs on gloo (torch 2.13, CPU, checked by tests/test_pipeline.py at pp 2 and pp 2 x tp 2):
GPipe, 1F1B, Interleaved1F1B, LoopedBFS and InterleavedZeroBubble. The V-shaped schedules
(ZBVZeroBubble, DualPipeV) are refused by :class:`~.config.PipelineConfig`.

Zero bubble and recompute: the zero-bubble schedule splits each backward in two, the input
gradients first (``torch.autograd.grad`` on the stage's inputs), the weight gradients later, through
the same graph. torch's non-reentrant activation checkpoint (our default off XLA) composes with
that: full recompute and selective ``core_attn`` / ``mlp`` give the pp=1 gradients. Two kinds of
unit do not, and :func:`recompute_conflict` refuses them before the step: the reentrant checkpoint
(``use_reentrant=True``, ``distribute_saved_activations``), which runs through ``.backward()`` only
and raised in the input pass, and output-discarding units (``mlp_act``, ``norm``), whose rerun
frees what the weight pass needs ("backward through the graph a second time"). Either way the
peer stage then waits for a gradient that never comes, until the collective timeout.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch.distributed import pipelining

from ..recompute import Recompute, RecomputeConfig
from ..recompute.module_map import DISCARDING
from .config import PipelineConfig

_SPLIT_BACKWARD = ("InterleavedZeroBubble",)  # input and weight gradients in two passes

_CLASSES = {
    "GPipe": pipelining.ScheduleGPipe,
    "1F1B": pipelining.Schedule1F1B,
    "Interleaved1F1B": pipelining.ScheduleInterleaved1F1B,
    "LoopedBFS": pipelining.ScheduleLoopedBFS,
    "InterleavedZeroBubble": pipelining.ScheduleInterleavedZeroBubble,
}


def torch_stage(
    module: torch.nn.Module,
    stage_index: int,
    num_stages: int,
    example_input: torch.Tensor,
    example_output: torch.Tensor,
    group,
    device: torch.device,
) -> pipelining.PipelineStage:
    """A ``PipelineStage`` over ``module`` with static micro-batch shapes (meta tensors).

    The examples' ``requires_grad`` matters: a received hidden state must require grad so its
    gradient is sent back, and an output that does not would make torch expect no gradient.
    """
    return pipelining.PipelineStage(
        module, stage_index, num_stages, device,
        input_args=example_input, output_args=example_output, group=group,
    )  # fmt: skip


def build_schedule(
    stages: Sequence[pipelining.PipelineStage],
    config: PipelineConfig,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
):
    """torch's schedule ``config.schedule`` over this rank's stages (one, or ``v`` in loop order)."""
    cls = _CLASSES[config.schedule]
    target = list(stages) if config.multi_stage else stages[0]
    return cls(target, config.micro_batches, loss_fn=loss_fn, scale_grads=False)


def recompute_conflict(schedule: str, config: RecomputeConfig | None) -> str | None:
    """Why ``config`` cannot run under ``schedule`` (module docstring), or None."""
    if schedule not in _SPLIT_BACKWARD or config is None or not config.enabled:
        return None
    if config.use_reentrant or config.distribute_saved_activations:
        return _REENTRANT.format(schedule=schedule)
    if config.granularity == "selective" and set(config.modules) & set(DISCARDING):
        return _DISCARDING.format(schedule=schedule, names=", ".join(sorted(set(config.modules) & set(DISCARDING))))
    return None


def check_recompute_composes(schedule: str, modules: Sequence[torch.nn.Module]) -> None:
    """Raise before a step whose stages hold a unit ``schedule`` cannot run (one applied with
    ``apply_recompute`` on a stage directly, past :func:`~.recompute.apply_pipeline_recompute`'s check)."""
    if schedule not in _SPLIT_BACKWARD:
        return
    for module in modules:
        for name, unit in module.named_modules():
            if isinstance(unit, Recompute):
                reason = (
                    _DISCARDING.format(schedule=schedule, names=name)
                    if unit.discard
                    else recompute_conflict(schedule, unit.config)
                )
                if reason is not None:
                    raise ValueError(f"{name}: {reason}")


_REENTRANT = (
    "schedule {schedule!r} takes input gradients with torch.autograd.grad, which the reentrant activation "
    "checkpoint does not support: leave use_reentrant None/False and distribute_saved_activations off"
)
_DISCARDING = (
    "schedule {schedule!r} backpropagates each micro-batch in two passes, which output-discarding recompute "
    "({names}) does not support: recompute core_attn or mlp, or use Interleaved1F1B"
)
