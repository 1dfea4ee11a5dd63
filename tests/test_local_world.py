"""A failure on one rank of a ``LocalWorld`` is raised promptly, never a hang.

When one rank raises, the others may be waiting in a collective it never joined: ``run`` gives
them ``grace_s`` to report, prints where each still-waiting rank is (its Python stack, to
stderr), closes the world and raises the failed rank's traceback. The suite's shared worlds are
rebuilt after that (tests/conftest.py), so one failure does not take every later test down. A
task may not tear the world down: the next would rendezvous again on the same port.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from neuron_ckpt.distributed.local import LocalWorld, WorkerError


def _rank_1_fails_before_the_all_reduce() -> int:
    if dist.get_rank() == 1:
        raise ValueError("rank 1 gave up")
    dist.all_reduce(torch.ones(1))  # rank 0 waits here for a rank that never comes
    return 0


def _rank() -> int:
    return dist.get_rank()


def test_a_rank_that_fails_alone_is_reported_within_the_grace_period(capfd):
    world = LocalWorld(2, timeout_s=300, grace_s=3)
    try:
        assert world.run(_rank) == [0, 1]
        started = time.monotonic()
        with pytest.raises(WorkerError) as err:
            world.run(_rank_1_fails_before_the_all_reduce)
        elapsed = time.monotonic() - started
    finally:
        world.close(kill=True)
    message = str(err.value)
    assert "rank 1 gave up" in message and "rank(s) [0] did not finish within 3 s" in message
    assert elapsed < 60  # the grace period and the kill, not the 300 s timeout (nor gloo's)
    assert not world.alive
    assert "_rank_1_fails_before_the_all_reduce" in capfd.readouterr().err  # where rank 0 waited


def _tear_down() -> None:
    import neuron_ckpt as nc

    nc.initialize_model_parallel(2)
    nc.destroy_distributed()


def test_a_task_that_tears_down_the_world_is_refused_and_the_world_closes():
    """A task ending with ``destroy_distributed()`` would make the next one rendezvous again on the
    same port, racing a slower rank's old store: it fails at once, naming why, and the workers stop."""
    world = LocalWorld(2, timeout_s=120, grace_s=3)
    try:
        with pytest.raises(WorkerError) as err:
            world.run(_tear_down)
        assert str(err.value).count("a LocalWorld task must leave the worker's world up") == 2  # both ranks
        for p in world._procs:
            p.join(timeout=30)
        assert not world.alive
    finally:
        world.close(kill=True)
