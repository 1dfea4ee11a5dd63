"""The pretraining loop: gradient accumulation, optimizer step, LR schedule, metrics, checkpoints.

Built objects in, nothing constructed here: the caller (e.g. ``tutorials/llama2_7b_tp_zero1/
train.py``) builds the model, the optimizer (``Zero1Optimizer``), the batch order
(``DataParallelBatches``) and the schedule, and passes them to :func:`fit`.

One optimizer step = ``grad_accum`` micro-batches on each DP rank, each loss scaled by
``1/grad_accum`` before backward, so the accumulated gradient is the mean over the rank's
micro-batches; the optimizer then averages over DP. Every block has the same number of targets
(``seq_len - 1``), so this equals the token mean over the global batch.

On XLA a step is ``grad_accum + 1`` graphs: one per micro-batch (forward + backward), then one
for the optimizer step, which also holds the DP mean of the loss. Nothing in a step reads a
device value on the host, so tracing step N+1 overlaps the device running step N; the loss and
gradient norm reach the host only on logged steps (``log_every``), through
``xm.add_step_closure``, and on checkpoint steps. Eager backends log the same way, with the
closure called at once.

Faults (:mod:`neuron_ckpt.train.faults`): a NaN or Inf loss or gradient norm raises
:class:`~.faults.NonFiniteError` where the values reach the host (logged and checkpoint steps),
before that step's metrics line or checkpoint is written (not in a graphs-only run, whose values
are placeholders: :attr:`FitOptions.graphs_only`). SIGTERM / SIGINT finish the current
step, all ranks agree to stop after it (a host-side all-reduce of a flag each step,
:func:`~neuron_ckpt.distributed.host.all_max`: no device graph), save a checkpoint of it and
raise :class:`~.faults.Interrupted`. Each rank keeps its last finished step in the default store;
when a collective fails, :class:`~.faults.CollectiveTimeoutError` names the ranks that stopped
answering.
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..distributed import collectives, host, runtime
from ..distributed.parallel_state import ParallelState
from . import faults
from .checkpoint import CheckpointManager
from .metrics import MetricsWriter, StepRecord, device_peak_bytes, make_record
from .schedule import LRSchedule


def _xm():
    import torch_xla.core.xla_model as xm

    return xm


def train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: list[torch.Tensor],
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward/backward over ``micro_batches`` (``[b, s]`` ids; labels = ids), then one step.

    Returns ``(mean loss on this rank, global grad norm before clipping)`` as tensors (no host
    sync here). The optimizer's ``step()`` must return the grad norm (``Zero1Optimizer`` does).
    On XLA each micro-batch ends its graph; the optimizer step's graph is left open, for the
    caller to add what belongs to the step (the loss reduction, logging) before ``mark_step``.
    """
    optimizer.zero_grad(set_to_none=True)
    total = torch.zeros((), dtype=torch.float32, device=device)
    scale = 1.0 / len(micro_batches)
    for ids in micro_batches:
        ids = ids.to(device)
        loss = model(ids, labels=ids).loss
        (loss * scale).backward()
        total = total + loss.detach().float() * scale
        runtime.step_boundary()  # XLA: one graph per micro-batch, so graph size does not grow with accumulation
    grad_norm = optimizer.step()
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
    """Model FLOPs per token (:meth:`neuron_ckpt.memory.ModelShape.flops_per_token`) for MFU."""
    peak_tflops_per_rank: float
    checkpoint_every: int = 0
    """Save every N steps (0: only at the end; the last step is always saved)."""
    log_every: int = 1
    """Bring the loss and gradient norm to the host and log them every N steps (and on the last
    and checkpoint steps); the step time logged is the mean over the interval. On XLA every
    logged step waits for the device, so keep it above 1 there (the tutorial uses 10). These are
    also the steps whose values are checked for NaN / Inf."""
    predicted_peak_bytes: int | None = None
    """The planner's peak memory for the job, logged next to the device's measured peak."""
    graphs_only: bool = False
    """A compile-only run (``neuron_parallel_compile`` sets ``NEURON_EXTRACT_GRAPHS_ONLY``): the
    graphs are traced as in a real run, but the values that reach the host are placeholders, so
    they are not checked for NaN / Inf, not logged, and no checkpoint is saved (a later
    ``--resume latest`` would load placeholder weights)."""

    def __post_init__(self) -> None:
        if self.log_every < 1:
            raise ValueError(f"log_every must be >= 1, got {self.log_every}")


