"""Readers of device-memory reports: Neuron's (neuron-monitor, its exporter, sysfs, the NEFF), CUDA's, ours.

Every input here is **hand-made**, never captured output (no Trainium is reachable): in the
documented schemas (summarised in ../shared/reference/neuron-memory-formats.md), and for
neuron-monitor and its exporter also in the shape of public real output of multi-process jobs
(``tests/neuron_reports.py``; tests/fixtures/memory/README.md says which input follows which). The
tests check the figures each reader returns and one-line errors for the wrong kind of file, a
truncated line, a missing category and a NeuronCore that is not there.
"""

from __future__ import annotations

import collections
import io
import json
import pickle
import tarfile
from pathlib import Path

import pytest

from neuron_ckpt.memory.readers import (
    NEURON_CATEGORIES,
    ReadError,
    cuda_snapshot,
    neff,
    neuron_monitor,
    recorder,
    sysfs,
)

from . import neuron_reports

GIB = 1 << 30


def _categories(scratchpad: int, tensors: int) -> dict[str, int]:
    return {
        "constants": 64 << 20,
        "model_code": 272 << 20,
        "model_shared_scratchpad": scratchpad,
        "runtime_memory": 40 << 20,
        "tensors": tensors,
    }


def _report(per_core: dict[int, dict[str, int]], tag: str = "llama_rank0", error: str = "") -> dict:
    """One neuron-monitor line (trimmed to the fields the reader uses, plus context)."""
    return {
        "neuron_runtime_data": [
            {
                "pid": 41873,
                "address": "",
                "neuron_runtime_tag": tag,
                "error": "",
                "report": {
                    "memory_used": {
                        "period": 1.0,
                        "error": error,
                        "neuron_runtime_used_bytes": {
                            "host": 7 * GIB,
                            "neuron_device": sum(sum(c.values()) for c in per_core.values()),
                            "usage_breakdown": {
                                "host": {},
                                "neuroncore_memory_usage": {str(core): values for core, values in per_core.items()},
                            },
                        },
                    }
                },
            }
        ],
        "neuron_hardware_info": {"neuron_device_count": 16, "neuroncore_per_device_count": 2},
    }


def _one_line_error(read, path, message: str) -> None:
    """``read(path)`` raises one line that names ``path`` and contains ``message``."""
    with pytest.raises(ReadError) as exc:
        read(path)
    text = str(exc.value)
    assert message in text and str(path) in text and "\n" not in text, text


def _write_lines(path, reports) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in reports), encoding="utf-8")
    return str(path)


def test_neuron_monitor_keeps_the_largest_sample_per_core_and_category(tmp_path):
    page = 512 << 20
    lines = [
        _report({0: _categories(9 * page, 10 * GIB), 1: _categories(8 * page, 10 * GIB)}),
        _report({0: _categories(9 * page, 11 * GIB), 1: _categories(9 * page, 9 * GIB)}),
        _report({0: _categories(7 * page, 10 * GIB), 1: _categories(8 * page, 10 * GIB)}),
    ]
    reading = neuron_monitor.read(_write_lines(tmp_path / "nm.ndjson", lines))
    assert (reading.source, reading.kind, reading.samples, reading.quantum) == ("neuron-monitor", "peak", 3, page)
    assert reading.core(0)["model_shared_scratchpad"] == 9 * page and reading.core(0)["tensors"] == 11 * GIB
    assert reading.core(1)["model_shared_scratchpad"] == 9 * page and reading.core(1)["tensors"] == 10 * GIB
    assert reading.bytes_of("tensors") == 11 * GIB  # the largest over the cores
    assert "3 samples" in reading.notes[0]


def test_neuron_monitor_picks_runtimes_by_tag(tmp_path):
    lines = [
        _report({0: _categories(GIB, GIB)}, tag="llama_rank0"),
        _report({1: _categories(GIB, 2 * GIB)}, tag="other"),
    ]
    path = _write_lines(tmp_path / "nm.ndjson", lines)
    assert sorted(neuron_monitor.read(path).cores) == [0, 1]
    assert sorted(neuron_monitor.read(path, tag="llama_rank.*").cores) == [0]
    with pytest.raises(ReadError, match="no memory samples for tag 'x.*'"):
        neuron_monitor.read(path, tag="x.*")


@pytest.mark.parametrize(
    "content, message",
    [
        ('{"summary": [{"nc_idx": 0}], "instruction": []}\n', "not neuron-monitor output"),
        (json.dumps(_report({0: _categories(GIB, GIB)}))[:-40] + "\n", "truncated"),
        ("", "no memory samples"),
        (json.dumps(_report({0: {k: 1 for k in NEURON_CATEGORIES if k != "tensors"}})) + "\n", "lacks 'tensors'"),
        (json.dumps(_report({0: _categories(GIB, -1)})) + "\n", "expected a byte count"),
        (json.dumps(_report({0: _categories(GIB, GIB)}, error="nrt not running")) + "\n", "reported an error"),
    ],
)
def test_neuron_monitor_errors_are_one_line_naming_the_file(tmp_path, content, message):
    path = tmp_path / "bad.ndjson"
    path.write_text(content, encoding="utf-8")
    _one_line_error(neuron_monitor.read, path, message)


