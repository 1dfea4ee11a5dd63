"""Nothing lost when a run goes wrong: a NaN stops it before anything is written, SIGTERM ends it
with a checkpoint every rank agrees on, and a frozen rank is named once the collective timeout
has passed (neuron_ckpt.train.faults, through the tutorial's train.py).

The injected-NaN check runs ``train.main`` on the suite's 4-rank LocalWorld (TP 2 x DP 2): every
rank raises at the same step, so the workers stay usable. The other end-to-end checks run
``train.py`` as real processes (one per rank, env:// rendezvous), so the exit codes are the real
ones and a signalled or stopped process cannot take a shared worker pool down with it.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from neuron_ckpt.distributed.runtime import free_port
from neuron_ckpt.train import CheckpointManager, NonFiniteError, faults
from neuron_ckpt.train.metrics import read_metrics

from .helpers import patched
from .tutorial_run import TUTORIAL, tiny_run_files, train_module

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def run_files(tmp_path_factory) -> tuple[Path, list[str]]:
    root = tmp_path_factory.mktemp("faults")
    common = tiny_run_files(root) + [
        "--global-batch-size", "8", "--max-steps", "12", "--warmup-steps", "1", "--lr", "1e-2",
    ]  # fmt: skip
    return root, common


def _rows(path: Path) -> list[dict]:
    """The metrics file's step records (not its header or summary)."""
    return read_metrics(path)["step"] if path.exists() else []


class _Job:
    """``script argv`` on ``n`` processes (RANK 0..n-1, env:// rendezvous), output in logs."""

    def __init__(self, tmp: Path, n: int, script: Path, argv: list[str], env: dict | None = None):
        port, self.logs, self.procs = free_port(), [], []
        for r in range(n):
            e = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(r),
                 "WORLD_SIZE": str(n), "LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": str(n), "OMP_NUM_THREADS": "1",
                 "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
                 **(env or {})}  # fmt: skip
            e.pop("PJRT_DEVICE", None)
            self.logs.append(tmp / f"{script.stem}_{time.monotonic_ns()}_rank{r}.log")
            with open(self.logs[-1], "w") as log:
                self.procs.append(
                    subprocess.Popen([sys.executable, str(script), *argv], env=e, stdout=log, stderr=subprocess.STDOUT)
                )

    def wait(self, timeout: float) -> list[int]:
        deadline = time.monotonic() + timeout
        try:
            return [p.wait(timeout=max(0.1, deadline - time.monotonic())) for p in self.procs]
        finally:
            self.kill()

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()

    def output(self, rank: int) -> str:
        return self.logs[rank].read_text()


def _wait_for(predicate, timeout: float, what: str, job: _Job) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline or any(p.poll() is not None for p in job.procs):
            job.kill()
            pytest.fail(f"{what} did not happen; rank 0 output:\n{job.output(0)[-3000:]}")
        time.sleep(0.05)


# ---- NaN / Inf ----------------------------------------------------------------------------------


def _train_nan(argv: list[str], poison_rank: int | None = None, poison_step: int = 0) -> dict:
    """Worker: train.main(argv); a NonFiniteError comes back as a dict. ``poison_rank`` sets one
    weight of that rank's MLP to NaN before step ``poison_step`` (NaN weights stay NaN)."""
    import torch.distributed as dist

    from neuron_ckpt.train import loop

    real = loop.train_step
    calls = []

    def poisoned(model, optimizer, micro_batches, device):
        calls.append(1)
        if dist.get_rank() == poison_rank and len(calls) == poison_step:
            with torch.no_grad():
                model.get_parameter("layers.0.mlp.down_proj.weight").view(-1)[0] = float("nan")
        return real(model, optimizer, micro_batches, device)

    with patched(loop, "train_step", poisoned):
        try:
            train_module().main(argv)
        except NonFiniteError as e:
            return {
                "step": e.step,
                "loss": e.loss,
                "grad_norm": e.grad_norm,
                "last_finite": e.last_finite,
                "message": str(e),
            }
    return {}


