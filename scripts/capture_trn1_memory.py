"""Measure device memory on trn1 in one command, into a directory ``neuron-ckpt compare --capture DIR`` reads.

For each recompute preset P and layer count N it runs the tutorial's training step
(``tutorials/llama2_7b_tp_zero1/train.py`` with run_trn1.sh's model, parallelism and Neuron
settings) for ``--steps`` steps with ``neuron-monitor`` alongside and a Neuron system profile, and
writes ``OUT/P_LN/``: ``neuron-monitor.ndjson`` (memory reports every 1 s, our ranks only),
``sysfs.json`` (the driver's counters polled once a second: per NeuronCore and category the largest
``total`` and the last ``peak``), ``step.neff`` (the NEFF with the largest scratchpad in the run's
own compile cache, ``cache/``), ``inspect/`` (the raw system profile) and
``explorer/profiles/global/P_LN@latest/`` (it ingested by ``neuron-explorer view --ingest-only``:
the profiler's HBM usage per category over the run, SDK 2.29+), ``train.log`` and
``model_config.json``; and ``OUT/config.json`` and ``OUT/manifest.json``, rewritten after every run::

    python scripts/capture_trn1_memory.py --data ~/data/llama2_train.safetensors --out ~/capture_7b
    neuron-ckpt compare --capture ~/capture_7b

Not yet run on a trn1: tests/test_memory_capture.py runs it on CPU with stand-ins for
neuron-monitor, neuron-explorer, the driver's sysfs tree, the compiler and the runtime's profile.
Choices, and why:

* ``--nproc`` defaults to ``--tp``, one data-parallel replica: one NeuronCore per TP rank. The
  comparison is per core, and every replica's cores hold the same bytes but for the ZeRO-1
  optimizer shard, which the manifest's ``dp`` accounts for.
* Each rank's runtime is tagged ``neuron_ckpt_rank<RANK>``: ``NEURON_PROCESS_TAG`` must be set
  before the runtime starts, so ``torchrun --no-python`` starts a ``sh`` that sets it per rank.
* Each run compiles into its own cache (``NEURON_COMPILE_CACHE_URL``; a ``--cache_dir`` in
  ``NEURON_CC_FLAGS`` would take precedence, so it is dropped), so the NEFFs there are its own.
* The sysfs ``peak`` counters outlive processes and only root can clear them; this script does
  not. Each run's note names the cores on which the scratchpad peak rose during the run.
* The ``--attention`` train.py runs is checked from its log: a fallback to explicit stops the capture.
* The profile is a **system** profile only (``NEURON_RT_INSPECT_ENABLE=1``,
  ``NEURON_RT_INSPECT_SYSTEM_PROFILE=1``, ``NEURON_RT_INSPECT_DEVICE_PROFILE=0``, set over the
  environment's): a device profile allocates profiler buffers in HBM (~2 GB on trn1, AWS's
  device-memory page) that every reading would include, while "system profiles do not" need device
  memory. ``--no-system-profile`` removes every ``NEURON_RT_INSPECT_*`` variable instead. Reading
  the ingested tables needs pyarrow (``pip install 'neuron_ckpt[profiler]'``), checked before any run.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from neuron_ckpt.memory import ModelShape, TrainingSetup
from neuron_ckpt.memory.capture import Run, write_capture
from neuron_ckpt.memory.options import offered_presets
from neuron_ckpt.memory.readers import ReadError, explorer, neff, neuron_monitor, sysfs
from neuron_ckpt.parallel.attention import ATTENTION

TRAIN = Path(__file__).resolve().parents[1] / "tutorials" / "llama2_7b_tp_zero1" / "train.py"
TAG = "neuron_ckpt_rank"
TAG_SH = f': "${{RANK:?the launcher must set RANK, as torchrun does}}"; export NEURON_PROCESS_TAG={TAG}$RANK; exec "$@"'
MONITOR_CONF = {
    "period": "1s",
    "neuron_runtimes": [{"tag_filter": f"{TAG}.*", "metrics": [{"type": "memory_used"}]}],
    "system_metrics": [{"type": "memory_info"}],
}  # the memory-only config of neuron-monitor's guide
# As run_trn1.sh sets them (compiler flags change the scratchpad); values already in the environment win.
TUTORIAL_ENV = {
    "NEURON_CC_FLAGS": "--model-type transformer",
    "NEURON_FUSE_SOFTMAX": "1",
    "NEURON_RT_ASYNC_EXEC_MAX_INFLIGHT_REQUESTS": "3",
    "NEURON_RT_STOCHASTIC_ROUNDING_EN": "0",
    "MALLOC_ARENA_MAX": "64",
}
SCRATCHPAD = "model_shared_scratchpad"
NEURON_BIN = Path("/opt/aws/neuron/bin")
# A system profile, never a device profile (its buffers take HBM): set over the environment's values.
INSPECT_ENV = {
    "NEURON_RT_INSPECT_ENABLE": "1",
    "NEURON_RT_INSPECT_SYSTEM_PROFILE": "1",
    "NEURON_RT_INSPECT_DEVICE_PROFILE": "0",
}
INGEST_TIMEOUT = 3600  # seconds neuron-explorer may take to ingest one run's profile


class CaptureError(Exception):
    """Stops the capture: :func:`main` prints the one-line message and returns ``code``."""

    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.code = code


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-config", default="llama2-7b", help="a preset or a LlamaConfig JSON (run_trn1.sh's)")
    p.add_argument(
        "--data",
        default=str(Path.home() / "data" / "llama2_train.safetensors"),
        help="packed token file (prepare_data.py); its block length is the sequence length",
    )
    p.add_argument("--layers", default="4,8,12,16", help="comma-separated decoder layer counts, two or more")
    p.add_argument(
        "--presets", default=None, help="comma-separated recompute presets (default: those offered for --attention)"
    )
    p.add_argument("--attention", choices=ATTENTION, default="flash", help="run_trn1.sh runs flash (NxD's NKI kernel)")
    p.add_argument("--tp", type=int, default=8)
    p.add_argument(
        "--seq", type=int, default=None, help="sequence length, checked against --data (default: its block length)"
    )
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--sequence-parallel", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--out", required=True, help="capture directory: new, or empty")
    p.add_argument("--nproc", type=int, default=None, help="ranks (default --tp: one data-parallel replica)")
    p.add_argument("--steps", type=int, default=3, help="training steps a run: the first compiles and loads")
    p.add_argument("--neuron-monitor", default=None, help=f"executable (default: on PATH, else in {NEURON_BIN})")
    p.add_argument(
        "--system-profile",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="a Neuron system profile per run, ingested by neuron-explorer (HBM usage from SDK 2.29)",
    )
    p.add_argument("--neuron-explorer", default=None, help=f"executable (default: on PATH, else in {NEURON_BIN})")
    p.add_argument("--sysfs-root", default="/sys/devices/virtual/neuron_device")
    p.add_argument("--launcher", default="torchrun --nproc_per_node {nproc}", help="'{nproc}' is replaced")
    p.add_argument("--python", default=sys.executable, help="the interpreter every rank runs train.py with")
    p.add_argument("--extra", default="", help="more train.py arguments, last (--extra='--lr 1e-4')")
    return p.parse_args(argv)


def _checked(args: argparse.Namespace) -> tuple[dict, list[int], list[str]]:
    """Refuse what can be refused before anything runs; the model config, layer counts and presets."""
    from neuron_ckpt.models.config_file import config_path, load_llama_config, read_json_object

    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CaptureError(f"--out {out}: exists and is not an empty directory (a capture starts afresh)")
    args.neuron_monitor = _executable(
        "neuron-monitor", args.neuron_monitor, "install aws-neuronx-tools or pass --neuron-monitor"
    )
    if args.system_profile:
        args.neuron_explorer = _executable(
            "neuron-explorer",
            args.neuron_explorer,
            "install aws-neuronx-tools of SDK 2.29+, pass --neuron-explorer, or --no-system-profile",
        )
        try:
            import pyarrow.parquet  # noqa: F401  (explorer.read needs it; refuse before any run, not after)
        except ImportError:
            raise CaptureError(
                "--system-profile: reading the ingested profile needs pyarrow: "
                "pip install 'neuron_ckpt[profiler]' (or --no-system-profile)"
            ) from None
    args.nproc = args.nproc or args.tp
    if min(args.tp, args.nproc, args.steps, args.micro_batch) < 1 or args.nproc % args.tp:
        raise CaptureError(
            f"--tp {args.tp} --nproc {args.nproc} --steps {args.steps} --micro-batch {args.micro_batch}: "
            "need positive values, --nproc a multiple of --tp"
        )
    try:
        layers = sorted({int(n) for n in args.layers.split(",")})
        config = read_json_object(config_path(args.model_config))
        shape = ModelShape.from_llama(load_llama_config(args.model_config))
    except ValueError as e:
        raise CaptureError(f"--layers {args.layers} / --model-config {args.model_config}: {e}") from None
    if len(layers) < 2 or layers[0] < 1:
        raise CaptureError(f"--layers {args.layers}: need two or more positive layer counts (the slope is per layer)")
    try:
        from safetensors import safe_open  # the packed file's header only

        with safe_open(args.data, "np") as f:
            block_len = int((f.metadata() or {})["block_len"])
    except Exception as e:  # noqa: BLE001 (safetensors' own error, a missing file, no block_len)
        raise CaptureError(f"--data {args.data}: not a packed token file from prepare_data.py ({e!r})") from None
    if args.seq not in (None, block_len):
        raise CaptureError(
            f"--seq {args.seq}: {args.data} holds blocks of {block_len} tokens, the length train.py runs"
        )
    args.seq = block_len
    setup = TrainingSetup(
        seq_len=block_len,
        micro_batch=args.micro_batch,
        tp=args.tp,
        dp=args.nproc // args.tp,
        dtype=args.dtype,
        sequence_parallel=args.sequence_parallel,
        attention=args.attention,
    )
    offered = offered_presets(shape, setup)
    presets = args.presets.split(",") if args.presets else list(offered)
    if not set(presets) <= set(offered):
        raise CaptureError(
            f"--presets {args.presets}: with {args.attention} attention the presets are {', '.join(offered)}"
        )
    return config, layers, presets


def _executable(name: str, given: str | None, remedy: str) -> str:
    """``given``, else ``name`` on PATH, else in /opt/aws/neuron/bin: an executable file, or a CaptureError."""
    found = shutil.which(given or name) or (None if given else str(NEURON_BIN / name))
    if not found or not Path(found).is_file() or not os.access(found, os.X_OK):
        where = repr(given) if given else f"none on PATH nor at {NEURON_BIN / name}"
        raise CaptureError(f"no {name} executable: {where} ({remedy})")
    return found


def _train_env(cache: Path, inspect: Path | None = None) -> dict:
    """The environment of a run: the tutorial's Neuron settings, its own compile cache, and a system
    profile into ``inspect`` (None: no profile at all)."""
    env = {k: v for k, v in {**TUTORIAL_ENV, **os.environ}.items() if not k.startswith("NEURON_RT_INSPECT_")}
    env["NEURON_COMPILE_CACHE_URL"] = str(cache)
    if inspect is not None:
        env.update(INSPECT_ENV, NEURON_RT_INSPECT_OUTPUT_DIR=str(inspect))
    env["NEURON_CC_FLAGS"] = " ".join(re.sub(r"--cache_dir[= ]\S+", "", env["NEURON_CC_FLAGS"]).split())
    for name in ("XLA_USE_BF16", "XLA_DOWNCAST_BF16", "NEURON_EXTRACT_GRAPHS_ONLY"):  # as run_trn1.sh; real runs
        env.pop(name, None)
    return env


def _facts() -> list[str]:
    """What decides the compiled graphs, as far as it can be read cheaply."""
    versions = []
    for dist in ("neuronx-cc", "torch-neuronx", "libneuronxla", "torch-xla", "torch"):
        try:
            versions.append(f"{dist} {importlib.metadata.version(dist)}")
        except importlib.metadata.PackageNotFoundError:
            versions.append(f"{dist} not installed")
    dropped = " (its --cache_dir dropped)" if "--cache_dir" in os.environ.get("NEURON_CC_FLAGS", "") else ""
    notes = [
        f"NEURON_CC_FLAGS{dropped}: {_train_env(Path())['NEURON_CC_FLAGS']!r}",
        f"packages in this script's interpreter: {', '.join(versions)}",
    ]
    if cc := shutil.which("neuronx-cc"):
        done = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=300)
        notes.append("neuronx-cc --version: " + " | ".join((done.stdout + done.stderr).strip().splitlines()[:4]))
    else:
        notes.append("neuronx-cc: not on PATH")
    driver = Path("/sys/module/neuron/version")
    notes.append(f"Neuron driver: {driver.read_text().strip() if driver.is_file() else f'unknown (no {driver})'}")
    return notes


def _said_attention(log: Path, asked: str, ended: bool) -> bool:
    """Whether train.py has said which attention it runs (rank 0, at start: ``attention: flash: ...``);
    a CaptureError if it runs another than ``asked``, or said none by the time it ended."""
    found = re.search(r"^attention: (\w+)", log.read_text(errors="replace"), re.M)
    if found and found.group(1) != asked:
        raise CaptureError(
            f"train.py runs {found.group(1)} attention, not --attention {asked} (log: {log}); "
            f"pass --attention {found.group(1)}, or make its kernel importable"
        )
    if not found and ended:
        raise CaptureError(f"train.py's log names no attention (log: {log})")
    return found is not None


def _wait(proc: subprocess.Popen, root: Path | None, log: Path, attention: str):
    """Wait for the job, reading the sysfs tree once a second; stop it if it runs another attention.
    Returns (exit code, first snapshot, merged snapshots, sysfs error)."""
    first = merged = error = None
    said = False
    while True:
        if root is not None and error is None:
            try:
                now = sysfs.snapshot(root)
                first, merged = first or now, now if merged is None else sysfs.merge_max(merged, now)
            except ReadError as e:
                error = str(e)
        try:
            said = said or _said_attention(log, attention, ended=False)
        except CaptureError:
            proc.terminate()
            proc.wait()
            raise
        try:
            return proc.wait(timeout=1.0), first, merged, error
        except subprocess.TimeoutExpired:
            continue


def _stop(monitor: subprocess.Popen, path: Path) -> None:
    monitor.terminate()
    try:
        monitor.wait(timeout=10)
    except subprocess.TimeoutExpired:
        monitor.kill()
        monitor.wait()
    lines = path.read_text(errors="replace").splitlines(keepends=True)
    if lines and not lines[-1].endswith("\n"):  # stopped mid-report
        path.write_text("".join(lines[:-1]))


def _step_neff(cache: Path) -> tuple[Path | None, str]:
    """The compiled step among the run's NEFFs: the one with the largest scratchpad (the forward and
    backward graph holds the activations; the optimizer's and the small graphs little, and file
    size says nothing of it); a NEFF the reader cannot read is skipped. (Path or None, a note.)"""
    neffs, sizes = sorted(cache.rglob("*.neff")), {}
    for path in neffs:
        try:
            sizes[path] = neff.read(path).cores[0][SCRATCHPAD]
        except ReadError:
            continue
    if not sizes:
        return None, f"none of the {len(neffs)} NEFFs in the run's compile cache reads as one"
    best = max(sizes, key=sizes.get)
    return (
        best,
        f"{best.relative_to(cache)}: scratchpad {sizes[best]} B, the largest of {len(sizes)} of {len(neffs)} NEFFs",
    )


def _ingest(args: argparse.Namespace, run_dir: Path, name: str) -> tuple[Path | None, str]:
    """``neuron-explorer view --ingest-only`` of the run's system profile into ``run_dir/explorer``;
    (the profile directory, or None, and why not)."""
    workspace = run_dir / "explorer"
    command = [
        args.neuron_explorer,
        "view",
        "-d",
        str(run_dir / "inspect"),
        "--ingest-only",
        "--ignore-device-profile",
        "--display-name",
        name,
        "--data-path",
        str(workspace),
    ]
    print(f"== {name}: {shlex.join(command)}", flush=True)
    with open(run_dir / "neuron-explorer.log", "wb") as log:
        try:
            code = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, timeout=INGEST_TIMEOUT).returncode
        except subprocess.TimeoutExpired:
            return None, f"neuron-explorer took over {INGEST_TIMEOUT} s (log: {name}/neuron-explorer.log)"
    if code != 0:
        return None, f"neuron-explorer exited with {code} (log: {name}/neuron-explorer.log)"
    profile = workspace / "profiles" / "global" / f"{name}@latest"
    try:
        explorer.read(profile)
    except ReadError as e:
        return None, str(e)
    return profile, f"{profile.relative_to(run_dir.parent)}: ingested"


def _run(args: argparse.Namespace, out: Path, config: dict, preset: str, layers: int, root: Path | None):
    """One training run with its readings; (its manifest entry, its notes)."""
    name = f"{preset}_L{layers}"
    run_dir, notes, files = out / name, [], {}
    (run_dir / "cache").mkdir(parents=True)
    (run_dir / "model_config.json").write_text(json.dumps({**config, "num_hidden_layers": layers}, indent=1) + "\n")
    train = [
        str(TRAIN),
        "--model-config",
        str(run_dir / "model_config.json"),
        "--data",
        args.data,
        "--tp",
        str(args.tp),
        "--sequence-parallel" if args.sequence_parallel else "--no-sequence-parallel",
        "--recompute",
        preset,
        "--attention",
        args.attention,
        "--dtype",
        args.dtype,
        "--micro-batch-size",
        str(args.micro_batch),
        "--global-batch-size",
        str(args.micro_batch * args.nproc // args.tp),
        "--max-steps",
        str(args.steps),
        "--warmup-steps",
        "0",
        "--device-kind",
        "trn1",
        *shlex.split(args.extra),
    ]
    launcher = shlex.split(args.launcher.replace("{nproc}", str(args.nproc)))
    command = [*launcher, "--no-python", "sh", "-c", TAG_SH, "neuron-ckpt-rank-tag", args.python, *train]
    nm_path, log = run_dir / "neuron-monitor.ndjson", run_dir / "train.log"
    print(f"== {name} (log: {log}): {shlex.join(command)}", flush=True)
    with open(nm_path, "wb") as nm, open(run_dir / "neuron-monitor.log", "wb") as nm_log, open(log, "wb") as log_file:
        monitor = subprocess.Popen(
            [args.neuron_monitor, "-c", str(out / "neuron-monitor.conf.json")], stdout=nm, stderr=nm_log
        )
        try:
            inspect = run_dir / "inspect" if args.system_profile else None
            proc = subprocess.Popen(
                command, env=_train_env(run_dir / "cache", inspect), stdout=log_file, stderr=subprocess.STDOUT
            )
            code, first, merged, error = _wait(proc, root, log, args.attention)
        finally:
            _stop(monitor, nm_path)
    if code != 0:
        raise CaptureError(f"training run {name} failed (exit code {code}); log: {log}", code)
    _said_attention(log, args.attention, ended=True)
    try:
        neuron_monitor.read(nm_path)
        files["neuron_monitor"] = f"{name}/{nm_path.name}"
    except ReadError as e:
        notes.append(f"{name}: no neuron_monitor reading ({name}/neuron-monitor.log has its stderr): {e}")
    if merged is not None and error is None:
        (run_dir / "sysfs.json").write_text(json.dumps(merged, indent=1) + "\n")
        files["sysfs"] = f"{name}/sysfs.json"
        rose = [core for core in merged if merged[core][SCRATCHPAD]["peak"] != first[core][SCRATCHPAD]["peak"]]
        notes.append(
            f"{name}: sysfs {SCRATCHPAD} peak rose during the run on {', '.join(rose) or 'no NeuronCore'}; "
            "elsewhere it is an earlier process's"
        )
    elif root is not None:
        notes.append(f"{name}: no sysfs reading: {error or 'the job ended before the first poll'}")
    if args.system_profile:
        profile, why = _ingest(args, run_dir, name)
        if profile is not None:
            files["explorer"] = str(profile.relative_to(out))
        notes.append(f"{name}: explorer: {why}" if profile else f"{name}: no explorer reading: {why}")
    step, why = _step_neff(run_dir / "cache")
    if step is not None:
        shutil.copyfile(step, run_dir / "step.neff")
        files["neff"] = f"{name}/step.neff"
    notes.append(f"{name}: step.neff: {why}" if step else f"{name}: no neff reading: {why}")
    if not files:
        raise CaptureError(f"{name}: no report could be read ({'; '.join(notes)})")
    return Run(layers, preset, args.attention, files), notes


def capture(args: argparse.Namespace, argv: list[str]) -> int:
    config, layers, presets = _checked(args)
    out, root = Path(args.out), Path(args.sysfs_root)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    (out / "neuron-monitor.conf.json").write_text(json.dumps(MONITOR_CONF, indent=1) + "\n")
    dp = args.nproc // args.tp
    job = {
        "model": "llama",
        "config": "config.json",
        "tp": args.tp,
        "dp": dp,
        "seq": args.seq,
        "micro_batch": args.micro_batch,
        "dtype": args.dtype,
        "sequence_parallel": args.sequence_parallel,
        "zero1": True,
        "attention": args.attention,
    }
    notes = [
        f"command: scripts/capture_trn1_memory.py {shlex.join(argv)}",
        f"ranks: {args.nproc} = TP {args.tp} x DP {dp}; {args.steps} steps a run; each run compiles into its own cache",
        (
            "sysfs peak counters were not cleared (that needs root, and whether a write resets peak is unconfirmed): "
            "a peak can be an earlier process's; total (kind current) is the largest over the run's 1 s polls"
        ),
        (
            "a system profile per run (NEURON_RT_INSPECT_ENABLE=1), no device profile (its buffers take HBM), "
            "ingested with neuron-explorer"
        )
        if args.system_profile
        else "no Neuron profile (--no-system-profile)",
        *_facts(),
    ]
    try:
        sysfs.snapshot(root)
    except ReadError as e:
        print(f"capture_trn1_memory: warning: runs go on without sysfs counters: {e}", file=sys.stderr, flush=True)
        notes.append(f"no sysfs readings: {e}")
        root = None
    runs: list[Run] = []
    for preset in presets:
        for n in layers:
            run, run_notes = _run(args, out, config, preset, n, root)
            runs.append(run)
            notes += run_notes
            write_capture(out, job, runs, notes)  # after every run: a crash keeps what was done
    print(f"capture: {len(runs)} runs in {out}; neuron-ckpt compare --capture {out}", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        return capture(parse_args(argv), argv)
    except CaptureError as e:
        print(f"capture_trn1_memory: error: {e}", file=sys.stderr, flush=True)
        return e.code


if __name__ == "__main__":
    sys.exit(main())