class _Logger:
    """Turns (loss, grad norm) tensors into :class:`StepRecord` s, timing the logged intervals."""

    def __init__(self, options: FitOptions, metrics: MetricsWriter, world: int, tokens_seen: int,
                 device: torch.device | None = None):
        self.options, self.metrics, self.world, self.device = options, metrics, world, device
        self.tokens_seen = tokens_seen
        self.records: list[StepRecord] = []
        self.last_finite: int | None = None
        self.restart()

    def restart(self) -> None:
        """Start a new timing interval now (after set-up or a checkpoint: neither is step time)."""
        self.start, self.steps = time.perf_counter(), 0

    def step_done(self) -> None:
        self.steps += 1
        self.tokens_seen += self.options.global_batch * self.options.seq_len

    def log(self, values: torch.Tensor, step: int, lr: float) -> None:
        """``values`` = ``[loss, grad_norm]``; called when they are on the device (step closure).
        Raises :class:`~.faults.NonFiniteError` before writing anything if either is NaN / Inf."""
        if self.options.graphs_only:  # placeholders: nothing to check or log
            self.restart()
            return
        loss, grad_norm = values.tolist()  # the one device-to-host transfer of a logged step
        faults.check_finite(step, loss, grad_norm, self.last_finite)
        self.last_finite = step
        now, o = time.perf_counter(), self.options
        record = make_record(
            step, loss, lr, grad_norm, (now - self.start) / self.steps, o.global_batch, o.seq_len,
            o.flops_per_token, o.peak_tflops_per_rank, self.world, self.tokens_seen,
            device_peak_bytes(self.device) if self.device is not None else None, o.predicted_peak_bytes,
        )  # fmt: skip
        self.records.append(record)
        self.metrics.write(record)
        self.start, self.steps = now, 0


def fit(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: Any,
    schedule: LRSchedule,
    options: FitOptions,
    parallel_state: ParallelState,
    device: torch.device,
    metrics: MetricsWriter,
    start_step: int = 0,
    checkpoints: CheckpointManager | None = None,
    checkpoint_payload: Callable[[int], tuple[dict, dict]] | None = None,
) -> list[StepRecord]:
    """Run steps ``start_step .. max_steps - 1``; returns the records of the logged steps.

    ``batches``: an iterator of per-step micro-batch lists positioned at ``start_step``.
    ``checkpoint_payload(step) -> (shard, meta)`` builds what :class:`CheckpointManager` saves
    after ``step`` steps are done.

    Raises :class:`~.faults.NonFiniteError` (a NaN / Inf loss or gradient norm, on every rank at
    the same step, nothing written for it), :class:`~.faults.Interrupted` (SIGTERM / SIGINT:
    every rank stopped after the same step, checkpointed when ``checkpoints`` is given) and
    :class:`~.faults.CollectiveTimeoutError` (a collective failed; names the silent ranks).
    """
    model.train()
    xla = runtime.is_xla()
    # Run what building the model and optimizer (ZeRO-1's flattening of every parameter) or
    # loading a checkpoint left pending, so that step 1's graph is the steady-state step.
    runtime.step_boundary()
    logger = _Logger(
        options, metrics, parallel_state.tp_size * parallel_state.dp_size, start_step * options.global_batch * options.seq_len, device
    )
    if options.graphs_only:
        checkpoints = None  # placeholder values: nothing worth saving
    coordinator = faults.Coordinator()
    signals = faults.StopSignals()  # SIGTERM / SIGINT: stop after the step, with a checkpoint
    last_saved, current = None, start_step + 1  # current: the step being run (for error messages)
    try:
        with signals:
            coordinator.beat(start_step)
            for step in range(start_step, options.max_steps):
                current = step + 1
                lr = schedule.apply(optimizer, step)
                loss, grad_norm = train_step(model, optimizer, next(batches), device)
                done = step + 1
                logger.step_done()
                coordinator.beat(done)
                # Every rank stops after the same step: the largest signal number any rank got.
                stop = host.all_max(getattr(signals, "received", 0))
                last = done == options.max_steps
                interrupt = bool(stop) and not last  # a stop at the last step is just the end
                save = checkpoints is not None and (
                    bool(options.checkpoint_every and done % options.checkpoint_every == 0) or interrupt
                )
                # Mean loss over DP (every TP rank of a replica holds the same loss). Every step, logged
                # or not, so that every step traces the same graph; ``values`` stays alive until the
                # mark_step below, which keeps it in that graph.
                values = torch.stack([collectives.all_reduce(loss, parallel_state.dp) / parallel_state.dp_size, grad_norm.float()])
                if done % options.log_every == 0 or last or save:
                    if xla:
                        _xm().add_step_closure(logger.log, args=(values, done, lr))
                    else:
                        logger.log(values, done, lr)  # raises NonFiniteError before writing anything
                runtime.step_boundary()  # XLA: runs the closure, so a NaN raises here, before the save below
                if interrupt and parallel_state.dp.rank == 0 and parallel_state.tp.rank == 0:
                    faults.say(f"{signal.Signals(stop).name} received: stopping after step {done}"
                               + (", saving a checkpoint first" if save else " (no checkpoint directory: nothing saved)"))
                if save:
                    saved = checkpoints.save(done, *checkpoint_payload(done))
                    last_saved = done
                    logger.restart()
                if interrupt:
                    raise faults.Interrupted(stop, done, str(saved) if save else None)
            end = max(options.max_steps, start_step)
            if checkpoints is not None and last_saved != end and end > start_step:
                current = end
                checkpoints.save(end, *checkpoint_payload(end))
    except (faults.NonFiniteError, faults.Interrupted):
        _settle(xla)  # every rank raises at the same step: let them all get here
        raise
    except Exception as e:
        if faults.is_collective_failure(e):
            raise coordinator.diagnose(current, e) from e
        raise
    _settle(xla)
    return logger.records


def _settle(xla: bool) -> None:
    if xla:
        # Let every queued graph finish and every rank arrive before the caller tears the
        # process group down (otherwise: "Broken pipe" from ranks still running at exit).
        _xm().wait_device_ops()
        host.barrier()