def test_a_core_that_is_not_there_is_named(tmp_path):
    reading = neuron_monitor.read(_write_lines(tmp_path / "nm.ndjson", [_report({0: _categories(GIB, GIB)})]))
    with pytest.raises(ReadError, match=r"NeuronCore 5 is not in the report \(cores: 0\)"):
        reading.core(5)


def _sysfs_tree(root, devices: int = 2, cores: int = 2, drop: tuple[str, str] | None = None):
    """A fake /sys/devices/virtual/neuron_device: total = 1000 * (index + 1) + k, peak = total * 2."""
    for d in range(devices):
        for c in range(cores):
            for k, category in enumerate((*NEURON_CATEGORIES, "collectives", "dma_rings")):
                if drop == (f"neuron{d}/neuron_core{c}", category):
                    continue
                folder = root / f"neuron{d}/neuron_core{c}/stats/memory_usage/device_mem/{category}"
                folder.mkdir(parents=True)
                total = 1000 * (d * cores + c + 1) + k
                for name, value in (("total", total), ("present", 0), ("peak", 2 * total)):
                    (folder / name).write_text(f"{value}\n", encoding="ascii")
    return root


def test_sysfs_tree_and_its_json_snapshot_read_the_same(tmp_path):
    root = _sysfs_tree(tmp_path / "neuron_device")
    peak, current = sysfs.read(root), sysfs.read(root, kind="current")
    assert sorted(peak.cores) == [0, 1, 2, 3]  # instance-wide: device 1 core 0 is NeuronCore 2
    assert current.core(2)["constants"] == 3000 and peak.core(2)["constants"] == 6000
    assert peak.core(3)["collectives"] == 2 * (4000 + len(NEURON_CATEGORIES))  # extra categories kept
    snapshot = {
        f"neuron{d}/neuron_core{c}": {cat: {"total": 0, "peak": 0} for cat in NEURON_CATEGORIES}
        for d in range(2)
        for c in range(2)
    }
    for key, values in snapshot.items():
        for cat in values:
            folder = root / key / "stats/memory_usage/device_mem" / cat
            values[cat] = {n: int((folder / n).read_text()) for n in ("total", "peak")}
    (tmp_path / "snap.json").write_text(json.dumps(snapshot), encoding="utf-8")
    from_json = sysfs.read(tmp_path / "snap.json")
    assert {c: {k: v[k] for k in NEURON_CATEGORIES} for c, v in peak.cores.items()} == from_json.cores


@pytest.mark.parametrize(
    "make, message",
    [
        (
            lambda p: _sysfs_tree(p / "t", drop=("neuron1/neuron_core0", "tensors")),
            "neuron1/neuron_core0 lacks 'tensors'",
        ),
        (lambda p: (p / "t").mkdir() or p / "t", "no neuron<d>/neuron_core<c>"),
        (lambda p: (p / "x.json").write_text('{"summary": []}') and p / "x.json", "not a sysfs snapshot"),
        (
            lambda p: (p / "x.json").write_text('{"neuron0/neuron_core0": {"tensors": {"peak": "12') and p / "x.json",
            "not a JSON sysfs snapshot",
        ),
        (lambda p: p / "missing", "no such file"),
    ],
)
def test_sysfs_errors_are_one_line_naming_the_path(tmp_path, make, message):
    _one_line_error(sysfs.read, make(tmp_path), message)


def test_sysfs_counter_that_is_not_a_number(tmp_path):
    root = _sysfs_tree(tmp_path / "t", devices=1)
    (root / "neuron0/neuron_core1/stats/memory_usage/device_mem/tensors/peak").write_text("n/a\n")
    with pytest.raises(ReadError, match=r"tensors/peak: expected a byte count, got 'n/a\\n'"):
        sysfs.read(root)


def _exposition(scrapes: int = 1, drop: str | None = None, tag: str = "llama_rank0") -> str:
    """Hand-made exporter output: HELP/TYPE comments, the per-core gauges, an unrelated metric."""
    lines = []
    for scrape in range(scrapes):
        lines += [
            "# HELP neuroncore_memory_usage_tensors Neuron tensors",
            "# TYPE neuroncore_memory_usage_tensors gauge",
        ]
        for core in (0, 1):
            for category, value in _categories((9 + scrape) * (512 << 20), (10 + core) * GIB).items():
                if category == drop and core == 1:
                    continue
                labels = (
                    f'availability_zone="us-west-2d",instance_id="i-0abc",instance_name="",'
                    f'instance_type="trn1.32xlarge",memory_location="None",neuroncore="{core}",'
                    f'region="us-west-2",runtime_tag="{tag}",subnet_id="subnet-1"'
                )
                lines.append(f"neuroncore_memory_usage_{category}{{{labels}}} {float(value)!r}")
        lines.append('neuron_runtime_memory_used_bytes{memory_location="host",runtime_tag="x"} 7.0e+09')
    return "\n".join(lines) + "\n"


