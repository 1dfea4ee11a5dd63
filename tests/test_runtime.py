"""init_distributed picks the backend from the device and works with and without a launcher;
the parallel state lays out TP ranks contiguously; the RNG tracker gives TP ranks their own
dropout stream and restores the outer one."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch

import neuron_ckpt as nc
from neuron_ckpt.distributed import runtime
from neuron_ckpt.distributed.random import get_rng_state, set_rng_state

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PROBE = textwrap.dedent(
    """
    import json, neuron_ckpt as nc
    rt = nc.init_distributed()
    st = nc.initialize_model_parallel(tensor_parallel_size=int(__import__("sys").argv[1]))
    print(json.dumps(dict(backend=rt.backend, rank=rt.rank, world=rt.world_size, device=str(rt.device),
                          tp=list(st.tp.ranks), dp=list(st.dp.ranks))))
    nc.destroy_distributed()
    """
)


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "PJRT_DEVICE")}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return env


def test_single_plain_process_needs_no_launcher(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    out = subprocess.run([sys.executable, str(script), "1"], env=_clean_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout.strip().splitlines()[-1])
    assert info == dict(backend="gloo", rank=0, world=1, device="cpu", tp=[0], dp=[0])


def test_under_torchrun_tp_ranks_are_contiguous(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4", str(script), "2"]
    out = subprocess.run(cmd, env=_clean_env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    # Four processes share one stdout: a line can hold two ranks' objects. Read every object.
    infos = sorted((json.loads(m) for m in re.findall(r"\{[^{}]*\}", out.stdout)), key=lambda i: i["rank"])
    assert [i["rank"] for i in infos] == [0, 1, 2, 3]
    assert all(i["world"] == 4 and i["backend"] == "gloo" for i in infos)
    assert [i["tp"] for i in infos] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [i["dp"] for i in infos] == [[0, 2], [1, 3], [0, 2], [1, 3]]


def test_backend_detection_and_override(monkeypatch):
    # torch-xla is not installed in this environment: PJRT_DEVICE alone must not pick xla.
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    assert runtime.detect_backend() == ("nccl" if torch.cuda.is_available() else "gloo")
    with pytest.raises(ValueError, match="backend must be one of"):
        runtime.init_distributed(backend="mpi")


@pytest.mark.parametrize("installed", [{"torch_neuronx"}, {"torch_neuronx", "torch_xla"}])
def test_neuron_sdk_without_torch_xla_is_refused(monkeypatch, installed):
    """A Neuron SDK >= 2.30 (torch-neuronx, no torch-xla) must not fall through to gloo and train
    on the host CPU under a trn1 label; with torch-xla beside it, xla is chosen."""
    monkeypatch.delenv("PJRT_DEVICE", raising=False)
    monkeypatch.setattr(runtime, "_module_available", lambda name: name in installed)
    if "torch_xla" in installed:
        assert runtime.detect_backend() == "xla"
        return
    with pytest.raises(RuntimeError, match=r"Neuron SDK 2\.29 or earlier .*torch-xla") as err:
        runtime.detect_backend()
    assert "[trn1,tutorial]" in str(err.value) and "backend='gloo'" in str(err.value)


def _rng_streams() -> dict:
    st = nc.initialize_model_parallel(2)
    nc.model_parallel_manual_seed(1234)
    tracker = nc.get_rng_tracker()
    outside_before = torch.rand(4)
    with tracker.fork():
        inside = torch.rand(4)
    outside_after = torch.rand(4)
    # A region replayed from a snapshot draws the same numbers (what recompute relies on).
    snap = get_rng_state()
    with tracker.fork():
        snap_tp = tracker.get_states()
        first = torch.nn.functional.dropout(torch.ones(16), 0.5)
    set_rng_state(snap)
    tracker.set_states(snap_tp)
    with tracker.fork():
        replay = torch.nn.functional.dropout(torch.ones(16), 0.5)
    torch.manual_seed(1234)
    expected_outside = torch.rand(8)
    return dict(
        tp_rank=st.tp_rank,
        inside=inside,
        outside=torch.cat([outside_before, outside_after]),
        expected_outside=expected_outside,
        replay_equal=torch.equal(first, replay),
    )


def test_rng_tracker_streams(world):
    res = world(4).run(_rng_streams)
    # Outside TP regions every rank draws the default stream seeded with `seed`, and forking
    # does not advance it.
    for r in res:
        assert torch.equal(r["outside"], r["expected_outside"])
        assert r["replay_equal"]
    # Inside: TP ranks differ; ranks with the same tp_rank (different DP replicas) agree.
    assert not torch.equal(res[0]["inside"], res[1]["inside"])
    assert torch.equal(res[0]["inside"], res[2]["inside"])
    assert torch.equal(res[1]["inside"], res[3]["inside"])
    # Seed + 2718 + tp_rank, the Megatron convention.
    g = torch.Generator().manual_seed(1234 + 2718 + 1)
    assert torch.equal(res[1]["inside"], torch.rand(4, generator=g))
