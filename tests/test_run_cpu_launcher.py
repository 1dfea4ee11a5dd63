"""run_cpu.sh's command line, with a fake torchrun: the default is the command it always ran, and
PP_DEGREE=2 hands ``--pp 2`` (and PP_SCHEDULE's ``--pp-schedule``) to train.py.

A real run takes minutes on this machine's two cores (about 3 for two steps at PP 2), so the fake
``TORCHRUN`` (run_cpu.sh reads it from the environment) records its arguments and writes one step
record where ``--metrics-file`` points, and the script's summary and plot run on that. The script runs
from a copy two directories below tmp_path, so its default DATA and OUT (``../../data``,
``../../runs``) land in tmp_path, not in the repository.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

RUN_CPU = Path(__file__).resolve().parents[1] / "tutorials" / "llama2_7b_tp_zero1" / "run_cpu.sh"

FAKE_TORCHRUN = """#!/usr/bin/env bash
printf '%s\\n' "$@" > "$ARGV_OUT"
while [ $# -gt 0 ]; do [ "$1" = --metrics-file ] && metrics=$2; shift; done
echo '{"step": 1, "loss": 2.5, "tokens_per_s": 10, "seq_per_s": 1, "mfu": 0.01}' > "$metrics"
"""

# What run_cpu.sh ran before PP_DEGREE existed (its commit 152cee6), argument for argument.
DEFAULT_ARGV = (
    "--standalone --nproc_per_node 4 train.py --model-config configs/tiny.json "
    "--data ../../data/tiny_train.safetensors "
    "--tp 2 --sequence-parallel --recompute selective --dtype fp32 --micro-batch-size 2 --global-batch-size 8 "
    "--lr 2e-3 --min-lr-ratio 0.1 --warmup-steps 10 --max-steps 120 --weight-decay 0.1 --grad-clip 1.0 "
    "--checkpoint-dir ../../runs/cpu_tiny/checkpoints --checkpoint-every 50 --keep-last 2 --resume latest "
    "--metrics-file ../../runs/cpu_tiny/metrics.jsonl"
).split()


def _run_cpu(tmp_path: Path, **env: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    tutorial = tmp_path / "tutorials" / "tiny"
    if not tutorial.exists():
        tutorial.mkdir(parents=True)
        shutil.copy(RUN_CPU, tutorial / "run_cpu.sh")
        (tmp_path / "data").mkdir()
        (tmp_path / "data" / "tiny_train.safetensors").touch()  # present: no prepare_data.py (the fake reads nothing)
        fake = tmp_path / "torchrun"
        fake.write_text(FAKE_TORCHRUN)
        fake.chmod(0o755)
    argv_out = tmp_path / "argv"
    argv_out.unlink(missing_ok=True)
    full = {
        "PATH": "/usr/bin:/bin",
        "HOME": str(tmp_path),
        "PYTHON": sys.executable,
        "MPLBACKEND": "Agg",
        "TORCHRUN": str(tmp_path / "torchrun"),
        "ARGV_OUT": str(argv_out),
        **env,
    }
    r = subprocess.run(
        ["bash", str(tutorial / "run_cpu.sh")], env=full, cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    return r, argv_out.read_text().splitlines() if argv_out.exists() else []


def test_default_command_unchanged(tmp_path: Path) -> None:
    r, argv = _run_cpu(tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert argv == DEFAULT_ARGV
    assert (
        "== summary: 1 steps | loss 2.500 -> 2.500" in r.stdout
        and (tmp_path / "runs" / "cpu_tiny" / "loss.png").is_file()
    )


@pytest.mark.parametrize(
    "schedule, out", [(None, "cpu_tiny_pp2"), ("gpipe", "cpu_tiny_pp2"), ("interleaved", "cpu_tiny_pp2_interleaved")]
)
def test_pp_degree_2(tmp_path: Path, schedule: str | None, out: str) -> None:
    """TP 2 x PP 2 on the same 4 processes and batch (8 / micro-batch 2 / DP 1: 4 micro-batches per step),
    in an OUT of its own; --pp right after --tp, the rest of the command as the default's."""
    r, argv = _run_cpu(tmp_path, PP_DEGREE="2", **({"PP_SCHEDULE": schedule} if schedule else {}))
    assert r.returncode == 0, r.stdout + r.stderr
    pp = ["--pp", "2"] + (["--pp-schedule", schedule] if schedule else [])
    i = DEFAULT_ARGV.index("--sequence-parallel")
    expected = DEFAULT_ARGV[:i] + pp + DEFAULT_ARGV[i:]
    assert argv == [a.replace("runs/cpu_tiny/", f"runs/{out}/") for a in expected]
    assert (tmp_path / "runs" / out / "loss.png").is_file()


@pytest.mark.parametrize(
    "env, message",
    [
        (dict(PP_DEGREE="4"), "PP_DEGREE must be 1 or 2"),
        (dict(PP_SCHEDULE="gpipe"), "PP_SCHEDULE applies only with PP_DEGREE=2"),
    ],
)
def test_refused(tmp_path: Path, env: dict[str, str], message: str) -> None:
    r, argv = _run_cpu(tmp_path, **env)
    assert r.returncode == 2 and message in r.stderr and argv == []