def test_huge_lr_stops_before_writing_and_keeps_the_good_checkpoint(run_files, tmp_path):
    """train.py on 2 processes (DP 2): four good steps (checkpoint at 4), then --resume latest
    --lr 1e9: the weights blow up and a later step's gradient norm is NaN (the warmup delays it a
    few steps). Both ranks stop at that step with exit code 1 and the step named; no metrics line
    or checkpoint for it, even when it is the checkpoint step 8; ``latest`` is still step 4,
    whose weights are finite."""
    root, common = run_files
    ckpt, m = tmp_path / "ckpt", tmp_path / "m.jsonl"
    argv = common + ["--checkpoint-dir", str(ckpt), "--checkpoint-every", "4", "--metrics-file", str(m)]
    first = _Job(tmp_path, 2, TUTORIAL / "train.py", argv + ["--stop-at-step", "4"])
    assert first.wait(60) == [0, 0], first.output(0)[-2000:]
    job = _Job(tmp_path, 2, TUTORIAL / "train.py", argv + ["--resume", "latest", "--lr", "1e9"])
    codes = job.wait(60)
    out = job.output(0)
    assert codes == [1, 1], (codes, out[-2000:], job.output(1)[-2000:])
    found = re.search(r"^NonFiniteError: step (\d+): non-finite (.*)$", out, re.M)
    assert found and "nan" in found.group(2), out[-2000:]
    bad = int(found.group(1))
    assert 5 <= bad <= 8, out[-2000:]  # the next checkpoint (8) is not written either
    rows = _rows(m)
    assert [r["step"] for r in rows] == list(range(1, bad))  # nothing logged for the bad step
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in rows)
    assert (ckpt / "latest").read_text() == "step_00000004"
    assert [p.name for p in CheckpointManager(ckpt).complete()] == ["step_00000004"]
    from safetensors.torch import load_file

    for f in (ckpt / "step_00000004").glob("model_*.safetensors"):
        assert all(torch.isfinite(t).all() for t in load_file(f).values()), f
    print(f"\n--lr 1e9 after step 4: stopped at step {bad}: {found.group(0)[:160]}")


def test_nan_on_one_rank_in_an_unlogged_step_stops_every_rank_at_the_next_logged_step(world, run_files):
    """A NaN weight on rank 3 only, before step 5; logging every 3 steps, checkpoints every 4.
    The DP-mean loss and the global norm carry it to every rank: all four raise at step 6 (the next
    logged step), naming step 4 as the last finite one checked; nothing written after step 4."""
    root, common = run_files
    ckpt, m = root / "inject", root / "inject.jsonl"
    argv = common + ["--tp", "2", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "4", "--log-every", "3",
                     "--metrics-file", str(m)]  # fmt: skip
    errors = world(4).run(_train_nan, argv, 3, 5)
    assert [e["step"] for e in errors] == [6] * 4, errors
    assert [e["last_finite"] for e in errors] == [4] * 4
    assert "step 4, was finite" in errors[0]["message"]
    assert [r["step"] for r in _rows(m)] == [3, 4]
    assert (ckpt / "latest").read_text() == "step_00000004"


def test_check_finite_names_what_is_not_finite():
    faults.check_finite(3, 2.5, 1.0)
    with pytest.raises(NonFiniteError, match=r"step 7: non-finite loss \(loss inf, gradient norm 0.5\)"):
        faults.check_finite(7, float("inf"), 0.5)
    with pytest.raises(NonFiniteError, match="non-finite loss and gradient norm"):
        faults.check_finite(7, float("nan"), float("nan"))


# ---- signal handlers (in this process, main thread) ---------------------------------------------


def test_stop_signals_record_restore_and_a_late_second_sigint_aborts(monkeypatch):
    # A background job of a shell starts with SIGINT ignored, and StopSignals then leaves SIGINT
    # alone (as the last block checks for SIGTERM): give the test a normal SIGINT to work with.
    outer_int = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        _stop_signals_cases(monkeypatch)
    finally:
        signal.signal(signal.SIGINT, outer_int)


def _stop_signals_cases(monkeypatch):
    before_term, before_int = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    with faults.StopSignals() as s:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)
        assert s.received == signal.SIGTERM
        os.kill(os.getpid(), signal.SIGTERM)  # more SIGTERMs: the same request
        time.sleep(0.01)
        assert s.received == signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is before_term and signal.getsignal(signal.SIGINT) is before_int

    monkeypatch.setattr(faults, "REPEAT_S", 0.2)
    with faults.StopSignals() as s:
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)  # a launcher's copy of the same Ctrl-C: ignored
        time.sleep(0.01)
        assert s.received == signal.SIGINT
        time.sleep(0.3)
        with pytest.raises(KeyboardInterrupt):  # a second Ctrl-C, later: abort now
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)
    assert signal.getsignal(signal.SIGINT) is before_int

    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # nohup / background job: stays ignored
    try:
        with faults.StopSignals() as s:
            assert s.installed == [signal.SIGINT] and signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, before_term)


# ---- real processes: SIGTERM to one rank, a frozen rank -----------------------------------------


