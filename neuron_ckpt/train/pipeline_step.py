"""One optimizer step of a pipeline-parallel model: the step's micro-batches through the schedule,
then ZeRO-1, and the loss brought from the last stage to every rank.

Gradient accumulation is the schedule's. The ``grad_accum`` micro-batches a DP replica trains on
per optimizer step (``global_batch / (micro_batch_size x DP)``, as without pipeline parallelism)
are the pipeline's ``m`` micro-batches (``PipelineConfig.micro_batches``), run by one
``LlamaPipeline.step`` over their concatenation ``[m * b, s]``. Built with
``loss_average="micro_batches"`` each micro-batch's loss is its mean divided by ``m``, which is what
:func:`~.loop.train_step` backpropagates (``loss * 1 / grad_accum``): the same loss and gradient
as ``--pp 1`` for the same global batch, whatever the degree.

Order within the step (pipeline-facts.md §4): the schedule's backwards, then the tied embedding's
sum over the first and last stage (``LlamaPipeline.step`` runs ``finish_gradients``, into
``Zero1Optimizer``'s fp32 buffer when it accumulates there), then the optimizer: its DP
reduce-scatter, the gradient norm over every stage (the tied table once), clipping, the update.

The loss exists on the last stage only; the other ranks would log nothing (or, as torchtitan#547
did, -1). It is summed over the pipeline group with zeros from the other stages, so every rank
returns its replica's loss, and :func:`~.loop.fit` takes the DP mean and checks it for NaN / Inf on
every rank at the same step.
"""

from __future__ import annotations

from typing import cast

import torch

from ..distributed import collectives
from ..distributed.parallel_state import ParallelState
from ..pipeline import LlamaPipeline


def is_pipeline(model: object) -> bool:
    return isinstance(model, LlamaPipeline)


def last_stage_loss(loss: torch.Tensor | None, parallel_state: ParallelState, device: torch.device) -> torch.Tensor:
    """The last stage's ``loss`` on every rank of its pipeline group (``None`` elsewhere)."""
    local = loss.detach().float() if loss is not None else torch.zeros((), dtype=torch.float32, device=device)
    if parallel_state.pp is None or parallel_state.pp.size == 1:
        return local
    return collectives.all_reduce(local, parallel_state.pp)


def pipeline_train_step(
    pipe: LlamaPipeline,
    optimizer: torch.optim.Optimizer,
    micro_batches: list[torch.Tensor],
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`~.loop.train_step` for a pipeline: ``micro_batches`` (``m`` of ``[b, s]`` ids; labels
    = ids) through ``pipe``'s schedule, then ``optimizer.step()``. Returns ``(the replica's mean
    loss on every rank, the global grad norm before clipping)``."""
    m = pipe.config.micro_batches
    if len(micro_batches) != m:
        raise ValueError(f"pipeline_train_step: {len(micro_batches)} micro-batches, the pipeline's schedule runs {m}")
    optimizer.zero_grad(set_to_none=True)
    ids = torch.cat(micro_batches).to(device)
    loss = pipe.step(ids, ids)
    loss = last_stage_loss(loss, pipe.parallel_state, device)
    grad_norm = cast(torch.Tensor, optimizer.step())  # a Zero1Optimizer's: the gradient norm
    return loss, grad_norm
