"""Stopping a run early without losing work: non-finite values, stop signals, a rank that stops answering.

:func:`neuron_ckpt.train.fit` uses all three; the tutorial's ``train.py`` turns the exceptions
into exit codes.

**Non-finite loss or gradient norm** (:class:`NonFiniteError`). The run stops before anything is
written for that step: no metrics line, no checkpoint, so ``latest`` stays on the last checkpoint
whose step was finite, and pruning never deletes a good checkpoint to make room for a NaN one.
The values are checked where they reach the host anyway: on every logged step (``log_every``),
the last step and every checkpoint step (checkpoint steps are logged). On XLA reading them is the
step's one device-to-host transfer, so unlogged steps are not checked: a NaN that appears on an
unlogged step is caught at the next logged or checkpoint step, still before anything is written
(NaN weights stay NaN, so that step's loss is NaN too); the error names the last step that was
checked and finite. The loss is the DP mean and the gradient norm the global one, both reduced
in the step itself, so every rank reads the same values and raises at the same step: no rank is
left waiting in a collective.

**SIGTERM / SIGINT** (:class:`StopSignals`, :class:`Interrupted`). SIGTERM is what SLURM sends
before preempting a job or at its time limit (and ``scancel``, and torchrun passing its own
SIGTERM on); SIGINT is Ctrl-C. Either one asks the run to stop: the current step is finished,
all ranks agree to stop after the same step (each step, a MAX all-reduce of the signal number on
the host group, :func:`neuron_ckpt.distributed.host.all_max`: no device graph on XLA, no device
sync on nccl), a checkpoint of that step is written when there is a checkpoint manager, and
:class:`Interrupted` is raised. Its ``exit_code`` is ``128 + signal number`` (143 for SIGTERM,
130 for SIGINT): what a shell reports for a process ended by that signal, so a scheduler or
script sees an interrupted job, not a finished one.
``--resume latest`` continues from the checkpoint.

The handlers are installed only when :func:`fit` runs in the main thread, and the previous ones
are restored when it returns or raises. A signal that is ignored when ``fit`` starts (``SIG_IGN``:
``nohup``, a shell's background job) stays ignored. A second SIGINT aborts at once as without
these handlers (``KeyboardInterrupt``) unless it comes within :data:`REPEAT_S` of the first:
torchrun passes the Ctrl-C it gets on to its workers, which the terminal already interrupted, and
that copy must not abort the checkpoint. More SIGTERMs are the same request again. Launchers kill
workers that have not exited a while after passing a signal on: torchrun after
``--shutdown-timeout`` (30 s by default: raise it to cover a step and a checkpoint), SLURM after
``KillWait`` (30 s by default; ``sbatch --signal=TERM@120`` asks for a SIGTERM 120 s before the
time limit).

**A rank that stops answering** (:class:`Coordinator`, :class:`CollectiveTimeoutError`). A frozen,
dead or stuck rank leaves the others waiting in a collective until the collective timeout
(``init_distributed(timeout_s=...)``, ``--collective-timeout``). Each rank keeps the last step it
finished in the default store (one small store write per step). When a collective fails (times
out, or a peer's connection closes), the rank records in the store that it saw the failure, waits
up to ``grace_s`` for every rank to do the same (ranks waiting in collectives time out within
about a step of each other), and raises :class:`CollectiveTimeoutError` naming the ranks that did
not: they stopped answering. The error gives each one's last finished step. Detection takes the
collective timeout plus ``grace_s`` (5% of the timeout, between 3 and 60 s).
"""

from __future__ import annotations

import datetime
import math
import os
import re
import signal
import sys
import threading
import time
from typing import Any

import torch.distributed as dist

from ..distributed import runtime

REPEAT_S = 1.0
"""A second SIGINT within this many seconds of the first is taken for the same Ctrl-C passed on
by a launcher, not as a request to abort."""

_RUNS = 0  # fit() calls in this process: every rank counts the same, so store keys match per run


