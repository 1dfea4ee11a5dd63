"""``neuron-ckpt memory``: JSON fields, a real measurement at tp 2, the plot, one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from neuron_ckpt.cli import main

SMALL = ["--hidden", "128", "--heads", "8", "--seq", "64", "--micro-batch", "2"]


def _run_json(capsys, *args: str) -> dict:
    assert main(["memory", *args, "--json"]) == 0
    out = capsys.readouterr().out
    assert len(out.strip().splitlines()) == 1, "--json prints one JSON object"
    return json.loads(out)


def test_json_has_the_analytic_figures_and_breakdown(capsys):
    report = _run_json(capsys, *SMALL, "--tp", "2", "--sequence-parallel", "--recompute", "selective")
    s, b, h, t = 64, 2, 128, 2
    assert report["analytic_bytes_per_layer"] == s * b * h * 34 // t  # sbh(34/t)
    assert report["paper_formula"] == "sbh(34/t)"
    assert sum(term["nbytes"] for term in report["breakdown"]) == report["analytic_bytes_per_layer"]
    assert report["vs_no_recompute"]["none"] == 1.0
    assert "measured_bytes_per_layer" not in report


def test_gpt3_selective_recompute_is_a_70_percent_saving(capsys):
    report = _run_json(capsys, "--hidden", "12288", "--heads", "96", "--seq", "2048", "--tp", "8",
                       "--sequence-parallel", "--recompute", "selective")
    assert round(100 * report["saving_vs_no_recompute"]) == 70


def test_measure_at_tp2_is_within_2_percent_and_the_plot_is_a_png(capsys, tmp_path):
    png = tmp_path / "memory.png"
    report = _run_json(capsys, *SMALL, "--tp", "2", "--sequence-parallel", "--recompute", "selective",
                       "--measure", "--plot", str(png))
    assert abs(report["measured_over_analytic"] - 1) <= 0.02
    assert len(report["measured_per_rank"]) == 2
    assert report["plot"] == str(png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_table_output_for_llama(capsys):
    assert main(["memory", "--model", "llama", *SMALL, "--kv-heads", "2", "--tp", "2", "--recompute", "full",
                 "--layers", "32"]) == 0
    out = capsys.readouterr().out
    assert "recompute=full" in out and "layer_input" in out and "<- this run" in out
    assert "selective+mlp_act" in out  # every preset is compared; for Llama all four


def test_flash_attention_is_named_and_measured(capsys):
    """--attention flash: the spec names it, the probabilities become an fp32 logsumexp, and two
    real layers on 2 ranks keep exactly that."""
    args = ("--model", "llama", *SMALL, "--kv-heads", "2", "--tp", "2", "--sequence-parallel")
    report = _run_json(capsys, *args, "--attention", "flash", "--measure")
    assert report["spec"]["attention"] == "flash"
    terms = {term["name"]: term["nbytes"] for term in report["breakdown"]}
    assert "probs" not in terms and terms["softmax_lse_fp32"] == 4 * 8 // 2 * 64 * 2  # fp32 [b, a/t, s]
    assert report["measured_over_analytic"] == 1.0
    explicit = _run_json(capsys, *args)
    assert explicit["spec"]["attention"] == "explicit" and "probs" in {t["name"] for t in explicit["breakdown"]}


@pytest.mark.parametrize("args,needle", [
    (["--hidden", "128", "--heads", "8", "--seq", "64", "--attention", "flash"], "llama only"),
    (["--model", "llama", "--hidden", "128", "--heads", "8", "--seq", "64", "--attention", "sdpa"], "--attention"),
    (["--hidden", "100", "--heads", "8", "--seq", "64"], "heads"),  # does not divide
    (["--hidden", "128", "--heads", "8", "--seq", "64", "--tp", "3"], "tp"),
    (["--hidden", "128", "--heads", "8", "--seq", "-64"], "--seq"),
    (["--model", "bert", "--hidden", "128", "--heads", "8", "--seq", "64"], "--model"),
    (["--hidden", "128", "--heads", "8", "--seq", "66", "--tp", "4", "--sequence-parallel"], "seq_len"),
    (["--hidden", "128", "--heads", "8", "--seq", "64", "--tp", "2", "--recompute", "selective",
      "--distribute-saved-activations"], "distribute_saved_activations"),
    (["--hidden", "128", "--heads", "8", "--seq", "64", "--tp", "2", "--sequence-parallel", "--recompute", "full",
      "--distribute-saved-activations"], "sequence_parallel"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, args, needle):
    with pytest.raises(SystemExit) as exc:
        main(["memory", *args])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and needle in err, err


def test_bad_input_from_the_command_line_has_no_traceback():
    proc = subprocess.run(
        [sys.executable, "-m", "neuron_ckpt.cli", "memory", "--hidden", "128", "--heads", "6", "--seq", "64"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stdout == "" and len(proc.stderr.strip().splitlines()) == 1
    assert "Traceback" not in proc.stderr and "heads" in proc.stderr
