"""Run a function on N local processes (one host, gloo by default): tests, benchmarks, ``--measure``.

``LocalWorld`` starts the processes once and runs many functions on them, which keeps a test
suite of many multi-rank checks fast on a small machine::

    with LocalWorld(world_size=2) as world:
        results = world.run(fn, arg)     # fn(arg) on every rank; list of per-rank results

``fn`` must be picklable (a module-level function). An exception on any rank is raised here
with that rank's traceback; the other ranks get ``grace_s`` to report (one may wait in a
collective the failed rank never joined), then the world is closed, so a failure never hangs.
Torchrun is the launcher for real jobs; this is for one host.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import signal
import time
import traceback
from collections.abc import Callable
from typing import Any

from .runtime import free_port


def _worker(rank: int, world_size: int, port: int, backend: str, threads: int, tasks, results) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    import faulthandler

    import torch

    faulthandler.register(signal.SIGUSR1)  # the parent asks a rank that does not finish where it waits
    torch.set_num_threads(threads)
    from . import parallel_state, random, runtime, teardown

    try:
        runtime.init_distributed(backend=backend, timeout_s=300)
    except Exception:  # noqa: BLE001  any failure to join goes to the parent, which reports it
        results.put((rank, False, traceback.format_exc()))
        return
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args, kwargs = task
        try:
            out = (rank, True, fn(*args, **kwargs))
        except BaseException:  # noqa: BLE001  every failure of a task goes to the parent; the worker serves the next
            out = (rank, False, traceback.format_exc())
        finally:
            parallel_state.destroy_model_parallel()
            random.get_rng_tracker().reset()
        if not torch.distributed.is_initialized():
            # The next task would rendezvous again on the same port while a slower rank may still
            # hold the old store and gloo context: a hang that only load reveals. Refuse it, and
            # stop this worker (the world is no longer whole; LocalWorld.alive says so).
            results.put((rank, False, f"{getattr(fn, '__name__', fn)} tore down torch.distributed ({TORN_DOWN})"))
            return
        results.put(out)
    teardown.destroy_distributed()


TORN_DOWN = (
    "a LocalWorld task must leave the worker's world up: it is reused by the next task; "
    "call destroy_distributed() in scripts and single-process tests, not in a task"
)


class WorkerError(RuntimeError):
    """A function raised on one or more ranks of a :class:`LocalWorld`."""


class LocalWorld:
    """``world_size`` spawned processes with torch.distributed initialised, reused across runs."""

    def __init__(
        self, world_size: int, backend: str = "gloo", timeout_s: float = 600.0, threads: int = 1, grace_s: float = 60.0
    ):
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.grace_s = grace_s
        ctx = mp.get_context("spawn")
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        self._results = ctx.Queue()
        port = free_port()
        self._procs = [
            ctx.Process(
                target=_worker,
                args=(r, world_size, port, backend, threads, self._tasks[r], self._results),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in self._procs:
            p.start()

    def run(self, fn: Callable[..., Any], *args, **kwargs) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the per-rank results in rank order."""
        for q in self._tasks:
            q.put((fn, args, kwargs))
        name = getattr(fn, "__name__", fn)
        outs: dict[int, Any] = {}
        errors: dict[int, str] = {}
        for _ in range(self.world_size):
            # Once a rank has failed, the others may wait in a collective it never joined: give
            # them a grace period to report, then close the world and raise what failed.
            wait = min(self.timeout_s, self.grace_s) if errors else self.timeout_s
            try:
                rank, ok, value = self._results.get(timeout=wait)
            except queue.Empty:
                waiting = sorted(set(range(self.world_size)) - set(outs) - set(errors))
                self._dump_stacks(waiting)
                self.close(kill=True)
                if errors:
                    raise WorkerError(
                        f"{name} failed, and rank(s) {waiting} did not finish within {wait} s after it "
                        "(waiting in a collective the failed rank left?); world closed:\n" + "\n".join(errors.values())
                    ) from None
                raise WorkerError(f"{name} did not finish within {wait} s on rank(s) {waiting}; world closed") from None
            if ok:
                outs[rank] = value
            else:
                errors[rank] = f"--- rank {rank} ---\n{value}"
        if errors:
            raise WorkerError(f"{name} failed:\n" + "\n".join(errors[r] for r in sorted(errors)))
        return [outs[r] for r in range(self.world_size)]

    def _dump_stacks(self, ranks: list[int]) -> None:
        """Each of ``ranks`` prints its Python stack to stderr (where it waits), before the kill."""
        for r in ranks:
            pid = self._procs[r].pid
            if self._procs[r].is_alive() and pid is not None:
                os.kill(pid, signal.SIGUSR1)
        time.sleep(1.0)

    @property
    def alive(self) -> bool:
        """Every worker is running (False after :meth:`close`, or after a run that timed out)."""
        return all(p.is_alive() for p in self._procs)

    def close(self, kill: bool = False) -> None:
        for p, q in zip(self._procs, self._tasks):
            if p.is_alive() and not kill:
                q.put(None)
        for p in self._procs:
            p.join(timeout=0 if kill else 30)
            if p.is_alive():
                p.kill()
                p.join()

    def __enter__(self) -> LocalWorld:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def run_local(fn: Callable[..., Any], world_size: int, *args, backend: str = "gloo", **kwargs) -> list[Any]:
    """Start ``world_size`` processes, run ``fn`` once on each, shut them down; per-rank results."""
    with LocalWorld(world_size, backend=backend) as world:
        return world.run(fn, *args, **kwargs)
