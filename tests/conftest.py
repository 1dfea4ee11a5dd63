"""Shared fixtures: one pool of gloo worker processes per world size, reused by every test.

A test runs a module-level function on all ranks with ``world(n).run(fn, *args)``; the function
calls ``nc.initialize_model_parallel(...)`` itself (state is reset after every run).
"""

from __future__ import annotations

import pytest

from neuron_ckpt.distributed.local import LocalWorld

_WORLDS: dict[int, LocalWorld] = {}


@pytest.fixture(scope="session")
def world():
    def get(n: int) -> LocalWorld:
        if n not in _WORLDS:
            _WORLDS[n] = LocalWorld(n, timeout_s=600)
        return _WORLDS[n]

    yield get
    for w in _WORLDS.values():
        w.close()
    _WORLDS.clear()