def test_sigterm_to_one_rank_checkpoints_every_rank_at_one_step_and_resume_continues(run_files, tmp_path):
    """SIGTERM to rank 1 only, mid-run: both ranks (DP 2) finish the step, agree on it, write one
    checkpoint of it together and exit 143 (128 + SIGTERM); --resume latest continues from it."""
    root, common = run_files
    ckpt, m = tmp_path / "ckpt", tmp_path / "m.jsonl"
    argv = common + ["--checkpoint-dir", str(ckpt), "--metrics-file", str(m), "--max-steps", "500"]
    job = _Job(tmp_path, 2, TUTORIAL / "train.py", argv)
    _wait_for(lambda: m.exists() and m.read_text().count("\n") >= 2, 60, "step 2", job)
    job.procs[1].send_signal(signal.SIGTERM)
    codes = job.wait(60)
    assert codes == [143, 143], (codes, job.output(0)[-2000:], job.output(1)[-2000:])
    steps = [r["step"] for r in _rows(m)]
    stop = steps[-1]
    assert steps == list(range(1, stop + 1)) and stop < 500
    assert (ckpt / "latest").read_text() == f"step_{stop:08d}"  # one checkpoint, written by both ranks
    meta = json.loads((ckpt / f"step_{stop:08d}" / "meta.json").read_text())
    assert meta["step"] == stop and meta["world_size"] == 2
    out = job.output(0)
    assert f"SIGTERM received: stopping after step {stop}, saving a checkpoint first" in out
    assert f"Interrupted: SIGTERM received: stopped after step {stop}; checkpoint" in out and "Traceback" not in out
    assert "Traceback" not in job.output(1)

    again = _Job(tmp_path, 2, TUTORIAL / "train.py", argv + ["--resume", "latest", "--stop-at-step", str(stop + 2)])
    assert again.wait(60) == [0, 0], again.output(0)[-2000:]
    assert f"resumed from {ckpt / f'step_{stop:08d}'} at step {stop}" in again.output(0)
    assert [r["step"] for r in _rows(m)] == list(range(1, stop + 3))
    assert (ckpt / "latest").read_text() == f"step_{stop + 2:08d}"


FREEZE = """
import os, runpy, signal, sys
from neuron_ckpt.train.schedule import LRSchedule

apply = LRSchedule.apply

def apply_or_freeze(self, optimizer, step):  # step: 0-based index of the step about to run
    if step == int(os.environ["FREEZE_AT"]) and os.environ["RANK"] == os.environ["FREEZE_RANK"]:
        os.kill(os.getpid(), signal.SIGSTOP)
    return apply(self, optimizer, step)

LRSchedule.apply = apply_or_freeze
sys.argv[0] = {train!r}
sys.path.insert(0, os.path.dirname(sys.argv[0]))
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def _stopped(pid: int) -> bool:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"


def test_a_frozen_rank_is_named_after_the_collective_timeout(run_files, tmp_path):
    """TP 2 x DP 2, --collective-timeout 3: rank 1 stops itself (SIGSTOP) as step 3 begins. Rank 0
    waits in a TP collective (a subgroup), ranks 2 and 3 in DP ones; each fails within timeout +
    grace (3 + 3 s) plus start-up slack, exits non-zero, and names rank 1 and its last step."""
    root, common = run_files
    driver = tmp_path / "freeze.py"
    driver.write_text(FREEZE.format(train=str(TUTORIAL / "train.py")))
    argv = common + ["--tp", "2", "--collective-timeout", "3", "--max-steps", "50"]
    job = _Job(tmp_path, 4, driver, argv, env={"FREEZE_AT": "2", "FREEZE_RANK": "1"})
    _wait_for(lambda: _stopped(job.procs[1].pid), 60, "rank 1 stopping", job)
    frozen_at = time.monotonic()
    live = [job.procs[r] for r in (0, 2, 3)]
    try:
        codes = [p.wait(timeout=30) for p in live]
    finally:
        job.kill()
    took = time.monotonic() - frozen_at
    print(f"\nfrozen rank detected: live ranks exited {took:.1f} s after rank 1 stopped (timeout 3 s + grace 3 s)")
    assert all(c != 0 for c in codes), codes
    for r in (0, 2, 3):
        out = job.output(r)
        assert "CollectiveTimeoutError" in out and "Not answering: rank 1 (last finished step 2)" in out, out[-3000:]
        assert "collective timeout 3 s" in out
        # Rank 0 times out first and reports; a rank whose collective waited on another failed
        # rank can time out after the grace window on a loaded machine and be listed too.
        silent = int(re.search(r"(\d) of 4 ranks did not report", out).group(1))
        assert 1 <= silent <= 2 and "rank 0 (" not in out.split("Not answering:")[1].split(";")[0], out[-3000:]
    assert "a collective in step 3 failed" in job.output(0)
    assert took < 3 + 3 + 8, took