def test_prometheus_exposition_reads_as_neuron_monitor_does(tmp_path):
    from neuron_ckpt.memory.readers import prometheus

    one = tmp_path / "metrics.txt"
    one.write_text(_exposition(), encoding="utf-8")
    reading = prometheus.read(one)
    assert (reading.kind, reading.samples) == ("current", 1)
    assert reading.core(1)["tensors"] == 11 * GIB and reading.core(0)["model_shared_scratchpad"] == 9 * (512 << 20)
    appended = tmp_path / "scrapes.txt"
    appended.write_text(_exposition(scrapes=3), encoding="utf-8")
    peak = prometheus.read(appended)
    assert (peak.kind, peak.samples, peak.core(0)["model_shared_scratchpad"]) == ("peak", 3, 11 * (512 << 20))
    with pytest.raises(ReadError, match="runtime_tag matching 'other'"):
        prometheus.read(one, tag="other")


@pytest.mark.parametrize(
    "content, message",
    [
        (_exposition(drop="runtime_memory"), "NeuronCore 1 lacks neuroncore_memory_usage_runtime_memory"),
        (_exposition().rstrip("\n").rsplit(" ", 1)[0] + "\n", "not a Prometheus sample line"),
        (json.dumps(_report({0: _categories(GIB, GIB)})), "not a Prometheus sample line"),
        ("# nothing\nup 1\n", "not the Neuron exporter's output"),
        (_exposition().replace('neuroncore="0"', 'neuroncore="a"'), "no neuroncore index label"),
        (_exposition() + _exposition().split("\n", 9)[-1][:200], "not a Prometheus sample line"),
    ],
)
def test_prometheus_errors_are_one_line_naming_the_file(tmp_path, content, message):
    from neuron_ckpt.memory.readers import prometheus

    path = tmp_path / "bad.txt"
    path.write_text(content, encoding="utf-8")
    _one_line_error(prometheus.read, path, message)


# --- neuron-monitor and its exporter as a real multi-process job writes them --------------------
# (tests/neuron_reports.py builds them in the shape of public samples: every runtime lists every
# core, zeros where it holds nothing, one shared tag, an error string in neuron_runtime_vcpu_usage)

PAGE = 512 << 20


def test_four_processes_on_four_cores_sum_per_core_over_the_runtimes(tmp_path):
    """The public inf1 sample's shape: 4 runtimes tagged "1", each listing cores 0-3, 3 samples."""
    lines = [
        neuron_reports.report(neuron_reports.job(range(4), 4, neuron_reports.held(s * PAGE, 9 * GIB)), cores=4)
        for s in (2, 3, 1)
    ]
    reading = neuron_monitor.read(neuron_reports.write_lines(tmp_path / "nm.ndjson", lines))
    assert sorted(reading.cores) == [0, 1, 2, 3] and reading.samples == 3
    assert all(reading.core(c) == neuron_reports.held(3 * PAGE, 9 * GIB) for c in range(4))
    assert "at most 4 in one" in reading.notes[0]


def test_bytes_two_runtimes_hold_on_one_core_add_up(tmp_path):
    """A runtime may hold a little on a core it does not run on (32768 B of model_code on the idle
    core of the public trn1.2xlarge sample): a core's bytes are the sum, not the largest runtime's."""
    first = neuron_reports.runtime(101, "1", 2, {0: neuron_reports.held(PAGE, GIB), 1: {"model_code": 32768}})
    second = neuron_reports.runtime(102, "1", 2, {1: neuron_reports.held(2 * PAGE, GIB)})
    reading = neuron_monitor.read(
        neuron_reports.write_lines(tmp_path / "nm.ndjson", [neuron_reports.report([first, second], cores=2)])
    )
    assert reading.core(1)["model_code"] == neuron_reports.MICROCODE + 32768
    assert reading.core(1)["model_shared_scratchpad"] == 2 * PAGE and reading.core(0)["tensors"] == GIB


def test_a_core_no_runtime_uses_reads_as_zero(tmp_path):
    """8 processes on NeuronCores 8-15 of a 32-core trn1.32xlarge."""
    runtimes = neuron_reports.job(range(8, 16), 32, neuron_reports.held(5 * PAGE, 4 * GIB))
    reading = neuron_monitor.read(neuron_reports.write_lines(tmp_path / "nm.ndjson", [neuron_reports.report(runtimes)]))
    assert sorted(reading.cores) == list(range(32))
    assert reading.core(0) == reading.core(31) == dict.fromkeys(NEURON_CATEGORIES, 0)
    assert reading.core(8)["model_shared_scratchpad"] == 5 * PAGE and reading.bytes_of("tensors") == 4 * GIB


