"""``scripts/memory_table.py``: the table of docs/memory.md, analytic only (measurement is
tests/test_memory_llama.py's): every row, the Llama-2 7B anchor, idempotent ``--markdown``."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from neuron_ckpt.cli import main as cli_main
from neuron_ckpt.memory import TrainingSetup, layer_activation_bytes
from neuron_ckpt.recompute import PRESETS

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "memory_table.py"
ANCHOR = 67_375_104  # Llama-2 7B, s = 4096, t = 8, sequence parallel, selective: 64.254 MiB


@pytest.fixture(scope="module")
def table():
    spec = importlib.util.spec_from_file_location("memory_table", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


@pytest.fixture(scope="module")
def rows(table):
    return table.build_table(measure=False)


def test_every_preset_row_for_both_models_and_attentions(rows):
    both = [(sp, a, p) for sp in (False, True) for a in ("explicit", "flash") for p in PRESETS]
    expected = {("llama2-7b", 4096, 8, *rest) for rest in both}
    expected |= {("llama3-8b", 8192, t, *rest) for t in (8, 32) for rest in both}
    got = [(r.preset, r.seq_len, r.tp, r.sequence_parallel, r.attention, r.recompute) for r in rows]
    assert sorted(got) == sorted(expected)
    assert all(r.measured_bytes is None for r in rows)
    for row in rows:  # flash keeps less than explicit without recompute, the same under the recompute presets
        twin = next(r for r in rows if r.config == row.config and r.recompute == row.recompute and r is not row)
        if row.attention == "flash" and row.recompute == "none":
            assert row.analytic_bytes < twin.analytic_bytes
        elif row.attention == "flash" and row.recompute != "selective":
            assert row.analytic_bytes == twin.analytic_bytes


def test_longest_sequence_that_fits_a_trn1_core(table):
    """The reference recipe (Llama-3 8B, s = 8192, TP 8) fits without recompute only with flash."""
    fits = {(r.preset, r.attention, r.recompute): r.longest_seq for r in table.fit_lengths()}
    assert ("llama3-8b", "flash", "selective") not in fits  # not offered
    assert fits[("llama3-8b", "flash", "none")] >= 8192 > fits[("llama3-8b", "explicit", "none")]
    model = table.model_shape("llama3-8b")
    longest = fits[("llama3-8b", "flash", "none")]
    budget = table.memory_budget(model, table.fit_setup(longest, "flash"), "none").total_bytes
    beyond = table.memory_budget(model, table.fit_setup(longest + table.SEQ_STEP, "flash"), "none").total_bytes
    assert budget <= table.fit_limit_bytes() < beyond
    for key, longest in fits.items():
        if key[2] == "full":
            assert longest >= fits[(*key[:2], "none")]


def test_llama2_anchor_equals_the_api_and_the_cli(table, rows, capsys):
    (row,) = [
        r
        for r in rows
        if r.preset == "llama2-7b" and r.sequence_parallel and r.recompute == "selective" and r.attention == "explicit"
    ]
    setup = TrainingSetup(4096, micro_batch=1, tp=8, dtype="bf16", sequence_parallel=True)
    assert row.analytic_bytes == layer_activation_bytes(table.model_shape("llama2-7b"), setup, "selective") == ANCHOR
    assert "| 67,375,104 | 64.254 |" in table.format_table(rows)
    assert (
        cli_main(
            [
                "memory",
                "--model",
                "llama",
                "--hidden",
                "4096",
                "--heads",
                "32",
                "--kv-heads",
                "32",
                "--ffn",
                "11008",
                "--seq",
                "4096",
                "--micro-batch",
                "1",
                "--tp",
                "8",
                "--sequence-parallel",
                "--recompute",
                "selective",
                "--dtype",
                "bf16",
                "--json",
            ]
        )
        == 0
    )
    assert json.loads(capsys.readouterr().out)["analytic_bytes_per_layer"] == row.analytic_bytes


def test_markdown_block_is_replaced_idempotently(table, rows, tmp_path):
    doc = tmp_path / "memory.md"
    doc.write_text(f"# Title\n\nbefore\n\n{table.BEGIN}\nold table\n{table.END}\n\nafter\n", encoding="utf-8")
    table.check_markdown(str(doc))
    block = table.format_table(rows)
    table.write_markdown(str(doc), block)
    once = doc.read_text(encoding="utf-8")
    table.write_markdown(str(doc), block)
    assert doc.read_text(encoding="utf-8") == once
    assert once.startswith("# Title\n\nbefore\n\n") and once.endswith("\n\nafter\n")
    assert "old table" not in once and block in once


def test_markdown_without_markers_is_refused_before_measuring(table, tmp_path):
    doc = tmp_path / "plain.md"
    doc.write_text("# no markers\n", encoding="utf-8")
    with pytest.raises(ValueError, match="--markdown .*markers"):
        table.check_markdown(str(doc))
    with pytest.raises(ValueError, match="no such file"):
        table.check_markdown(str(tmp_path / "missing.md"))
    with pytest.raises(SystemExit):  # argparse: one line on stderr, exit 2, nothing measured
        table.main(["--measure", "--markdown", str(doc)])
