"""The torch-xla suite: run with ``bash scripts/test_xla.sh`` (torch 2.9 + torch-xla, XLA:CPU).

Everything here runs in ONE process at world size 1 on ``PJRT_DEVICE=CPU``: multi-rank XLA:CPU
collectives do not work, so collectives are checked as lowered HLO ops, and the numerics of
every layer are checked against the eager CPU result in the same process. Without torch-xla
(the main torch 2.13 environment) nothing here is collected.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

if importlib.util.find_spec("torch_xla") is None:
    collect_ignore_glob = ["test_*.py"]
else:
    # The test harness is the launcher here: XLA on the host CPU, unless the caller chose a device.
    os.environ.setdefault("PJRT_DEVICE", "CPU")


@pytest.fixture(scope="session")
def xla():
    """``neuron_ckpt.init_distributed()`` on XLA, tensor parallel 1; yields the Runtime."""
    import neuron_ckpt as nc

    rt = nc.init_distributed()
    nc.initialize_model_parallel(1)
    yield rt
    nc.destroy_distributed()
