"""Readers of Neuron device-memory reports: neuron-monitor's JSON lines and sysfs counters.

Every input here is **hand-made** in the documented schemas (AWS's neuron-monitor and sysfs user
guides, summarised in ../shared/reference/neuron-memory-formats.md), never captured output: no
Trainium is reachable. The tests check the figures each reader returns and one-line errors for
the wrong kind of file, a truncated line, a missing category and a NeuronCore that is not there.
"""

from __future__ import annotations

import json

import pytest

from neuron_ckpt.memory.readers import NEURON_CATEGORIES, ReadError, neuron_monitor, sysfs

GIB = 1 << 30


def _categories(scratchpad: int, tensors: int) -> dict[str, int]:
    return {"constants": 64 << 20, "model_code": 272 << 20, "model_shared_scratchpad": scratchpad,
            "runtime_memory": 40 << 20, "tensors": tensors}


def _report(per_core: dict[int, dict[str, int]], tag: str = "llama_rank0", error: str = "") -> dict:
    """One neuron-monitor line (trimmed to the fields the reader uses, plus context)."""
    return {
        "neuron_runtime_data": [{
            "pid": 41873, "address": "", "neuron_runtime_tag": tag, "error": "",
            "report": {"memory_used": {"period": 1.0, "error": error, "neuron_runtime_used_bytes": {
                "host": 7 * GIB, "neuron_device": sum(sum(c.values()) for c in per_core.values()),
                "usage_breakdown": {"host": {}, "neuroncore_memory_usage": {
                    str(core): values for core, values in per_core.items()}}}}},
        }],
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
    lines = [_report({0: _categories(9 * page, 10 * GIB), 1: _categories(8 * page, 10 * GIB)}),
             _report({0: _categories(9 * page, 11 * GIB), 1: _categories(9 * page, 9 * GIB)}),
             _report({0: _categories(7 * page, 10 * GIB), 1: _categories(8 * page, 10 * GIB)})]
    reading = neuron_monitor.read(_write_lines(tmp_path / "nm.ndjson", lines))
    assert (reading.source, reading.kind, reading.samples, reading.quantum) == ("neuron-monitor", "peak", 3, page)
    assert reading.core(0)["model_shared_scratchpad"] == 9 * page and reading.core(0)["tensors"] == 11 * GIB
    assert reading.core(1)["model_shared_scratchpad"] == 9 * page and reading.core(1)["tensors"] == 10 * GIB
    assert reading.bytes_of("tensors") == 11 * GIB  # the largest over the cores
    assert "3 samples" in reading.notes[0]


def test_neuron_monitor_picks_runtimes_by_tag(tmp_path):
    lines = [_report({0: _categories(GIB, GIB)}, tag="llama_rank0"), _report({1: _categories(GIB, 2 * GIB)}, tag="other")]
    path = _write_lines(tmp_path / "nm.ndjson", lines)
    assert sorted(neuron_monitor.read(path).cores) == [0, 1]
    assert sorted(neuron_monitor.read(path, tag="llama_rank.*").cores) == [0]
    with pytest.raises(ReadError, match="no memory samples for tag 'x.*'"):
        neuron_monitor.read(path, tag="x.*")


@pytest.mark.parametrize("content, message", [
    ('{"summary": [{"nc_idx": 0}], "instruction": []}\n', "not neuron-monitor output"),
    (json.dumps(_report({0: _categories(GIB, GIB)}))[:-40] + "\n", "truncated"),
    ("", "no memory samples"),
    (json.dumps(_report({0: {k: 1 for k in NEURON_CATEGORIES if k != "tensors"}})) + "\n", "lacks 'tensors'"),
    (json.dumps(_report({0: _categories(GIB, -1)})) + "\n", "expected a byte count"),
    (json.dumps(_report({0: _categories(GIB, GIB)}, error="nrt not running")) + "\n", "reported an error"),
])
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
    snapshot = {f"neuron{d}/neuron_core{c}": {cat: {"total": 0, "peak": 0} for cat in NEURON_CATEGORIES}
                for d in range(2) for c in range(2)}
    for key, values in snapshot.items():
        for cat in values:
            folder = root / key / "stats/memory_usage/device_mem" / cat
            values[cat] = {n: int((folder / n).read_text()) for n in ("total", "peak")}
    (tmp_path / "snap.json").write_text(json.dumps(snapshot), encoding="utf-8")
    from_json = sysfs.read(tmp_path / "snap.json")
    assert {c: {k: v[k] for k in NEURON_CATEGORIES} for c, v in peak.cores.items()} == from_json.cores


@pytest.mark.parametrize("make, message", [
    (lambda p: _sysfs_tree(p / "t", drop=("neuron1/neuron_core0", "tensors")), "neuron1/neuron_core0 lacks 'tensors'"),
    (lambda p: (p / "t").mkdir() or p / "t", "no neuron<d>/neuron_core<c>"),
    (lambda p: (p / "x.json").write_text('{"summary": []}') and p / "x.json", "not a sysfs snapshot"),
    (lambda p: (p / "x.json").write_text('{"neuron0/neuron_core0": {"tensors": {"peak": "12') and p / "x.json",
     "not a JSON sysfs snapshot"),
    (lambda p: p / "missing", "no such file"),
])
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
        lines += ["# HELP neuroncore_memory_usage_tensors Neuron tensors", "# TYPE neuroncore_memory_usage_tensors gauge"]
        for core in (0, 1):
            for category, value in _categories((9 + scrape) * (512 << 20), (10 + core) * GIB).items():
                if category == drop and core == 1:
                    continue
                labels = (f'availability_zone="us-west-2d",instance_id="i-0abc",instance_name="",'
                          f'instance_type="trn1.32xlarge",memory_location="None",neuroncore="{core}",'
                          f'region="us-west-2",runtime_tag="{tag}",subnet_id="subnet-1"')
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


@pytest.mark.parametrize("content, message", [
    (_exposition(drop="runtime_memory"), "NeuronCore 1 lacks neuroncore_memory_usage_runtime_memory"),
    (_exposition().rstrip("\n").rsplit(" ", 1)[0] + "\n", "not a Prometheus sample line"),
    (json.dumps(_report({0: _categories(GIB, GIB)})), "not a Prometheus sample line"),
    ("# nothing\nup 1\n", "not the Neuron exporter's output"),
    (_exposition().replace('neuroncore="0"', 'neuroncore="a"'), "no neuroncore index label"),
    (_exposition() + _exposition().split("\n", 9)[-1][:200], "not a Prometheus sample line"),
])
def test_prometheus_errors_are_one_line_naming_the_file(tmp_path, content, message):
    from neuron_ckpt.memory.readers import prometheus

    path = tmp_path / "bad.txt"
    path.write_text(content, encoding="utf-8")
    _one_line_error(prometheus.read, path, message)


def _memory_stats(**overrides) -> dict:
    """Hand-made ``torch.cuda.memory_stats()`` (flat "<stat>.<pool>.<which>" keys, a few of them)."""
    stats = {}
    for k, stat in enumerate(("allocated_bytes", "active_bytes", "reserved_bytes", "requested_bytes")):
        for pool in ("all", "large_pool", "small_pool"):
            stats.update({f"{stat}.{pool}.current": (k + 1) * GIB, f"{stat}.{pool}.peak": (k + 2) * GIB,
                          f"{stat}.{pool}.allocated": 9 * GIB, f"{stat}.{pool}.freed": 8 * GIB})
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


@pytest.mark.parametrize("content, message", [
    (json.dumps({k: v for k, v in _memory_stats().items() if k != "reserved_bytes.all.peak"}),
     "'reserved_bytes.all.peak' missing"),
    (json.dumps(_memory_stats(**{"active_bytes.all.peak": -5})), "not a byte count: -5"),
    (json.dumps({"segments": [], "device_traces": []}), "not torch.accelerator.memory_stats() output"),
    (json.dumps(_memory_stats())[:100], "not a JSON file"),
])
def test_cuda_memory_stats_errors(tmp_path, content, message):
    from neuron_ckpt.memory.readers import cuda_stats

    path = tmp_path / "bad.json"
    path.write_text(content, encoding="utf-8")
    _one_line_error(cuda_stats.read, path, message)
