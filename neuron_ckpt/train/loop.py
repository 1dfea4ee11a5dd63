"""The pretraining loop: gradient accumulation, optimizer step, LR schedule, metrics, checkpoints.

Built objects in, nothing constructed here: the caller (e.g. ``tutorials/llama2_7b_tp_zero1/
train.py``) builds the model, the optimizer (``Zero1Optimizer``), the batch order
(``DataParallelBatches``) and the schedule, and passes them to :func:`fit`.

One optimizer step = ``grad_accum`` micro-batches on each DP rank, each loss scaled by
``1/grad_accum`` before backward, so the accumulated gradient is the mean over the rank's
micro-batches; the optimizer then averages over DP. Every block has the same number of targets
(``seq_len - 1``), so this equals the token mean over the global batch.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..distributed import collectives, runtime
from ..distributed.parallel_state import ParallelState
from .checkpoint import CheckpointManager
from .metrics import MetricsWriter, StepRecord, make_record
from .schedule import LRSchedule


def _mark_step() -> None:
    if runtime.is_xla():
        import torch_xla.core.xla_model as xm

        xm.mark_step()


def train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: list[torch.Tensor],
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward/backward over ``micro_batches`` (``[b, s]`` ids; labels = ids), then one step.

    Returns ``(mean loss on this rank, global grad norm before clipping)`` as tensors (no host
    sync here). The optimizer's ``step()`` must return the grad norm (``Zero1Optimizer`` does).
    """
    optimizer.zero_grad(set_to_none=True)
    total = torch.zeros((), dtype=torch.float32, device=device)
    scale = 1.0 / len(micro_batches)
    for ids in micro_batches:
        ids = ids.to(device)
        loss = model(ids, labels=ids).loss
        (loss * scale).backward()
        total = total + loss.detach().float() * scale
        _mark_step()  # XLA: one graph per micro-batch, so graph size does not grow with accumulation
    grad_norm = optimizer.step()
    _mark_step()
    return total, grad_norm


@dataclass
class FitOptions:
    """What :func:`fit` needs besides the built objects."""

    max_steps: int
    """Train until this many optimizer steps have been taken in total (resumed runs included)."""
    global_batch: int
    """Sequences per optimizer step over all DP ranks (for throughput)."""
    seq_len: int
    flops_per_token: float
    """Model FLOPs per token (:func:`neuron_ckpt.models.flops_per_token`) for MFU."""
    peak_tflops_per_rank: float
    checkpoint_every: int = 0
    """Save every N steps (0: never, except ``save_at_end``)."""
    save_at_end: bool = True


def fit(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: Any,
    schedule: LRSchedule,
    options: FitOptions,
    state: ParallelState,
    device: torch.device,
    metrics: MetricsWriter,
    start_step: int = 0,
    checkpoints: CheckpointManager | None = None,
    checkpoint_payload: Callable[[int], tuple[dict, dict]] | None = None,
) -> list[StepRecord]:
    """Run steps ``start_step .. max_steps - 1``; returns the per-step records (every rank).

    ``batches``: an iterator of per-step micro-batch lists positioned at ``start_step``.
    ``checkpoint_payload(step) -> (shard, meta)`` builds what :class:`CheckpointManager` saves
    after ``step`` steps are done.
    """
    model.train()
    records: list[StepRecord] = []
    tokens_seen = start_step * options.global_batch * options.seq_len
    world = state.tp_size * state.dp_size
    last_saved = None
    t_prev = time.perf_counter()
    for step in range(start_step, options.max_steps):
        lr = schedule.apply(optimizer, step)
        loss, grad_norm = train_step(model, optimizer, next(batches), device)
        # Mean loss over DP (every TP rank of a replica holds the same loss).
        loss = collectives.all_reduce(loss.clone(), state.dp) / state.dp_size
        loss_value, norm_value = float(loss.item()), float(grad_norm.item())  # host sync, once a step
        now = time.perf_counter()
        tokens_seen += options.global_batch * options.seq_len
        record = make_record(
            step + 1, loss_value, lr, norm_value, now - t_prev, options.global_batch, options.seq_len,
            options.flops_per_token, options.peak_tflops_per_rank, world, tokens_seen,
        )  # fmt: skip
        records.append(record)
        metrics.write(record)
        done = step + 1
        if checkpoints is not None and options.checkpoint_every and done % options.checkpoint_every == 0:
            checkpoints.save(done, *checkpoint_payload(done))
            last_saved = done
        t_prev = time.perf_counter()  # checkpoint time is not step time
    end = max(options.max_steps, start_step)
    if checkpoints is not None and options.save_at_end and last_saved != end and end > start_step:
        checkpoints.save(end, *checkpoint_payload(end))
    return records
