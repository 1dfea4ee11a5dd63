"""Neuron Explorer's ingested profile read as a memory report, and ``neuron-ckpt compare`` on it.

Every profile here is **hand-made** with pyarrow in the shape profile schema 7.4.0 documents
(tests/explorer_profiles.py; no public dump of these tables was found): every HBM of a
trn1.32xlarge at every sample, the runtime's baseline on all of them, a job of 8 ranks on cores
5-12 placed out of process order (rank 0 on core 9, holding more), eight samples a run (warm-up,
forward, the step's peak, between steps), the HBM table split in three parts. The reader's figures
are checked against the same rows reduced in plain Python, and compare against the analytic model.
"""

from __future__ import annotations

import json
import sys

import pytest

from neuron_ckpt.memory import ModelShape, TrainingSetup
from neuron_ckpt.memory.capture import Run, write_capture
from neuron_ckpt.memory.compare import layer_state_bytes, predicted_per_layer, predicted_saving
from neuron_ckpt.memory.readers import CONTIGUOUS_PAGE_BYTES, SCRATCHPAD_PAGE_BYTES, ReadError, explorer
from neuron_ckpt.memory.readers.detect import read_any, source_of
from neuron_ckpt.models import load_llama_config

from . import explorer_profiles as ep
from .helpers import neuron_ckpt_cli

MIB, GIB = 1 << 20, 1 << 30
JOB_CORES = [9, 10, 11, 12, 5, 6, 7, 8]  # rank r runs on JOB_CORES[r]
RANK0_EXTRA = {9: 256 * MIB}
JOB = {
    "model": "llama",
    "config": "llama2-7b",
    "tp": 8,
    "dp": 1,
    "seq": 4096,
    "micro_batch": 1,
    "dtype": "bf16",
    "sequence_parallel": True,
    "zero1": True,
    "attention": "flash",
}
SCRATCH_BASE, TENSORS_BASE = 3 * 512 * MIB, 2 * GIB
LAYERS = (4, 8, 12, 16)


def _one_line_error(read, path, message: str) -> None:
    with pytest.raises(ReadError) as exc:
        read(path)
    text = str(exc.value)
    assert message in text and "\n" not in text, text


def _profile(tmp_path, scratchpad=2112 * MIB, tensors=9 * GIB, **options):
    return ep.write_profile(tmp_path / "L16", ep.step_samples(scratchpad, tensors, JOB_CORES, RANK0_EXTRA), **options)


def test_every_hbm_is_a_core_with_its_largest_value_per_category(tmp_path):
    samples = ep.step_samples(2112 * MIB, 9 * GIB, JOB_CORES, RANK0_EXTRA)
    root = ep.write_profile(tmp_path / "L16", samples)
    assert sorted(p.name for p in explorer.parts(root, "SystemProfileHbmUsage")) == [
        f"SystemProfileHbmUsage_{k}.parquet" for k in range(3)
    ]
    reading = explorer.read(root)
    expected: dict[int, dict[str, int]] = {}  # the same rows, reduced in plain Python
    for row in ep.hbm_rows(samples):
        core = expected.setdefault(row["device_idx"] * 2 + row["hbm_idx"], {})
        for name, value in row.items():
            if name.endswith("_bytes"):
                core[name[:-6]] = max(core.get(name[:-6], 0), value)
    assert reading.cores == expected and sorted(reading.cores) == list(range(32))
    assert (reading.source, reading.kind, reading.samples) == ("neuron-explorer", "peak", 8)
    assert reading.core(9)["tensors"] == 9 * GIB + 256 * MIB and reading.core(5)["tensors"] == 9 * GIB
    assert reading.core(7)["shared_scratchpad"] == 2112 * MIB  # the step NEFF's, not the warm-up graph's
    assert reading.core(0)["tensors"] == reading.core(31)["shared_scratchpad"] == 0  # idle: the baseline only
    assert reading.core(0)["ucode_lib"] == ep.BASELINE["ucode_lib"]
    assert reading.quantum == CONTIGUOUS_PAGE_BYTES  # 64 MiB figures: the contiguous scratchpad's pages
    assert "8 of 32 HBMs hold tensors or scratchpad" in reading.notes[0] and "1.8 s" in reading.notes[0]


def test_the_page_is_512_mib_unless_a_figure_shows_64(tmp_path):
    samples = [ep.Sample(0.0, {4: {"shared_scratchpad": 2 * 512 * MIB, "tensors": GIB}}), ep.Sample(1.0)]
    reading = explorer.read(ep.write_profile(tmp_path / "p", samples, parts=1))
    assert reading.quantum == SCRATCHPAD_PAGE_BYTES and not any("pages" in n for n in reading.notes)
    assert reading.samples == 2 and reading.core(4)["shared_scratchpad"] == GIB