def test_the_tag_picks_one_job_among_the_runtimes(tmp_path):
    ours = neuron_reports.job(range(8), 32, neuron_reports.held(5 * PAGE, 4 * GIB), tag="1")
    theirs = neuron_reports.job(range(16, 20), 32, neuron_reports.held(PAGE, GIB), tag="other", pid=31961)
    path = neuron_reports.write_lines(tmp_path / "nm.ndjson", [neuron_reports.report(ours + theirs)])
    assert neuron_monitor.read(path).core(16)["tensors"] == GIB
    mine = neuron_monitor.read(path, tag="1")
    assert mine.core(16)["tensors"] == 0 and mine.core(7)["tensors"] == 4 * GIB and "at most 8" in mine.notes[0]


def _with(change) -> str:
    line = neuron_reports.report(neuron_reports.job(range(2), 2, neuron_reports.held(PAGE, GIB)), cores=2)
    change(line["neuron_runtime_data"][1])
    return json.dumps(line) + "\n"


@pytest.mark.parametrize(
    "change",
    [
        lambda r: r["report"]["neuroncore_counters"].update(error="nc counters unavailable"),
        lambda r: r["report"]["execution_stats"].update(error="no stats"),
        lambda r: r["report"].pop("neuron_runtime_vcpu_usage"),
    ],
)
def test_an_error_in_a_group_the_reader_does_not_use_is_ignored(tmp_path, change):
    path = tmp_path / "nm.ndjson"
    path.write_text(_with(change), encoding="utf-8")
    assert neuron_monitor.read(path).core(1)["tensors"] == GIB


@pytest.mark.parametrize(
    "change, message",
    [
        (
            lambda r: r["report"]["memory_used"].update(error="nrt not responding"),
            "error in memory_used for runtime '1' (pid 21050): nrt not responding",
        ),
        (lambda r: r.update(error="runtime exited", report={}), "error for runtime '1' (pid 21050): runtime exited"),
        (
            lambda r: r["report"]["memory_used"]["neuron_runtime_used_bytes"]["usage_breakdown"][
                "neuroncore_memory_usage"
            ]["1"].pop("tensors"),
            "runtime '1' (pid 21050): NeuronCore 1 lacks 'tensors'",
        ),
    ],
)
def test_an_error_in_memory_used_is_one_line_naming_the_runtime(tmp_path, change, message):
    path = tmp_path / "nm.ndjson"
    path.write_text(_with(change), encoding="utf-8")
    _one_line_error(neuron_monitor.read, path, message)


def _scrapes(*lines: dict) -> str:
    return "".join(neuron_reports.exposition(line) for line in lines)


def test_exporter_series_of_each_runtime_sum_per_core(tmp_path):
    """Tags per process (as the public DataDog fixture's PIDs, and our capture script's ranks): a
    series per runtime and core, summed per core in each scrape; the largest over scrapes."""
    from neuron_ckpt.memory.readers import prometheus

    def line(pages: int) -> dict:
        runtimes = [
            neuron_reports.runtime(100 + r, f"rank{r}", 4, {r: neuron_reports.held(pages * PAGE, GIB)})
            for r in range(4)
        ]
        return neuron_reports.report(runtimes, cores=4)

    path = tmp_path / "metrics.txt"
    path.write_text(_scrapes(line(2), line(3), line(1)), encoding="utf-8")
    reading = prometheus.read(path)
    assert (reading.kind, reading.samples, sorted(reading.cores)) == ("peak", 3, [0, 1, 2, 3])
    assert all(reading.core(c) == neuron_reports.held(3 * PAGE, GIB) for c in range(4))
    assert prometheus.read(path, tag="rank[01]").core(2)["tensors"] == 0
    cut = _scrapes(line(2)) + "\n".join(_scrapes(line(3)).splitlines()[:-3]) + "\n"  # the last 3 series lost
    path.write_text(cut, encoding="utf-8")
    _one_line_error(prometheus.read, path, "lacks 3 memory series the scrape before it had (cut short?)")


def test_exporter_keeps_only_the_last_of_runtimes_that_share_a_tag(tmp_path):
    """The exporter's series carry no pid: runtimes tagged alike write the same series, the last
    one wins, and every core but its own reads its zeros (docs/memory.md says so)."""
    from neuron_ckpt.memory.readers import prometheus

    line = neuron_reports.report(neuron_reports.job(range(4), 4, neuron_reports.held(2 * PAGE, GIB)), cores=4)
    path = tmp_path / "metrics.txt"
    path.write_text(_scrapes(line), encoding="utf-8")
    reading = prometheus.read(path)
    assert reading.core(3)["tensors"] == GIB and [reading.core(c)["tensors"] for c in range(3)] == [0, 0, 0]
    assert neuron_monitor.read(neuron_reports.write_lines(tmp_path / "nm.ndjson", [line])).core(0)["tensors"] == GIB


