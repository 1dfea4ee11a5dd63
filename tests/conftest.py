"""Shared fixtures: one pool of gloo worker processes per world size, reused by every test.

A test runs a module-level function on all ranks with ``world(n).run(fn, *args)``; the function
calls ``nc.initialize_model_parallel(...)`` itself (state is reset after every run).

A test that starts torch.distributed in this process (an in-process measurement at TP 1 calls
``initialize_model_parallel``, which joins a world of one) has it torn down after it, so every
test starts without a default process group (tests/test_pipeline_train.py checks that a refusal
comes before torch.distributed starts).
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

import neuron_ckpt as nc
from neuron_ckpt.distributed.local import LocalWorld

_WORLDS: dict[int, LocalWorld] = {}


@pytest.fixture(scope="session")
def world():
    def get(n: int) -> LocalWorld:
        if n not in _WORLDS or not _WORLDS[n].alive:  # a run that timed out closed its world
            _WORLDS[n] = LocalWorld(n, timeout_s=600)
        return _WORLDS[n]

    yield get
    for w in _WORLDS.values():
        w.close()
    _WORLDS.clear()


@pytest.fixture(autouse=True)
def no_process_group_left_behind():
    yield
    if dist.is_initialized():
        nc.destroy_distributed()
