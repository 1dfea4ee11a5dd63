"""``scripts/capture_trn1_memory.py`` end to end on CPU, with stand-ins for what only a trn1 has.

The real tutorial ``train.py`` runs under real torchrun (gloo, world size 1). Stand-ins:
``neuron-monitor`` (an executable printing hand-made reports in its schema while it runs),
``neuron-explorer`` (``view -d INSPECT --ingest-only ...`` writes, where ``--data-path`` and
``--display-name`` put it, an ingested profile in schema 7.4.0's shape: tests/explorer_profiles.py),
the driver's sysfs tree (2 NeuronCores, 5 categories) and, in the interpreter every rank starts
(``--python``), the runtime and compiler: it records the rank's environment, writes two NEFFs into
``$NEURON_COMPILE_CACHE_URL``, holds a scratchpad of N MiB in sysfs while the run lasts and, when
``NEURON_RT_INSPECT_ENABLE=1``, leaves a system trace in ``$NEURON_RT_INSPECT_OUTPUT_DIR`` saying
what it held. The tests of per-rank tags and of a failed run fake the training too, under a
stand-in torchrun.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from neuron_ckpt.cli import main as cli_main
from neuron_ckpt.data import write_packed
from neuron_ckpt.memory.capture import read_capture
from neuron_ckpt.memory.readers import NEURON_CATEGORIES, explorer, neff, neuron_monitor, sysfs

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "tutorials" / "llama2_7b_tp_zero1" / "configs" / "tiny.json"
MIB = 1 << 20
SEQ = 64

MONITOR = '''#!{python}
"""Stand-in neuron-monitor: a report per 0.2 s, for runtime tag neuron_ckpt_rank0 if -c's filter takes it,
in the real shape: the runtime lists both NeuronCores (zeros on the one it does not use), and its
neuron_runtime_vcpu_usage carries the error neuron-monitor gives when it cannot see the process."""
import json, re, sys, time
from pathlib import Path
Path(sys.argv[0] + ".started").touch()
conf = json.load(open(sys.argv[sys.argv.index("-c") + 1]))
assert conf["period"] == "1s" and conf["neuron_runtimes"][0]["metrics"] == [{{"type": "memory_used"}}]
tag = "neuron_ckpt_rank0"
cores = {{"0": {{"constants": 1, "model_code": 2, "model_shared_scratchpad": 3 << 29, "runtime_memory": 4,
               "tensors": 5}},
         "1": {{"constants": 0, "model_code": 0, "model_shared_scratchpad": 0, "runtime_memory": 0, "tensors": 0}}}}
runtime = {{"pid": 1, "address": "", "neuron_runtime_tag": tag, "error": "", "report": {{"memory_used": {{
    "period": 1.0, "error": "", "neuron_runtime_used_bytes": {{"host": 6, "neuron_device": 7, "usage_breakdown": {{
        "host": {{"application_memory": 6, "constants": 0, "dma_buffers": 0, "tensors": 0}},
        "neuroncore_memory_usage": cores}}}}, "loaded_models": []}},
    "neuron_runtime_vcpu_usage": {{"period": 1.0, "vcpu_usage": {{"user": 0, "system": 0}},
                                   "error": "open /proc/1/stat: no such file or directory"}}}}}}
runtimes = [runtime] if re.fullmatch(conf["neuron_runtimes"][0]["tag_filter"], tag) else []
while True:
    print(json.dumps({{"neuron_runtime_data": runtimes, "system_data": {{}}}}), flush=True)
    time.sleep(0.2)
'''

RANK_PYTHON = '''#!{python}
"""Stand-in for each rank's interpreter: records the rank's environment; plays the compiler (two
NEFFs into the compile cache: the step, and a larger file with a smaller scratchpad) and the driver
(a scratchpad of N MiB on NeuronCore RANK while the run lasts); then runs train.py, or fakes it."""
import io, json, os, subprocess, sys, tarfile
from pathlib import Path
args, rank = sys.argv[1:], os.environ["RANK"]
layers = json.loads(Path(args[args.index("--model-config") + 1]).read_text())["num_hidden_layers"]
inspect = {{k: v for k, v in os.environ.items() if k.startswith("NEURON_RT_INSPECT_")}}
with open({record!r}, "a") as f:
    f.write(json.dumps({{"rank": rank, "tag": os.environ.get("NEURON_PROCESS_TAG"), "layers": layers,
                        "cache": os.environ.get("NEURON_COMPILE_CACHE_URL"), "inspect": inspect}}) + "\\n")
if inspect.get("NEURON_RT_INSPECT_ENABLE") == "1":  # the runtime's system trace: here, what this rank held
    trace = Path(inspect["NEURON_RT_INSPECT_OUTPUT_DIR"]) / f"i-0abc_pid_{{os.getpid()}}" / "1766072156"
    trace.mkdir(parents=True)
    (trace / "ntrace.pb").write_text(json.dumps({{"core": int(rank), "scratchpad": (16 + layers) * 64 * {mib}}}))

def neff(path, scratchpad, padding):
    definition = json.dumps({{"var": {{"v": {{"type": "virtual", "backing_variable_off": 0, "size": scratchpad}}}}}})
    data = io.BytesIO()
    with tarfile.open(fileobj=data, mode="w") as tar:
        for name, body in (("sg00/def.json", definition.encode()), ("pad.bin", bytes(padding))):
            info = tarfile.TarInfo(name)
            info.size = len(body)
            tar.addfile(info, io.BytesIO(body))
    path.parent.mkdir(parents=True)
    path.write_bytes(bytes(1024) + data.getvalue())

def counter(value):
    mem = Path({sysfs!r}) / f"neuron0/neuron_core{{rank}}/stats/memory_usage/device_mem/model_shared_scratchpad"
    for name, number in (("total", value), ("peak", max(value, int((mem / "peak").read_text())))):
        (mem / (name + ".tmp")).write_text(f"{{number}}\\n")
        os.replace(mem / (name + ".tmp"), mem / name)  # whole values only, as the driver's files

if rank == "0":
    cache = Path(os.environ["NEURON_COMPILE_CACHE_URL"]) / "neuronxcc-0.0"
    neff(cache / "MODULE_step/model.neff", layers * {step_bytes}, 0)
    neff(cache / "MODULE_optimizer/model.neff", 4096, 1 << 16)
counter(layers * {mib})
if os.environ.get("FAKE_TRAIN"):
    import time
    time.sleep(0.2)
    print("attention: " + os.environ.get("FAKE_ATTENTION", "flash") + ": a stand-in", flush=True)
    time.sleep(60 if "FAKE_ATTENTION" in os.environ else 0)  # a long compile, unless the capture stops it
    code = int(os.environ.get("FAIL_AT_LAYERS") == str(layers)) * 7
else:
    code = subprocess.call([{python!r}, *args])
counter(0)
sys.exit(code)
'''
STEP_BYTES = 3 * 4096

EXPLORER = '''#!{python}
"""Stand-in neuron-explorer: view -d INSPECT --ingest-only --ignore-device-profile --display-name NAME
--data-path WS writes WS/profiles/global/NAME@latest from the ranks' traces (trn1.2xlarge: 1 device, 2 HBMs)."""
import json, sys
from pathlib import Path
sys.path.insert(0, {root!r})
from tests import explorer_profiles as ep
Path(sys.argv[0] + ".started").touch()
args = sys.argv[1:]
assert args[:4] == ["view", "-d", args[2], "--ingest-only"] and "--ignore-device-profile" in args, args
name, workspace = args[args.index("--display-name") + 1], Path(args[args.index("--data-path") + 1])
traces = [json.loads(p.read_text()) for p in sorted(Path(args[2]).glob("*/*/ntrace.pb"))]
assert traces, "no system trace under " + args[2]
samples = []
for trace in traces:
    samples += ep.step_samples(trace["scratchpad"], (trace["core"] + 1) << 30, [trace["core"]])