def _memory_stats(**overrides) -> dict:
    """Hand-made ``torch.cuda.memory_stats()`` (flat "<stat>.<pool>.<which>" keys, a few of them)."""
    stats = {}
    for k, stat in enumerate(("allocated_bytes", "active_bytes", "reserved_bytes", "requested_bytes")):
        for pool in ("all", "large_pool", "small_pool"):
            stats.update(
                {
                    f"{stat}.{pool}.current": (k + 1) * GIB,
                    f"{stat}.{pool}.peak": (k + 2) * GIB,
                    f"{stat}.{pool}.allocated": 9 * GIB,
                    f"{stat}.{pool}.freed": 8 * GIB,
                }
            )
    stats["num_alloc_retries"] = 0
    stats.update(overrides)
    return stats


def test_cuda_memory_stats(tmp_path):
    from neuron_ckpt.memory.readers import cuda_stats

    path = tmp_path / "stats.json"
    path.write_text(json.dumps(_memory_stats()), encoding="utf-8")
    peak, now = cuda_stats.read(path), cuda_stats.read(path, kind="current", device=3)
    assert peak.cores == {0: {"allocated_bytes": 2 * GIB, "active_bytes": 3 * GIB, "reserved_bytes": 4 * GIB}}
    assert now.core(3)["reserved_bytes"] == 3 * GIB and now.kind == "current"


@pytest.mark.parametrize(
    "content, message",
    [
        (
            json.dumps({k: v for k, v in _memory_stats().items() if k != "reserved_bytes.all.peak"}),
            "'reserved_bytes.all.peak' missing",
        ),
        (json.dumps(_memory_stats(**{"active_bytes.all.peak": -5})), "not a byte count: -5"),
        (json.dumps({"segments": [], "device_traces": []}), "not torch.accelerator.memory_stats() output"),
        (json.dumps(_memory_stats())[:100], "not a JSON file"),
    ],
)
def test_cuda_memory_stats_errors(tmp_path, content, message):
    from neuron_ckpt.memory.readers import cuda_stats

    path = tmp_path / "bad.json"
    path.write_text(content, encoding="utf-8")
    _one_line_error(cuda_stats.read, path, message)


# --- NEFF def.json: the scratchpad the compiler fixed --------------------------------------------

FIXTURES = Path(__file__).parent / "fixtures" / "memory"
MIB = 1 << 20


def _def_json(virtual: dict[str, tuple[int, int]], inputs=(), outputs=()) -> dict:
    """A hand-made def.json: ``virtual`` maps a var name to (backing_variable_off, size)."""
    var = {"SB": {"type": "state-buffer", "var_id": 0}}
    for n, (name, (offset, size)) in enumerate(virtual.items(), 1):
        var[name] = {"backing_variable_off": offset, "ops": [], "size": size, "type": "virtual", "var_id": n}
    for n, size in enumerate(inputs):
        var[f"input{n}"] = {"type": "input", "var_id": 100 + n, "size": size}
    for n, size in enumerate(outputs):
        var[f"output{n}"] = {"type": "output", "var_id": 200 + n, "size": size}
    return {"var": var}


