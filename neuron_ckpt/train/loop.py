"""The pretraining loop: gradient accumulation, optimizer step, LR schedule, metrics, checkpoints.

Built objects in, nothing constructed here: the caller (e.g. ``tutorials/llama2_7b_tp_zero1/
train.py``) builds the model, the optimizer (``Zero1Optimizer``) and the batch order
(``DataParallelBatches``) into a :class:`~.state.TrainState`, resumes it if asked, and passes it
to :func:`fit` with the schedule, the :class:`~.checkpoint.CheckpointManager` and the
:class:`SavePolicy` that says when to save.

One optimizer step = ``grad_accum`` micro-batches on each DP rank, each loss scaled by
``1/grad_accum`` before backward, so the accumulated gradient is the mean over the rank's
micro-batches; the optimizer then averages over DP. Every block has the same number of targets
(``seq_len - 1``), so this equals the token mean over the global batch. Under context parallelism
the CP ranks of a replica train on the same micro-batches, each on its share of the sequence; the
mean over DP x CP (the optimizer's and the logged loss's) is still that token mean, because each
CP rank's loss is scaled for it (``LlamaForCausalLM``). A pipeline-parallel model
(``LlamaPipeline``) runs the same micro-batches as its schedule's micro-batches, with the same
loss, and reports the last stage's loss on every rank (:mod:`.pipeline_step`).

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
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch

from ..distributed import collectives, host, runtime
from ..distributed.parallel_state import ParallelState, get_parallel_state
from . import faults
from .checkpoint import CheckpointManager
from .metrics import MetricsWriter, StepRecord, device_peak_bytes, make_record
from .pipeline_step import is_pipeline, pipeline_train_step
from .schedule import LRSchedule
from .state import TrainState


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
    grad_norm = cast(torch.Tensor, optimizer.step())  # a Zero1Optimizer's: the gradient norm
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


@dataclass(frozen=True)
class SavePolicy:
    """Answers "save now?" after each optimizer step (torchtitan's ``interval`` / ``last_step``).

    The last step of a run is always saved, and so is the step a SIGTERM / SIGINT stopped after:
    a run never ends with its work unsaved when it has somewhere to save it.
    """

    every: int = 0
    """Also save every ``every`` steps (0: only at the end and on a stop)."""

    def __post_init__(self) -> None:
        if not (isinstance(self.every, int) and not isinstance(self.every, bool) and self.every >= 0):
            raise ValueError(f"SavePolicy.every must be an int >= 0 (0: only at the end), got {self.every!r}")

    def save_now(self, step: int, last: bool, stopping: bool) -> bool:
        """``step``: optimizer steps done; ``last``: the run's final step; ``stopping``: every rank
        agreed to stop after this step (a signal)."""
        return last or stopping or (self.every > 0 and step % self.every == 0)


class _Logger:
    """Turns (loss, grad norm) tensors into :class:`StepRecord` s, timing the logged intervals."""

    def __init__(
        self,
        options: FitOptions,
        metrics: MetricsWriter,
        world: int,
        tokens_seen: int,
        device: torch.device | None = None,
    ):
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
    state: TrainState,
    schedule: LRSchedule,
    options: FitOptions,
    metrics: MetricsWriter,
    checkpoints: CheckpointManager | None = None,
    policy: SavePolicy = SavePolicy(),
    meta: dict[str, Any] | None = None,
    parallel_state: ParallelState | None = None,
    run: torch.nn.Module | None = None,
) -> list[StepRecord]:
    """Train ``state`` from ``state.step`` to ``options.max_steps``; returns the logged records.

    ``state.batches`` is iterated from where it stands (a resumed state: where it was saved);
    ``state.step`` counts the optimizer steps done. After each step ``policy`` says whether to
    save ``state`` to ``checkpoints`` (``meta`` goes to meta.json beside it); without
    ``checkpoints`` nothing is saved. ``run``: what computes the loss, if not ``state.model``
    itself (``torch.compile(state.model)``: the state keeps the model's own names and keys).

    Raises :class:`~.faults.NonFiniteError` (a NaN / Inf loss or gradient norm, on every rank at
    the same step, nothing written for it), :class:`~.faults.Interrupted` (SIGTERM / SIGINT:
    every rank stopped after the same step, checkpointed when ``checkpoints`` is given) and
    :class:`~.faults.CollectiveTimeoutError` (a collective failed; names the silent ranks).
    """
    ps = parallel_state or get_parallel_state()
    model = run if run is not None else state.model
    optimizer, batches, device = state.optimizer, iter(state.batches), runtime.get_runtime().device
    model.train()
    xla = runtime.is_xla()
    # Run what building the model and optimizer (ZeRO-1's flattening of every parameter) or
    # loading a checkpoint left pending, so that step 1's graph is the steady-state step.
    runtime.step_boundary()
    logger = _Logger(
        options,
        metrics,
        ps.tp_size * ps.dp_cp.size * ps.pp_size,
        state.step * options.global_batch * options.seq_len,
        device,
    )
    if options.graphs_only:
        checkpoints = None  # placeholder values: nothing worth saving
    coordinator = faults.Coordinator()
    signals = faults.StopSignals()  # SIGTERM / SIGINT: stop after the step, with a checkpoint
    current = state.step + 1
    try:
        with signals:
            coordinator.beat(state.step)
            while state.step < options.max_steps:
                current = state.step + 1  # the step being run, for error messages (its save included)
                lr = schedule.apply(optimizer, state.step)
                run_step: Callable[..., tuple[torch.Tensor, torch.Tensor]]
                run_step = pipeline_train_step if is_pipeline(model) else train_step
                loss, grad_norm = run_step(model, optimizer, next(batches), device)  # type: ignore[arg-type]  # torch types a module's attributes as Tensor | Module
                state.step += 1
                done = state.step
                logger.step_done()
                coordinator.beat(done)
                # Every rank stops after the same step: the largest signal number any rank got.
                stop = host.all_max(getattr(signals, "received", 0))
                last = done == options.max_steps
                interrupt = bool(stop) and not last  # a stop at the last step is just the end
                save = checkpoints is not None and policy.save_now(done, last, interrupt)
                # Mean loss over DP x CP (every TP rank of a replica holds the same loss; the CP ranks'
                # mean is the sequence's token mean). Every step, logged or not, so that every step
                # traces the same graph; ``values`` stays alive until the mark_step below, which keeps
                # it in that graph.
                values = torch.stack([collectives.all_reduce(loss, ps.dp_cp) / ps.dp_cp.size, grad_norm.float()])
                if done % options.log_every == 0 or last or save:
                    if xla:
                        _xm().add_step_closure(logger.log, args=(values, done, lr))
                    else:
                        logger.log(values, done, lr)  # raises NonFiniteError before writing anything
                runtime.step_boundary()  # XLA: runs the closure, so a NaN raises here, before the save below
                if interrupt and ps.dp_cp.rank == 0 and ps.tp.rank == 0:
                    faults.say(
                        f"{signal.Signals(stop).name} received: stopping after step {done}"
                        + (", saving a checkpoint first" if save else " (no checkpoint directory: nothing saved)")
                    )
                saved = state.save(checkpoints, meta or {}) if save and checkpoints is not None else None
                if save:
                    logger.restart()
                if interrupt:
                    raise faults.Interrupted(stop, done, str(saved) if saved else None)
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