class NonFiniteError(RuntimeError):
    """The loss or the gradient norm of ``step`` is NaN or infinite; nothing was written for it."""

    def __init__(self, step: int, loss: float, grad_norm: float, last_finite: int | None = None):
        self.step, self.loss, self.grad_norm, self.last_finite = step, loss, grad_norm, last_finite
        bad = " and ".join(n for n, v in (("loss", loss), ("gradient norm", grad_norm)) if not math.isfinite(v))
        since = (
            f" The last step checked before it, step {last_finite}, was finite (values reach the host on "
            "logged and checkpoint steps only: it may have started in between)."
            if last_finite is not None and last_finite < step - 1 else ""
        )  # fmt: skip
        super().__init__(
            f"step {step}: non-finite {bad} (loss {loss}, gradient norm {grad_norm}); stopped before "
            f"writing metrics or a checkpoint for this step.{since} The latest checkpoint, if any, is "
            "from a finite step: resume from it with a lower --lr, longer warmup or gradient clipping."
        )

    def __reduce__(self):
        return (NonFiniteError, (self.step, self.loss, self.grad_norm, self.last_finite))


class Interrupted(RuntimeError):
    """A stop signal reached the run: every rank finished ``step`` (and saved ``checkpoint``)."""

    def __init__(self, signum: int, step: int, checkpoint: str | None = None):
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        self.exit_code = 128 + signum
        saved = (f"checkpoint {checkpoint} written; --resume latest continues from it" if checkpoint
                 else "no checkpoint written (no checkpoint directory)")  # fmt: skip
        super().__init__(
            f"{signal.Signals(signum).name} received: stopped after step {step}; {saved} "
            f"(exit code {self.exit_code} = 128 + {signum})"
        )

    def __reduce__(self):
        return (Interrupted, (self.signum, self.step, self.checkpoint))


class CollectiveTimeoutError(RuntimeError):
    """A collective failed on this rank; ``silent`` are the ranks that did not report the failure
    (they stopped answering), ``last_steps`` the last step each of them finished (None: unknown)."""

    def __init__(self, message: str, step: int, silent: list[int] | None = None, last_steps: dict | None = None):
        super().__init__(message)
        self.step, self.silent, self.last_steps = step, silent, last_steps or {}

    def __reduce__(self):
        return (CollectiveTimeoutError, (str(self), self.step, self.silent, self.last_steps))


def check_finite(step: int, loss: float, grad_norm: float, last_finite: int | None = None) -> None:
    """Raise :class:`NonFiniteError` unless both values are finite."""
    if not (math.isfinite(loss) and math.isfinite(grad_norm)):
        raise NonFiniteError(step, loss, grad_norm, last_finite)


def is_collective_failure(error: BaseException) -> bool:
    """A collective timed out or lost a peer (gloo's errors are RuntimeErrors; newer ones DistError)."""
    if isinstance(error, (NonFiniteError, Interrupted, CollectiveTimeoutError)):
        return False
    if isinstance(error, getattr(dist, "DistError", ())):
        return True
    text = str(error)
    needles = (
        "Timed out",
        "timed out",
        "Application timeout",
        "Connection closed by peer",
        "Connection reset by peer",
        "Broken pipe",
    )  # the last ones: a peer that gave up first
    return isinstance(error, RuntimeError) and any(n in text for n in needles)


class StopSignals:
    """Context manager: SIGTERM / SIGINT set :attr:`received` (the signal number) instead of
    ending the process. Installs nothing outside the main thread or for ignored signals; restores
    the previous handlers on exit. A second SIGINT more than :data:`REPEAT_S` after the first
    runs the previous handler (``KeyboardInterrupt`` by default)."""

    def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)):
        self.signals = signals
        self.received = 0
        self._first_at = 0.0
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is not threading.main_thread():
            return self  # signal.signal works in the main thread only; this fit cannot be signalled
        for s in self.signals:
            previous = signal.getsignal(s)
            if previous is signal.SIG_IGN or previous is None:  # ignored, or a handler not set from Python
                continue
            self._previous[s] = previous
            signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        self.restore()

    @property
    def installed(self) -> list[int]:
        return list(self._previous)

    def restore(self) -> None:
        for s, previous in self._previous.items():
            signal.signal(s, previous)
        self._previous.clear()

    def _handle(self, signum: int, frame) -> None:
        # No printing here: a handler that writes to a stream the main thread is writing to
        # raises "reentrant call". fit() reports the stop.
        now = time.monotonic()
        if not self.received:
            self.received, self._first_at = signum, now
            return
        if signum == signal.SIGINT and now - self._first_at > REPEAT_S:
            previous = self._previous.get(signum, signal.default_int_handler)
            self.restore()
            if callable(previous):
                previous(signum, frame)  # Python's default: KeyboardInterrupt, here and now
            else:  # SIG_DFL: end the process as that signal would have
                os.kill(os.getpid(), signum)