def _neff(path, members: dict[str, dict | bytes], gzipped: bool = False):
    """A .neff as AWS describes it: a 1024-byte header, then a tar archive (gzip'd or not)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz" if gzipped else "w") as archive:
        for name, content in members.items():
            data = content if isinstance(content, bytes) else json.dumps(content).encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    path.write_bytes(b"NEFF" + bytes(neff.HEADER_BYTES - 4) + buffer.getvalue())
    return path


def test_neff_def_json_takes_the_extent_of_overlapping_vars_not_their_sum():
    reading = neff.read(FIXTURES / "def.json")
    assert (reading.source, reading.kind, reading.quantum, reading.samples) == ("neff", "peak", None, 1)
    assert reading.cores == {0: {"model_shared_scratchpad": 48 * MIB, "inputs": 8 * MIB, "outputs": 4}}
    assert 48 * MIB != (16 + 32 + 24 + 4) * MIB  # the sum of the virtual vars' sizes
    assert reading.notes == ()


def test_neff_unpacked_directory_gives_each_subgraph(tmp_path):
    for index, end in ((0, 300), (1, 500)):
        (tmp_path / f"sg0{index}").mkdir()
        definition = _def_json({"a": (0, 200), "b": (100, end - 100)}, inputs=[64, 32], outputs=[16])
        (tmp_path / f"sg0{index}" / "def.json").write_text(json.dumps(definition))
    (tmp_path / "kelf-0.json").write_text("{}")
    reading = neff.read(tmp_path)
    assert reading.cores == {
        0: {"model_shared_scratchpad": 300, "inputs": 96, "outputs": 16},
        1: {"model_shared_scratchpad": 500, "inputs": 96, "outputs": 16},
    }
    assert neff.read(tmp_path / "sg01" / "def.json").cores == {1: reading.core(1)}  # the index from its folder


@pytest.mark.parametrize("gzipped", [False, True])
def test_neff_file_is_a_header_and_a_tar(tmp_path, gzipped):
    path = _neff(
        tmp_path / "graph.neff",
        {"sg00/def.json": _def_json({"a": (0, 4096), "b": (1024, 1024)}), "sg00/Activation0.bin": b"\x00" * 64},
        gzipped,
    )
    assert neff.read(path).cores == {0: {"model_shared_scratchpad": 4096, "inputs": 0, "outputs": 0}}


def test_neff_other_backing_areas_are_their_own_category(tmp_path):
    definition = _def_json({"a": (0, 1000)})
    definition["var"]["s"] = {
        "type": "virtual",
        "var_id": 7,
        "size": 300,
        "backing_variable_off": 100,
        "backing_buf": "sharded",
    }
    definition["var"]["m"] = {
        "type": "virtual",
        "var_id": 8,
        "size": 50,
        "backing_variable_off": 2000,
        "fabric_path": "main",
        "backing_buf": "sharded",
    }  # fabric_path wins
    (tmp_path / "def.json").write_text(json.dumps(definition))
    reading = neff.read(tmp_path / "def.json")
    assert reading.core(0) == {"model_shared_scratchpad": 2050, "scratchpad_sharded": 400, "inputs": 0, "outputs": 0}
    assert "'sharded'" in reading.notes[0] and "unconfirmed" in reading.notes[0]


def test_neff_without_virtual_vars_has_no_scratchpad_and_says_so(tmp_path):
    (tmp_path / "def.json").write_text(json.dumps(_def_json({}, inputs=[128])))
    reading = neff.read(tmp_path / "def.json")
    assert reading.core(0) == {"model_shared_scratchpad": 0, "inputs": 128, "outputs": 0}
    assert "no virtual var" in reading.notes[0]


def _bad_var(**entry) -> str:
    definition = _def_json({"a": (0, 10)})
    definition["var"]["t7"] = {"type": "virtual", "var_id": 9, **entry}
    return json.dumps(definition)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda p: (p / "def.json").write_text('{"var": {"a": ') and p / "def.json", "not JSON"),
        (lambda p: (p / "def.json").write_text('{"summary": []}') and p / "def.json", "not a NEFF def.json (no 'var'"),
        (
            lambda p: (p / "def.json").write_text(_bad_var(backing_variable_off=0)) and p / "def.json",
            "virtual var 't7': 'size' is missing",
        ),
        (
            lambda p: (p / "def.json").write_text(_bad_var(backing_variable_off="12", size=4)) and p / "def.json",
            "virtual var 't7': 'backing_variable_off' is '12'",
        ),
        (lambda p: (p / "def.json").write_text('{"var": {"a": 5}}') and p / "def.json", "var 'a' is 5, not an object"),
        (lambda p: (p / "x.neff").write_bytes(bytes(1024) + b"not a tar archive" * 40) and p / "x.neff", "not a NEFF"),
        (lambda p: (p / "x.neff").write_bytes(b"short") and p / "x.neff", "not a NEFF"),
        (lambda p: _neff(p / "x.neff", {"sg01/def.json": _def_json({})}), "no sg00/def.json"),
        (lambda p: (p / "sg01").mkdir() or p, "no sg00/def.json"),
        (lambda p: p / "missing.neff", "no such file"),
    ],
)
def test_neff_errors_are_one_line_naming_the_path(tmp_path, make, message):
    _one_line_error(neff.read, make(tmp_path), message)


# --- CUDA allocator snapshot (the pickle of segments and history) --------------------------------


def _block(size: int, state: str, requested: int | None = None) -> dict:
    return {
        "address": 0,
        "size": size,
        "requested_size": size if requested is None else requested,
        "state": state,
        "frames": [{"filename": "llama.py", "line": 212, "name": "forward"}],
    }


def _segment(device: int, total: int, blocks: list[dict], kind: str = "large") -> dict:
    return {
        "device": device,
        "address": 139872,
        "total_size": total,
        "allocated_size": 0,
        "active_size": 0,
        "requested_size": 0,
        "stream": 0,
        "segment_type": kind,
        "segment_pool_id": (0, 0),
        "is_expandable": False,
        "frames": [],
        "blocks": blocks,
    }


def _entry(action: str, size: int, addr: int = 139872) -> dict:
    return {"action": action, "addr": addr, "size": size, "stream": 0, "time_us": 1, "frames": []}


def _snapshot() -> dict:
    """Hand-made, in the layout torch 2.13's C++ writes. Device 0 now holds a (8 MiB - 100 B
    requested) tensor, one awaiting free and a 400 B one in a small segment; its trace, from an
    empty allocator, passes through 17 MiB - 100 B requested and 24 MiB reserved. Device 1 has no
    history."""
    segments = [
        _segment(
            0,
            20 * MIB,
            [
                _block(8 * MIB, "active_allocated", 8 * MIB - 100),
                _block(2 * MIB, "active_pending_free"),
                _block(10 * MIB, "inactive"),
            ],
        ),
        _segment(0, 2 * MIB, [_block(512, "active_allocated", 400), _block(2 * MIB - 512, "inactive")], "small"),
        _segment(1, 4 * MIB, [_block(4 * MIB, "active_allocated", 3 * MIB)]),
    ]
    trace = [
        _entry("segment_alloc", 20 * MIB),
        _entry("alloc", 8 * MIB - 100),
        _entry("alloc", 6 * MIB),
        _entry("segment_alloc", 4 * MIB),
        _entry("alloc", 3 * MIB),
        _entry("free_requested", 3 * MIB),
        _entry("free_completed", 3 * MIB),
        _entry("segment_free", 4 * MIB),
        _entry("free_requested", 6 * MIB),
        _entry("free_completed", 6 * MIB),
        _entry("segment_alloc", 2 * MIB),
        _entry("alloc", 400),
        _entry("alloc", 2 * MIB),
        _entry("free_requested", 2 * MIB),
        {"action": "oom", "device_free": 0, "size": 80 * (1 << 30), "stream": 0, "time_us": 2},
        _entry("snapshot", 0),
    ]
    return {
        "segments": segments,
        "device_traces": [trace, []],
        "external_annotations": [],
        "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": "", "expandable_segments": False},
    }


def _pickled(path, snapshot) -> str:
    path.write_bytes(pickle.dumps(snapshot))
    return str(path)


def test_cuda_snapshot_current_is_read_from_the_segments(tmp_path):
    reading = cuda_snapshot.read(_pickled(tmp_path / "snap.pickle", _snapshot()), kind="current")
    assert (reading.source, reading.kind, reading.quantum) == ("cuda-snapshot", "current", None)
    assert reading.core(0) == {
        "allocated": 8 * MIB + 512,
        "active": 10 * MIB + 512,
        "requested": 8 * MIB + 300,
        "reserved": 22 * MIB,
    }
    assert reading.core(1) == {"allocated": 4 * MIB, "active": 4 * MIB, "requested": 3 * MIB, "reserved": 4 * MIB}


def test_cuda_snapshot_peak_replays_the_trace_back_from_now(tmp_path):
    reading = cuda_snapshot.read(_pickled(tmp_path / "snap.pickle", _snapshot()))
    assert reading.kind == "peak"
    assert reading.core(0) == {"requested": 17 * MIB - 100, "reserved": 24 * MIB}  # above now: 8 MiB + 300, 22 MiB
    assert reading.core(1) == {"requested": 3 * MIB, "reserved": 4 * MIB}  # no history: peak = current
    assert "16 trace entries" in reading.notes[0] and "no history recorded" in reading.notes[1]


def test_cuda_snapshot_in_the_documented_layout_without_device(tmp_path):
    """The reference's fragment (torch's docstring layout: no segment "device", the documented
    "active_awaiting_free"), read as device 0 with a note."""
    snapshot = {
        "segments": [
            {
                "address": 139872,
                "total_size": 20971520,
                "stream": 0,
                "segment_type": "large",
                "segment_pool_id": (0, 0),
                "allocated_size": 16777216,
                "active_size": 16777216,
                "blocks": [
                    _block(16777216, "active_allocated"),
                    _block(MIB, "active_awaiting_free"),
                    _block(3 * MIB, "inactive"),
                ],
            }
        ],
        "device_traces": [[{"action": "alloc", "addr": 139872, "size": 16777216, "stream": 0}]],
    }
    reading = cuda_snapshot.read(_pickled(tmp_path / "snap.pickle", snapshot), kind="current")
    assert reading.cores == {
        0: {"allocated": 16 * MIB, "active": 17 * MIB, "requested": 16 * MIB, "reserved": 20 * MIB}
    }
    assert "no 'device' key" in reading.notes[0]


class _Opens:
    """Unpickling this would call open(); the reader must refuse before anything runs."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (str(self.path), "w"))


