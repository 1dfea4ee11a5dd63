"""Ranks deciding together on the host: barriers, flags and small values, never a device graph.

Every "all ranks decide together" step of the package goes through here: the checkpoint
manager's writer rounds and its failure agreement, the stop-signal agreement of each training
step, the start-up path checks, the tutorial's one-scan-per-host corpus opening.

The group they run over is chosen in one place, ``_group``: the runtime's ``host_group`` (the
gloo group :func:`~.runtime.init_distributed` makes when the default group is not gloo: XLA,
where ``xm.rendezvous`` would run a small device graph and read it back, and nccl / xccl /
TorchNeuron's, where a flag on the device would sync it every step), else the default group,
which is then gloo itself. torch.distributed initialised by someone else (no runtime): its
default group, on the accelerator when its backend is not gloo.

Without an initialised process group every function is local: one rank agrees with itself.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from . import runtime


def _active() -> bool:
    """True when torch.distributed is initialised (the functions here are collectives then)."""
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """This process's global rank (0 without torch.distributed)."""
    return dist.get_rank() if _active() else 0


def _group() -> tuple[dist.ProcessGroup | None, torch.device]:
    """The group host-side collectives run over (None: the default group) and the device of the
    tensors they reduce: the CPU, except on a foreign default group that is not gloo."""
    try:
        rt = runtime.get_runtime()
    except RuntimeError:  # torch.distributed initialised by someone else
        acc = runtime.accelerator_type()
        if acc is None or dist.get_backend() == "gloo":
            return None, torch.device("cpu")
        return None, torch.device(acc, torch.accelerator.current_device_index())
    return rt.host_group, torch.device("cpu")


def barrier() -> None:
    """Wait for every rank, on the host group."""
    if _active():
        dist.barrier(group=_group()[0])


def all_max(value: int) -> int:
    """The max of ``value`` over all ranks."""
    if not _active():
        return value
    pg, device = _group()
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=pg)
    return int(t.item())


def gather(value: Any) -> list[Any]:
    """Every rank's ``value`` (small and picklable), in rank order, on every rank."""
    if not _active() or dist.get_world_size() == 1:
        return [value]
    pg = _group()[0]
    out: list[Any] = [None] * dist.get_world_size(pg)
    dist.all_gather_object(out, value, group=pg)
    return out


def agree(error: BaseException | None, what: str) -> None:
    """Raise ``error`` here, or a RuntimeError if ``what`` failed on another rank.

    Each rank passes its own outcome (None: it succeeded); every rank then raises or none does,
    so no rank is left waiting in a later collective for one that failed."""
    failed = all_max(1 if error is not None else 0)
    if error is not None:
        raise error
    if failed:
        raise RuntimeError(f"{what} failed on another rank (its error is in that rank's output)")


def first_problem(problem: str | None) -> str | None:
    """The first rank's non-None ``problem``, on every rank (another rank's says which rank found
    it), so all raise the same error and none waits."""
    for r, p in enumerate(gather(problem)):
        if p is not None:
            return p if r == rank() else f"{p} (found on rank {r})"
    return None