class Coordinator:
    """Who stopped answering when a collective of one :func:`fit` fails: each rank's progress, kept
    in the default store.

    Without an initialised process group every method is local (nothing to compare with).
    """

    def __init__(self, timeout_s: float | None = None):
        global _RUNS
        self.active = dist.is_available() and dist.is_initialized()
        self.rank, self.world_size = (dist.get_rank(), dist.get_world_size()) if self.active else (0, 1)
        self.store = None
        if not self.active:
            self.timeout_s, self.grace_s = timeout_s, 0.0
            return
        _RUNS += 1
        self.prefix = f"neuron_ckpt/fit{_RUNS}"
        try:
            self.store = dist.distributed_c10d._get_default_store()
        except Exception:  # noqa: BLE001  no store: no heartbeats, the rest works
            self.store = None
        if timeout_s is None:
            timeout_s = runtime.collective_timeout_s()
        if timeout_s is None and self.store is not None:
            # The store shares init's timeout. Store.timeout / .append exist in torch, not in its stubs.
            timeout_s = self.store.timeout.total_seconds()  # type: ignore[attr-defined]  # see above
        self.timeout_s = timeout_s
        self.grace_s = min(60.0, max(3.0, 0.05 * (timeout_s or 0.0)))

    def beat(self, step: int) -> None:
        """Record that this rank finished ``step`` (a store write; skipped at world size 1)."""
        if self.store is not None and self.world_size > 1:
            self.store.set(f"{self.prefix}/step/{self.rank}", str(step))

    def diagnose(self, step: int, error: BaseException) -> CollectiveTimeoutError:
        """After a collective failed in ``step`` on this rank: which ranks stopped answering."""
        text = str(error).strip()
        first = (
            re.sub(r"^\[[^\]]*\]\s*", "", text.splitlines()[0]) if text else type(error).__name__
        )  # gloo's [file:line]
        timeout = f"; collective timeout {self.timeout_s:g} s" if self.timeout_s else ""
        head = f"rank {self.rank}: a collective in step {step} failed ({first}{timeout})"
        if self.store is None or self.world_size == 1:
            return CollectiveTimeoutError(head, step)
        store, key = self.store, f"{self.prefix}/failed"
        previous_timeout = store.timeout  # type: ignore[attr-defined]  # in torch, not in its stubs
        silent, last = None, {}
        try:
            store.set_timeout(datetime.timedelta(seconds=max(5.0, self.grace_s)))
            store.append(key, f"{self.rank},")  # type: ignore[attr-defined]  # in torch, not in its stubs
            deadline = time.monotonic() + self.grace_s
            while True:
                reported = {int(r) for r in store.get(key).decode().split(",") if r}
                if len(reported) >= self.world_size or time.monotonic() >= deadline:
                    break
                time.sleep(0.2)
            silent = sorted(set(range(self.world_size)) - reported)
            for r in silent[:16]:
                k = f"{self.prefix}/step/{r}"
                last[r] = int(store.get(k)) if store.check([k]) else None
        except Exception as e:  # noqa: BLE001  the store lives in one process, which may be the frozen one
            addr = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
            return CollectiveTimeoutError(
                f"{head}. The store at {addr} did not answer either ({type(e).__name__}: {e}): the process "
                "hosting it (rank 0, or torchrun's agent under torchrun) may be the one that stopped.",
                step,
            )
        finally:
            try:
                store.set_timeout(previous_timeout)
            except Exception:  # noqa: BLE001  best effort: the store may be the part that stopped
                pass
        if not silent:
            return CollectiveTimeoutError(
                f"{head}. Every rank reported a failed collective, none stopped answering: see each "
                "rank's error (network, or one rank's own error).",
                step, [], {},
            )  # fmt: skip

        def describe(r: int) -> str:
            return (
                f"rank {r} (last finished step {last[r]})"
                if last.get(r) is not None
                else f"rank {r} (no step finished)"
            )

        named = ", ".join(describe(r) for r in silent[:16]) + (
            f" and {len(silent) - 16} more" if len(silent) > 16 else ""
        )
        return CollectiveTimeoutError(
            f"{head}. Not answering: {named}; {len(silent)} of {self.world_size} ranks did not report the "
            f"failure within {self.grace_s:g} s: frozen, dead or stuck outside a collective (its log, "
            "or py-spy dump --pid on its host, tells which).",
            step, silent, last,
        )  # fmt: skip


def say(message: str) -> None:
    """One line to stderr (rank 0's is the one a log shows)."""
    print(message, file=sys.stderr, flush=True)