def test_cuda_snapshot_refuses_a_pickle_that_needs_a_class(tmp_path):
    marker = tmp_path / "was-run"
    path = _pickled(tmp_path / "evil.pickle", {"segments": [], "device_traces": [], "x": _Opens(marker)})
    _one_line_error(cuda_snapshot.read, path, "refused: the pickle needs io.open")
    assert not marker.exists()
    path = _pickled(tmp_path / "od.pickle", collections.OrderedDict(segments=[]))
    _one_line_error(cuda_snapshot.read, path, "needs collections.OrderedDict")


def _changed(change) -> dict:
    snapshot = _snapshot()
    change(snapshot)
    return snapshot


@pytest.mark.parametrize(
    "content, message",
    [
        (b"not a pickle at all", "not a pickle"),
        (pickle.dumps(_snapshot())[:200], "not a pickle"),
        (pickle.dumps({"device_traces": [[]]}), "not a memory snapshot (no 'segments' list)"),
        (
            pickle.dumps(_changed(lambda s: s["segments"][0]["blocks"][0].update(state="allocated"))),
            "segment 0 block 0: malformed block (state 'allocated'",
        ),
        (
            pickle.dumps(_changed(lambda s: s["segments"][1]["blocks"][0].pop("size"))),
            "segment 1 block 0: 'size' is missing",
        ),
        (pickle.dumps(_changed(lambda s: s["segments"][0]["blocks"].pop())), "segment 0: malformed segment"),
        (
            pickle.dumps(_changed(lambda s: s["device_traces"][0].append(_entry("alloc", MIB)))),
            "device_traces[0]: the trace does not match the segments (requested replays below 0 before it starts)",
        ),
        (
            pickle.dumps(
                _changed(
                    lambda s: s["device_traces"][0].__setitem__(  # frees 30 MiB it never had
                        slice(0, 0), [_entry("segment_free", 30 * MIB), _entry("segment_alloc", 30 * MIB)]
                    )
                )
            ),
            "device_traces[0]: the trace does not match the segments (reserved replays below 0 at entry 0)",
        ),
        (
            pickle.dumps(_changed(lambda s: s["device_traces"][0].append(_entry("realloc", 1)))),
            "device_traces[0] entry 16: malformed trace entry (action 'realloc')",
        ),
        (pickle.dumps({"segments": [], "device_traces": [[], []]}), "no segments and no trace"),
    ],
)
def test_cuda_snapshot_errors_are_one_line_naming_the_file(tmp_path, content, message):
    path = tmp_path / "bad.pickle"
    path.write_bytes(content)
    _one_line_error(cuda_snapshot.read, path, message)