ep.write_profile(workspace / "profiles" / "global" / f"{{name}}@latest", samples, devices=1, hbms=2, parts=2)
print("View profile at http://localhost:3001/profile/" + name)
'''

LAUNCHER = '''#!{python}
"""Stand-in torchrun for the runs that fake training: --nproc_per_node N --no-python CMD... starts
N copies of CMD with RANK set and passes SIGTERM on; its exit code is the first failure's."""
import os, signal, subprocess, sys
args = sys.argv[1:]
n, cmd = int(args[args.index("--nproc_per_node") + 1]), args[args.index("--no-python") + 1:]
ranks = [subprocess.Popen(cmd, env={{**os.environ, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(n)}})
         for r in range(n)]
signal.signal(signal.SIGTERM, lambda *_: [p.terminate() for p in ranks])
sys.exit(next((code for code in [p.wait() for p in ranks] if code), 0))
'''


def _executable(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o755)
    return path


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("capture_trn1_memory", ROOT / "scripts" / "capture_trn1_memory.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _standins(root: Path) -> dict:
    root.mkdir()
    for core in (0, 1):
        for category in NEURON_CATEGORIES:
            mem = root / "sysfs" / f"neuron0/neuron_core{core}/stats/memory_usage/device_mem" / category
            mem.mkdir(parents=True)
            for counter in ("total", "present", "peak"):
                (mem / counter).write_text("4096\n" if category == "model_code" else "0\n")
    blocks = (np.random.default_rng(0).integers(0, 128, size=(8, 1)) + np.arange(SEQ)) % 128
    write_packed(root / "train.safetensors", blocks, vocab_size=128, tokenizer="random")
    python = sys.executable
    rank_python = RANK_PYTHON.format(
        python=python, record=str(root / "ranks.jsonl"), sysfs=str(root / "sysfs"), step_bytes=STEP_BYTES, mib=MIB
    )
    return {
        "monitor": _executable(root / "neuron-monitor", MONITOR.format(python=python)),
        "explorer": _executable(root / "neuron-explorer", EXPLORER.format(python=python, root=str(ROOT))),
        "python": _executable(root / "rank-python", rank_python),
        "root": root,
        "torchrun": f"{python} -m torch.distributed.run --standalone --nproc_per_node {{nproc}}",
        "launcher": f"{_executable(root / 'launcher', LAUNCHER.format(python=python))} --nproc_per_node {{nproc}}",
    }


def _argv(s: dict, out: Path, *more: str, launcher: str = "launcher") -> list[str]:
    return [
        "--model-config",
        str(TINY),
        "--data",
        str(s["root"] / "train.safetensors"),
        "--tp",
        "1",
        "--seq",
        str(SEQ),
        "--dtype",
        "fp32",
        "--steps",
        "2",
        "--out",
        str(out),
        "--neuron-monitor",
        str(s["monitor"]),
        "--neuron-explorer",
        str(s["explorer"]),
        "--sysfs-root",
        str(s["root"] / "sysfs"),
        "--python",
        str(s["python"]),
        "--launcher",
        s[launcher],
        "--extra=--device-kind cpu",
        *more,
    ]


def _ranks(s: dict) -> list[dict]:
    return [json.loads(line) for line in (s["root"] / "ranks.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def captured(script, tmp_path_factory):
    """Presets none and full at 1 and 2 layers: four real training runs."""
    s = _standins(tmp_path_factory.mktemp("capture") / "standins")
    out = s["root"].parent / "out"
    argv = _argv(s, out, "--layers", "1,2", "--presets", "none,full", "--attention", "flash", launcher="torchrun")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OMP_NUM_THREADS", "1")  # a tiny model: threads only contend
        assert script.main(argv) == 0
    return s, out


def test_manifest_reads_back_with_every_run_and_the_job(captured):
    s, out = captured
    capture = read_capture(out)
    assert [(r.recompute, r.layers, r.attention) for r in capture.runs] == [
        ("none", 1, "flash"),
        ("none", 2, "flash"),
        ("full", 1, "flash"),
        ("full", 2, "flash"),
    ]
    assert all(set(r.files) == {"neuron_monitor", "sysfs", "neff", "explorer"} for r in capture.runs)
    assert capture.job == {
        "model": "llama",
        "config": "config.json",
        "tp": 1,
        "dp": 1,
        "seq": SEQ,
        "micro_batch": 1,
        "dtype": "fp32",
        "sequence_parallel": True,
        "zero1": True,
        "attention": "flash",
    }
    assert json.loads((out / "config.json").read_text()) == json.loads(TINY.read_text())
    for run in capture.runs:
        assert (
            json.loads((out / f"{run.recompute}_L{run.layers}" / "model_config.json").read_text())["num_hidden_layers"]
            == run.layers
        )
        assert "\nsummary {" in (out / f"{run.recompute}_L{run.layers}" / "train.log").read_text()  # train.py ran
    assert any("not cleared" in note for note in capture.notes)
    assert any("neuronx-cc" in note for note in capture.notes)


def test_each_rank_is_tagged_and_compiles_into_its_runs_cache(captured):
    s, out = captured
    assert [(r["rank"], r["tag"], r["layers"], r["cache"]) for r in _ranks(s)] == [
        ("0", "neuron_ckpt_rank0", n, str(out / f"{p}_L{n}" / "cache")) for p in ("none", "full") for n in (1, 2)
    ]


def test_each_run_has_a_system_profile_without_a_device_profile(captured):
    """NEURON_RT_INSPECT_ENABLE=1 with the device profile off (its ~2 GB of buffers would be measured),
    into the run's inspect/; neuron-explorer ingests it into explorer/, which the explorer reader reads."""
    s, out = captured
    for record in _ranks(s):
        run = out / f"{'none' if record['cache'].startswith(str(out / 'none')) else 'full'}_L{record['layers']}"
        assert record["inspect"] == {
            "NEURON_RT_INSPECT_ENABLE": "1",
            "NEURON_RT_INSPECT_SYSTEM_PROFILE": "1",
            "NEURON_RT_INSPECT_DEVICE_PROFILE": "0",
            "NEURON_RT_INSPECT_OUTPUT_DIR": str(run / "inspect"),
        }
    capture = read_capture(out)
    for run in capture.runs:
        name = f"{run.recompute}_L{run.layers}"
        assert run.files["explorer"] == f"{name}/explorer/profiles/global/{name}@latest"
        reading = explorer.read(capture.path(run, "explorer"))
        assert reading.core(0)["shared_scratchpad"] == (16 + run.layers) * 64 * MIB
        assert reading.core(0)["tensors"] == 1 << 30
        assert reading.core(1)["tensors"] == 0  # the idle core: the runtime's baseline only
        assert "View profile at" in (out / name / "neuron-explorer.log").read_text()
    assert any("no device profile (its buffers take HBM)" in note for note in capture.notes)


def test_sysfs_keeps_the_largest_total_polled_while_the_job_ran(captured):
    """The stand-in driver holds N MiB only while the run lasts; after it, the tree reads 0."""
    s, out = captured
    capture = read_capture(out)
    for run in capture.runs:
        current = sysfs.read(capture.path(run, "sysfs"), kind="current")
        assert current.bytes_of("model_shared_scratchpad", 0) == run.layers * MIB
        assert current.bytes_of("model_shared_scratchpad", 1) == 0 and current.bytes_of("model_code", 1) == 4096
        assert (
            sysfs.read(capture.path(run, "sysfs")).bytes_of("model_shared_scratchpad", 0)
            == (run.layers if run.recompute == "none" else 2) * MIB
        )  # the peak persists from none_L2 on
    assert sysfs.read(s["root"] / "sysfs", kind="current").bytes_of("model_shared_scratchpad", 0) == 0
    rose = {note.split(":")[0]: "on neuron0/neuron_core0;" in note for note in capture.notes if "peak rose" in note}
    assert rose == {"none_L1": True, "none_L2": True, "full_L1": False, "full_L2": False}


def test_neuron_monitor_and_the_step_neff_read_with_their_readers(captured):
    s, out = captured
    capture = read_capture(out)
    for run in capture.runs:
        reading = neuron_monitor.read(capture.path(run, "neuron_monitor"), tag="neuron_ckpt_rank0")
        assert reading.samples >= 1 and reading.bytes_of("model_shared_scratchpad", 0) == 3 << 29
        assert reading.core(1) == dict.fromkeys(NEURON_CATEGORIES, 0)  # listed, unused
        # the step (N x 12 KiB), not the larger file with the smaller scratchpad
        assert neff.read(capture.path(run, "neff")).cores[0]["model_shared_scratchpad"] == run.layers * STEP_BYTES


def test_neuron_ckpt_compare_reads_the_capture_as_it_is(captured, capsys):
    s, out = captured
    # 1: it read every report, and the stand-ins' bytes disagree with the model (an unreadable capture exits 2)
    assert cli_main(["compare", "--capture", str(out), "--json"]) == 1
    compared = json.loads(capsys.readouterr().out)
    assert {(c["source"], c["recompute"]) for c in compared["comparisons"]} == {
        (source, preset)
        for source in ("neuron-monitor", "sysfs", "neff", "neuron-explorer")
        for preset in ("none", "full")
    }


def test_every_rank_gets_its_own_tag(script, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_TRAIN", "1")
    monkeypatch.setenv("NEURON_RT_INSPECT_DEVICE_PROFILE", "session")  # the capture overrides it
    s = _standins(tmp_path / "standins")
    argv = _argv(s, tmp_path / "out", "--layers", "1,2", "--presets", "none", "--nproc", "2")
    assert script.main(argv) == 0
    assert sorted((r["rank"], r["tag"]) for r in _ranks(s)) == [
        ("0", "neuron_ckpt_rank0"),
        ("0", "neuron_ckpt_rank0"),
        ("1", "neuron_ckpt_rank1"),
        ("1", "neuron_ckpt_rank1"),
    ]
    assert {r["inspect"]["NEURON_RT_INSPECT_DEVICE_PROFILE"] for r in _ranks(s)} == {"0"}
    capture = read_capture(tmp_path / "out")
    assert capture.job["dp"] == 2
    both = explorer.read(capture.path(capture.runs[1], "explorer"))  # one trace per rank, ingested together
    assert both.core(0)["tensors"] == 1 << 30 and both.core(1)["tensors"] == 2 << 30


def test_no_system_profile_leaves_the_runtime_unprofiled(script, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_TRAIN", "1")
    monkeypatch.setenv("NEURON_RT_INSPECT_ENABLE", "1")  # set by the user: removed, with the rest
    s = _standins(tmp_path / "standins")
    assert script.main(_argv(s, tmp_path / "out", "--layers", "1,2", "--presets", "none", "--no-system-profile")) == 0
    assert [r["inspect"] for r in _ranks(s)] == [{}, {}]
    assert not Path(str(s["explorer"]) + ".started").exists()
    capture = read_capture(tmp_path / "out")
    assert all("explorer" not in r.files for r in capture.runs) and "no Neuron profile" in " ".join(capture.notes)


def test_a_missing_neuron_explorer_is_refused_before_anything_runs(script, tmp_path, capsys):
    s = _standins(tmp_path / "standins")
    argv = _argv(s, tmp_path / "out", "--layers", "1,2")
    argv[argv.index("--neuron-explorer") + 1] = str(tmp_path / "nowhere" / "neuron-explorer")
    assert script.main(argv) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "no neuron-explorer executable" in err and "--no-system-profile" in err
    assert not (tmp_path / "out").exists() and not (s["root"] / "ranks.jsonl").exists()


def test_a_failed_run_stops_the_capture_and_keeps_the_runs_before_it(script, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FAKE_TRAIN", "1")
    monkeypatch.setenv("FAIL_AT_LAYERS", "2")
    s = _standins(tmp_path / "standins")
    assert script.main(_argv(s, tmp_path / "out", "--layers", "1,2", "--presets", "full")) == 7  # the launcher's
    err = capsys.readouterr().err.strip()
    assert (
        "\n" not in err
        and "training run full_L2 failed (exit code 7)" in err
        and str(tmp_path / "out/full_L2/train.log") in err
    )
    assert [(r.recompute, r.layers) for r in read_capture(tmp_path / "out").runs] == [("full", 1)]


def test_another_attention_than_asked_stops_the_capture(script, tmp_path, monkeypatch, capsys):
    """train.py falls back to explicit attention where no flash kernel runs: the manifest would
    lie. It says so at start; the capture stops the job then, not after a long first step."""
    monkeypatch.setenv("FAKE_TRAIN", "1")
    monkeypatch.setenv("FAKE_ATTENTION", "explicit")
    s = _standins(tmp_path / "standins")
    start = time.monotonic()
    assert script.main(_argv(s, tmp_path / "out", "--layers", "1,2", "--presets", "none")) == 1
    assert time.monotonic() - start < 30
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "runs explicit attention, not --attention flash" in err
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_a_non_empty_out_is_refused_before_anything_runs(script, tmp_path, capsys):
    s = _standins(tmp_path / "standins")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "earlier.txt").write_text("kept")
    assert script.main(_argv(s, tmp_path / "out", "--layers", "1,2", "--presets", "none")) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--out" in err and "not an empty directory" in err
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["earlier.txt"]
    assert not Path(str(s["monitor"]) + ".started").exists() and not (s["root"] / "ranks.jsonl").exists()


def test_a_missing_neuron_monitor_is_one_line(script, tmp_path, capsys, monkeypatch):
    if Path("/opt/aws/neuron/bin/neuron-monitor").exists():
        pytest.skip("this machine has neuron-monitor where the script looks by default")
    s = _standins(tmp_path / "standins")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    argv = _argv(s, tmp_path / "out", "--layers", "1,2")
    at = argv.index("--neuron-monitor")
    assert script.main(argv[:at] + argv[at + 2 :]) == 1  # the default: not on PATH, not in /opt/aws/neuron/bin
    argv[at + 1] = str(tmp_path / "nowhere" / "neuron-monitor")
    assert script.main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all("no neuron-monitor executable" in line for line in err)
    assert not (tmp_path / "out").exists()


def test_sysfs_snapshots_are_strict(tmp_path):
    """What the capture polls: the tree as the JSON the sysfs reader takes; nothing there is an error."""
    tree = _standins(tmp_path / "standins")["root"] / "sysfs"
    snap = sysfs.snapshot(tree)
    assert snap["neuron0/neuron_core1"]["model_code"] == {"total": 4096, "peak": 4096}
    with pytest.raises(sysfs.ReadError, match="no neuron<d>/neuron_core<c>"):
        sysfs.snapshot(tmp_path)
    with pytest.raises(sysfs.ReadError, match="different NeuronCores"):
        sysfs.merge_max(snap, {"neuron0/neuron_core0": snap["neuron0/neuron_core0"]})