def _capture(root, excess: float = 1.0, schema: str = "7.4.0"):
    """Runs at 4-16 layers (none) and 16 (full): the scratchpad the model predicts per layer (times
    ``excess``) over a base, rounded up to 64 MiB pages; tensors growing by one layer's state."""
    model = ModelShape.from_llama(load_llama_config("llama2-7b"))
    setup = TrainingSetup(4096, 1, tp=8, dp=1, attention="flash")
    per_layer, state = predicted_per_layer(model, setup, "none", "neuron-explorer"), layer_state_bytes(model, setup)
    runs = []
    for layers, preset in [*((n, "none") for n in LAYERS), (16, "full")]:
        scratch = SCRATCH_BASE + round(layers * per_layer * excess)
        if preset == "full":
            scratch -= predicted_saving(model, setup, "none", "full", layers)
        pages = -(-scratch // CONTIGUOUS_PAGE_BYTES) * CONTIGUOUS_PAGE_BYTES
        samples = ep.step_samples(pages, TENSORS_BASE + layers * state, JOB_CORES, RANK0_EXTRA)
        ep.write_profile(root / f"{preset}_L{layers}", samples, schema_version=schema)
        runs.append(Run(layers, preset, "flash", {"explorer": f"{preset}_L{layers}"}))
    write_capture(root, JOB, runs)
    return root, per_layer, layer_state_bytes(model, setup)


def test_compare_agrees_with_a_true_prediction_on_the_jobs_cores(capsys, tmp_path):
    root, per_layer, state = _capture(tmp_path / "capture")
    code, out, err = neuron_ckpt_cli(capsys, "compare", "--capture", str(root), "--json")
    assert code == 0, err
    result = json.loads(out)
    assert result["source"] == "neuron-explorer" and result["agrees"]
    assert sorted(map(int, result["per_core"])) == sorted(JOB_CORES)  # not the 24 idle HBMs
    assert abs(result["measured_bytes_per_layer"] - per_layer) <= result["uncertainty_bytes_per_layer"]
    assert result["quantum"] == CONTIGUOUS_PAGE_BYTES and result["uncertainty_bytes_per_layer"] < 0.2 * per_layer
    assert result["control"]["ok"] and result["control"]["predicted"] == state
    assert result["savings"][0]["preset"] == "full" and result["savings"][0]["agrees"]
    code, out, _ = neuron_ckpt_cli(capsys, "compare", "--capture", str(root))
    assert "neuron-explorer: shared_scratchpad + scratchpad, page 64 MiB" in out and "control: tensors" in out


def test_compare_calls_a_30_percent_excess_a_disagreement(capsys, tmp_path):
    root, per_layer, _ = _capture(tmp_path / "capture", excess=1.3)
    code, out, err = neuron_ckpt_cli(capsys, "compare", "--capture", str(root), "--json")
    assert code == 1, err
    result = json.loads(out)
    assert not result["agrees"] and result["control"]["ok"]  # the method holds; the model is off
    assert abs(result["measured_bytes_per_layer"] - 1.3 * per_layer) <= result["uncertainty_bytes_per_layer"]
    assert "disagrees by +" in result["verdict"]


def test_compare_refuses_an_unknown_schema_in_one_line(capsys, tmp_path):
    root, _, _ = _capture(tmp_path / "capture", schema="12.0.1")
    code, _, err = neuron_ckpt_cli(capsys, "compare", "--capture", str(root))
    assert code == 2 and "profile schema 12.0.1" in err and "major version 7.x" in err and err.count("\n") == 1, err


def test_a_profile_directory_is_picked_by_what_it_holds(capsys, tmp_path):
    root, _, _ = _capture(tmp_path / "capture")
    assert source_of(root / "none_L4") == "explorer" and read_any(root / "none_L4").source == "neuron-explorer"
    runs = [f"--run={n}={root / f'none_L{n}'}" for n in LAYERS]
    code, out, err = neuron_ckpt_cli(capsys, "compare", "--config", "llama2-7b", "--tp", "8", "--seq", "4096", *runs)
    assert code == 0, err
    assert "verdict: agrees" in out
    raw = tmp_path / "inspect" / f"{ep.INSTANCE}_pid_4242" / "1766072156"
    raw.mkdir(parents=True)
    (raw / "ntrace.pb").write_bytes(b"\x08\x01")
    _one_line_error(source_of, tmp_path / "inspect", "a raw Neuron profile (ntrace.pb): ingest it first")
    (tmp_path / "ws/profiles/global/L8@latest").mkdir(parents=True)
    _one_line_error(source_of, tmp_path / "ws", "a Neuron Explorer workspace: pass one profile's directory")


def test_without_a_system_profile_the_per_core_summary_is_read(tmp_path):
    held = {
        "weights": 24 * MIB,
        "tensors": 5 * GIB,
        "shared_scratchpad": 2112 * MIB,
        "scratchpad": 0,
        "profiler_buffers": 2 * GIB,
        "dma_rings_io": MIB,
    }
    root = ep.write_summary(tmp_path / "device", {(2, 1): held, (3, 0): held})  # on-device core indices
    reading = explorer.read(root)
    assert (reading.kind, sorted(reading.cores)) == ("current", [5, 6])
    assert reading.core(5)["shared_scratchpad"] == 2112 * MIB and reading.core(6)["total"] == sum(held.values())
    assert reading.core(6)["dma_rings_io"] == MIB and "not a peak over the run" in reading.notes[0]
    wide = ep.write_summary(tmp_path / "wide", {(2, 5): held, (3, 6): held})  # instance-wide core indices
    assert sorted(explorer.read(wide).cores) == [5, 6]


def test_notes_say_what_the_profile_does_not(tmp_path):
    samples = ep.step_samples(2112 * MIB, 9 * GIB, [0, 1])
    samples[0].cores[0]["profiler_buffers"] = 2 * GIB
    warned = [("Missing Data", "Current NEFF is missing compiler metrics.")]
    root = ep.write_profile(tmp_path / "p", samples, schema_version=None, warnings=warned)
    ep.write_summary(root, {(0, 0): {"tensors": GIB, "shared_scratchpad": 0, "scratchpad": 0}})
    reading = explorer.read(root)
    assert reading.kind == "peak" and reading.core(0)["tensors"] == 9 * GIB  # the system profile's, not the snapshot
    notes = " | ".join(reading.notes)
    assert "HbmUsageSummaryByType is there too (a device profile ran)" in notes
    assert "profiler buffers on NeuronCores 0: a device profile ran" in notes
    assert "no Metadata table, so the profile schema version is unknown" in notes
    assert "Warning: 1 ingestion warnings, the first: [Missing Data] Current NEFF is missing" in notes
    trn2 = explorer.read(ep.write_profile(tmp_path / "trn2", samples, devices=2, hbms=4))
    assert sorted(trn2.cores) == list(range(8)) and "at LNC=1 two cores share an HBM" in " ".join(trn2.notes)


def _gap(root):
    (root / "SystemProfileHbmUsage_1.parquet").unlink()
    return root


def _drop_column(root):
    import pyarrow.parquet as pq

    for part in explorer.parts(root, "SystemProfileHbmUsage"):
        pq.write_table(pq.read_table(part).drop_columns(["tensors_bytes"]), part)
    return root


def _two_instances(root):
    ep.write_table(
        root, "SystemProfileHbmUsage_3", ep.hbm_rows([ep.Sample(9.0)], instance="i-0fffffffffffffff0"), ep.SCHEMA
    )
    return root


def _not_parquet(root):
    (root / "SystemProfileHbmUsage_2.parquet").write_text("PAR1 cut short")
    return root


def _no_memory_tables(root):
    for part in explorer.parts(root, "SystemProfileHbmUsage"):
        part.unlink()
    return root


@pytest.mark.parametrize(
    "change, message",
    [
        (_gap, "SystemProfileHbmUsage parts [0, 2]: one is missing"),
        (_drop_column, "SystemProfileHbmUsage_0.parquet: no column tensors_bytes"),
        (_two_instances, "HBM rows of 2 instances (i-0a1b2c3d4e5f60718, i-0fffffffffffffff0)"),
        (_not_parquet, "SystemProfileHbmUsage_2.parquet: not a Parquet table"),
        (_no_memory_tables, "an Explorer profile without SystemProfileHbmUsage or HbmUsageSummaryByType"),
    ],
    ids=["missing-part", "missing-column", "two-instances", "not-parquet", "sdk-2.28"],
)
def test_bad_profiles_are_one_line_naming_the_file(tmp_path, change, message):
    _one_line_error(explorer.read, change(_profile(tmp_path)), message)


def test_without_pyarrow_the_error_names_the_extra(tmp_path, monkeypatch):
    root = _profile(tmp_path)
    for name in [m for m in sys.modules if m == "pyarrow" or m.startswith("pyarrow.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # import pyarrow raises ImportError
    _one_line_error(explorer.read, root, "needs pyarrow: pip install 'neuron_ckpt[profiler]'")
