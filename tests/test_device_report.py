"""``scripts/device_report.py --tiny``: the device report's plumbing on CPU, so it cannot rot between lendings.

The script runs in a subprocess (its one-rank world and torch.compile state stay out of this
process), once at the tests' TINY Llama, and the tests read what it wrote: the JSON schema, a
memory row for every (layer count, attention, preset), a per-layer row for each pair, every
documented speed row, the markdown section. Figures are not checked against goals (CPU timings
say nothing of a device), but where CPU knows the answer exactly it is asserted: what autograd
keeps (``SavedTensorRecorder``) equals the budget's activation bytes to the byte, and the
per-layer slope by difference equals the analytic per-layer figure to the byte (both are the
Llama terms tests/test_memory_llama.py measures exactly). Then: a zero time budget skips every
stage and still writes the report, and bad input is refused in one line before any work.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from neuron_ckpt.recompute import PRESETS

from .helpers import REPO, TINY, neuron_ckpt_cli

SCRIPT = REPO / "scripts" / "device_report.py"
TIMEOUT_S = 300  # a bound, not the expected time: about 15 s on 2 idle cores
ATTENTIONS = ("flash", "explicit")
SPEED_NAMES = [
    *(f"{a}: {p} / none" for a in ("explicit", "flash") for p in PRESETS[1:]),
    "flash / explicit", "compiled / eager", "hf checkpointing / ours planned", "mfu: flash none",
]  # fmt: skip


def _run(*args: str | Path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(SCRIPT), *map(str, args)]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT_S)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("device_report")
    done = _run("--tiny", "--out", out)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return out, json.loads((out / "device_report.json").read_text())


def test_report_names_the_run(tiny) -> None:
    _, r = tiny
    assert r["schema"] == 1 and r["mode"] == "tiny"
    assert r["device"]["type"] == "cpu" and r["device"]["peak_tflops_bf16"] > 0
    assert r["torch"] == torch.__version__
    assert r["command"].startswith("python scripts/device_report.py --tiny --out ")
    # The tiny job is the suite's TINY Llama (at its longest sequence), and its two layer counts.
    s = r["shape"]
    assert (s["hidden"], s["heads"], s["kv_heads"], s["ffn"], s["vocab"], s["seq"]) == (
        TINY["hidden_size"], TINY["num_attention_heads"], TINY["num_key_value_heads"],
        TINY["intermediate_size"], TINY["vocab_size"], TINY["max_position_embeddings"],
    )  # fmt: skip
    assert s["layers"] == [TINY["num_hidden_layers"] // 2, TINY["num_hidden_layers"]]
    assert r["skipped"] == [] and r["errors"] == []


def test_memory_rows_cover_every_job_and_match_the_budget(tiny) -> None:
    _, r = tiny
    rows = {(m["layers"], m["attention"], m["preset"]): m for m in r["memory"]}
    assert len(rows) == len(r["memory"]) == 2 * len(ATTENTIONS) * len(PRESETS)
    for layers in r["shape"]["layers"]:
        for attention in ATTENTIONS:
            for preset in PRESETS:
                m = rows[(layers, attention, preset)]
                assert m["measured"] is True
                assert m["device_peak_bytes"] is None and m["peak_over_budget"] is None and m["within_goal"] is None
                assert m["budget_total_bytes"] > m["budget_activation_peak_bytes"] >= m["budget_activation_bytes"] > 0
                assert m["measured_activation_bytes"] == m["budget_activation_bytes"], (layers, attention, preset)
                assert isinstance(m["budget_workspace"], str) and m["budget_workspace"]
            none, full = rows[(layers, attention, "none")], rows[(layers, attention, "full")]
            assert full["budget_activation_bytes"] < none["budget_activation_bytes"]
            # At tiny shapes the optimizer step's transient is the peak whatever the recompute: equal totals.
            assert full["budget_total_bytes"] <= none["budget_total_bytes"]
        # Explicit attention keeps the s x s probabilities that flash never makes.
        assert (
            rows[(layers, "explicit", "none")]["budget_activation_bytes"]
            > rows[(layers, "flash", "none")]["budget_activation_bytes"]
        )


def test_per_layer_by_difference_equals_the_analytic_figure(tiny) -> None:
    out, r = tiny
    rows = {(p["attention"], p["preset"]): p for p in r["per_layer"]}
    assert len(rows) == len(r["per_layer"]) == len(ATTENTIONS) * len(PRESETS)
    for (attention, preset), p in rows.items():
        assert p["source"] == "recorder" and p["layers"] == r["shape"]["layers"]  # CPU has no allocator stats
        assert p["measured_per_layer_bytes"] == p["predicted_per_layer_bytes"] == p["budget_per_layer_bytes"] > 0
        assert p["agrees"] is True and p["within_goal"] is True and p["ratio"] == 1.0
        for layers in p["layers"]:  # the files neuron-ckpt compare --run LAYERS=PATH reads
            assert (out / "saved" / f"{attention}-{preset}-L{layers}.json").is_file()
    assert rows[("explicit", "none")]["measured_per_layer_bytes"] > rows[("flash", "none")]["measured_per_layer_bytes"]


def test_neuron_ckpt_compare_reads_the_files(tiny, capsys) -> None:
    out, r = tiny
    lo, hi = r["shape"]["layers"]
    per_layer = next(p for p in r["per_layer"] if (p["attention"], p["preset"]) == ("explicit", "selective"))
    code, text, err = neuron_ckpt_cli(
        capsys, "compare", "--config", str(out / "config.json"), "--seq", str(r["shape"]["seq"]),
        "--no-sequence-parallel", "--attention", "explicit", "--recompute", "selective", "--json",
        "--run", f"{lo}={out / 'saved' / f'explicit-selective-L{lo}.json'}",
        "--run", f"{hi}={out / 'saved' / f'explicit-selective-L{hi}.json'}",
    )  # fmt: skip
    assert code == 0, err
    assert json.loads(text)["measured_bytes_per_layer"] == per_layer["measured_per_layer_bytes"]


def test_every_speed_row_is_measured(tiny) -> None:
    _, r = tiny
    assert [s["name"] for s in r["speed"]] == SPEED_NAMES
    for s in r["speed"]:
        assert isinstance(s["ratio"], float) and s["ratio"] > 0, s
        assert isinstance(s["median_ratio"], float) and s["median_ratio"] > 0, s
        assert isinstance(s["within_goal"], bool) == (s["goal"] is not None), s
    by_name = {s["name"]: s for s in r["speed"]}
    # Each preset's recompute adds forward FLOPs; full reruns the whole layer, the most.
    assert by_name["explicit: full / none"]["flops_ratio"] > by_name["explicit: selective / none"]["flops_ratio"] > 1
    assert by_name["explicit: selective / none"]["goal"] == "<= 1.03"
    assert r["details"]["ours_saved_bytes"] <= r["details"]["hf_saved_bytes"]
    assert r["details"]["compile_s"] > 0
    offload = r["details"]["offload"]  # bench_offload.measure: the MLP of every layer but the last
    assert offload["offloaded_bytes_per_step"] == offload["kept_bytes"]["plain"] - offload["kept_bytes"]["offload"] > 0
    assert (
        offload["host_link"]["d2h_gbps"] > 0 and offload["host_link"]["h2d_gbps"] > 0 and offload["matmul_tflops"] > 0
    )


def test_markdown_section_is_written_beside_the_json(tiny) -> None:
    out, r = tiny
    text = (out / "device-figures.md").read_text()
    assert text.startswith("# Device figures\n")
    assert f"## {r['date'][:10]}: " in text and r["command"] in text
    for name in SPEED_NAMES:
        assert f"| {name} |" in text
    assert text.count("| 2 | explicit |") == len(PRESETS)
    link = r["details"]["offload"]["host_link"]
    assert f"neuron-ckpt plan --host-link {link['d2h_gbps']:.1f},{link['h2d_gbps']:.1f} --device-tflops" in text


def test_a_spent_budget_skips_every_stage_and_still_reports(tmp_path: Path) -> None:
    done = _run("--tiny", "--out", tmp_path, "--budget-s", "0")
    assert done.returncode == 0, done.stderr[-4000:]
    r = json.loads((tmp_path / "device_report.json").read_text())
    assert len(r["skipped"]) == 8 and r["errors"] == []
    assert all(m["measured"] is False and m["budget_total_bytes"] > 0 for m in r["memory"])
    assert r["per_layer"] == [] and all(s["ratio"] is None for s in r["speed"])
    assert "Skipped:" in (tmp_path / "device-figures.md").read_text()


def test_refusals_come_in_one_line_before_any_work(tmp_path: Path) -> None:
    if not torch.accelerator.is_available():
        done = _run("--out", tmp_path / "device")
        assert done.returncode == 2 and done.stdout == ""
        assert done.stderr.strip().splitlines() == [
            (
                "device_report.py: no accelerator is visible to torch (torch.accelerator.is_available() is False); "
                "--tiny is the CPU mode"
            )
        ]
        assert not (tmp_path / "device").exists()
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    done = _run("--tiny", "--out", blocker / "out")
    assert done.returncode == 2 and done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"device_report.py: --out {blocker / 'out'}: cannot write there")