# --- our recorder's saved-tensor bytes -----------------------------------------------------------


def test_recorder_round_trip_of_a_real_measurement(tmp_path):
    import torch

    from neuron_ckpt.memory.measure import SavedTensorRecorder

    x, w = torch.randn(4, 8, requires_grad=True), torch.randn(8, 16, requires_grad=True)
    with SavedTensorRecorder() as rec:
        with rec.scope("matmul"):
            y = x @ w  # saves x (128 B) and w (512 B)
        with rec.scope("relu"):
            loss = y.relu().sum()  # relu saves its output (256 B); sum saves no tensor
    assert rec.total_bytes == 896
    path = tmp_path / "saved.json"
    recorder.write(path, [rec, 1000])
    data = json.loads(path.read_text())
    assert data["ranks"][0] == {"rank": 0, "saved_bytes": 896, "by_scope": {"matmul": 640, "relu": 256}}
    reading = recorder.read(path)
    assert (reading.source, reading.kind, reading.quantum) == ("recorder", "peak", None)
    assert reading.cores == {0: {"saved": 896}, 1: {"saved": 1000}}
    loss.backward()
    with pytest.raises(ValueError, match="rank 1: expected a SavedTensorRecorder or a byte count, got -1"):
        recorder.write(tmp_path / "bad.json", [rec, -1])
    assert not (tmp_path / "bad.json").exists()


def _recorder_file(**changes) -> str:
    data = {
        "format": "neuron_ckpt.saved-tensors",
        "version": 1,
        "ranks": [{"rank": 0, "saved_bytes": 896, "by_scope": {}}, {"rank": 1, "saved_bytes": 900, "by_scope": {}}],
    }
    data.update(changes)
    return json.dumps(data)


@pytest.mark.parametrize(
    "content, message",
    [
        (
            _recorder_file(format="neuron_ckpt.memory-capture"),
            "not a saved-tensors file (format 'neuron_ckpt.memory-capture'",
        ),
        (json.dumps(_memory_stats()), "not a saved-tensors file (format None"),
        (_recorder_file(version=2), "version 2 of neuron_ckpt.saved-tensors"),
        (_recorder_file(ranks=[{"rank": 0, "by_scope": {}}]), "rank 0: no 'saved_bytes'"),
        (_recorder_file(ranks=[{"rank": 0, "saved_bytes": -8}]), "rank 0: 'saved_bytes' is -8"),
        (
            _recorder_file(ranks=[{"rank": 1, "saved_bytes": 8}, {"rank": 1, "saved_bytes": 9}]),
            "rank 1 is recorded twice",
        ),
        (_recorder_file(ranks=[]), "no 'ranks' records"),
        (_recorder_file()[:50], "not a JSON recorder file"),
    ],
)
def test_recorder_errors_are_one_line_naming_the_file(tmp_path, content, message):
    path = tmp_path / "bad.json"
    path.write_text(content, encoding="utf-8")
    _one_line_error(recorder.read, path, message)
