"""``neuron-ckpt memory``: JSON fields, a real measurement at tp 2, the plot, one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

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
    report = _run_json(
        capsys,
        "--hidden",
        "12288",
        "--heads",
        "96",
        "--seq",
        "2048",
        "--tp",
        "8",
        "--sequence-parallel",
        "--recompute",
        "selective",
    )
    assert round(100 * report["saving_vs_no_recompute"]) == 70


def test_measure_at_tp2_is_within_2_percent_and_the_plot_is_a_png(capsys, tmp_path):
    png = tmp_path / "memory.png"
    report = _run_json(
        capsys, *SMALL, "--tp", "2", "--sequence-parallel", "--recompute", "selective", "--measure", "--plot", str(png)
    )
    assert abs(report["measured_over_analytic"] - 1) <= 0.02
    assert len(report["measured_per_rank"]) == 2
    assert report["plot"] == str(png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_table_output_for_llama(capsys):
    assert (
        main(
            [
                "memory",
                "--model",
                "llama",
                *SMALL,
                "--kv-heads",
                "2",
                "--tp",
                "2",
                "--recompute",
                "full",
                "--layers",
                "32",
            ]
        )
        == 0
    )
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


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--hidden", "128", "--heads", "8", "--seq", "64", "--attention", "flash"], "llama only"),
        (["--model", "llama", "--hidden", "128", "--heads", "8", "--seq", "64", "--attention", "sdpa"], "--attention"),
        (["--hidden", "100", "--heads", "8", "--seq", "64"], "heads"),  # does not divide
        (["--hidden", "128", "--heads", "8", "--seq", "64", "--tp", "3"], "tp"),
        (["--hidden", "128", "--heads", "8", "--seq", "-64"], "--seq"),
        (["--model", "bert", "--hidden", "128", "--heads", "8", "--seq", "64"], "--model"),
        (["--hidden", "128", "--heads", "8", "--seq", "66", "--tp", "4", "--sequence-parallel"], "seq_len"),
        (
            [
                "--hidden",
                "128",
                "--heads",
                "8",
                "--seq",
                "64",
                "--tp",
                "2",
                "--recompute",
                "selective",
                "--distribute-saved-activations",
            ],
            "distribute_saved_activations",
        ),
        (
            [
                "--hidden",
                "128",
                "--heads",
                "8",
                "--seq",
                "64",
                "--tp",
                "2",
                "--sequence-parallel",
                "--recompute",
                "full",
                "--distribute-saved-activations",
            ],
            "sequence_parallel",
        ),
    ],
)
def test_bad_input_is_one_line_and_exit_2(capsys, args, needle):
    _exits_2_with_one_line(capsys, args, needle)


def _exits_2_with_one_line(capsys, args: list[str], needle: str) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["memory", *args])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and needle in err, err


def test_bad_input_from_the_command_line_has_no_traceback():
    proc = subprocess.run(
        [sys.executable, "-m", "neuron_ckpt.cli", "memory", "--hidden", "128", "--heads", "6", "--seq", "64"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stdout == "" and len(proc.stderr.strip().splitlines()) == 1
    assert "Traceback" not in proc.stderr and "heads" in proc.stderr


# --- --config: transformers MoE models (neuron_ckpt.memory.moe) --------------------------------

TINY_QWEN3 = {
    "model_type": "qwen3_moe", "vocab_size": 128, "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "moe_intermediate_size": 32, "intermediate_size": 96, "num_experts": 4,
    "num_experts_per_tok": 2, "norm_topk_prob": True, "mlp_only_layers": [0],
}  # fmt: skip


def test_config_presets_print_each_layer_kind_under_every_module(capsys):
    """Mixtral 8x7B has MoE layers only; DeepSeek-V3 3 dense and 58 MoE layers; a module a kind
    lacks is null there and leaves those layers as they are in the total."""
    from neuron_ckpt.memory.moe import CHOICES, MoESetup, layer_memory, load_moe_config

    mixtral = _run_json(capsys, "--config", "mixtral-8x7b", "--seq", "4096", "--tp", "8")
    shape, setup = load_moe_config("mixtral-8x7b"), MoESetup(4096, 1, 8)
    assert list(mixtral["per_layer_bytes"]) == ["moe"] and list(mixtral["per_layer_bytes"]["moe"]) == list(CHOICES)
    assert mixtral["per_layer_bytes"]["moe"]["moe_act"] == layer_memory(shape, setup, "moe_act").nbytes
    assert mixtral["per_layer_bytes"]["moe"]["mlp"] is None
    assert mixtral["layers_total_bytes"]["none"] == 32 * mixtral["per_layer_bytes"]["moe"]["none"]
    assert mixtral["outside_autograd_bytes"]["moe"]["moe"] == 8 * 4096 * 2  # the replayed top-2 indices

    deepseek = _run_json(capsys, "--config", "deepseek-v3", "--seq", "4096", "--tp", "8", "--experts", "eager")
    per = deepseek["per_layer_bytes"]
    assert deepseek["spec"]["dense_layers"] == 3 and deepseek["spec"]["experts"] == "eager"
    assert per["dense"]["moe"] is None and per["moe"]["mlp"] is None and per["dense"]["mla_up_proj"] is not None
    assert deepseek["layers_total_bytes"]["moe"] == 3 * per["dense"]["none"] + 58 * per["moe"]["moe"]

    assert main(["memory", "--config", "deepseek-v3", "--seq", "1024", "--attention", "eager"]) == 0
    out = capsys.readouterr().out
    assert "dense layer" in out and "moe layer" in out and "mla_up_proj" in out and "eager attention" in out


def test_config_with_sequence_parallel(capsys):
    """--sequence-parallel with --config prices apply_tensor_parallel(sequence_parallel=True): the
    spec and the table say so, the figures are layer_memory's, and only the token-wise terms (the
    layer's input, the norms, the residual) shrink, to s/t tokens; full keeps the s/t-token input."""
    from neuron_ckpt.memory.moe import MoESetup, layer_memory, load_moe_config

    args = ("--config", "mixtral-8x7b", "--seq", "4096", "--tp", "8")
    tp, sp = _run_json(capsys, *args), _run_json(capsys, *args, "--sequence-parallel")
    assert (tp["spec"]["sequence_parallel"], sp["spec"]["sequence_parallel"]) == (False, True)
    shape, setup = load_moe_config("mixtral-8x7b"), MoESetup(4096, 1, 8, sequence_parallel=True)
    assert sp["per_layer_bytes"]["moe"]["moe_act"] == layer_memory(shape, setup, "moe_act").nbytes
    assert sp["per_layer_bytes"]["moe"]["full"] == 2 * 4096 * 4096 // 8 + 8 * 4096 * 2  # input s/t, indices all s
    token_wise = ("layer_input", "norm1.", "norm2.", "residual")
    for kept_tp, kept_sp in zip(tp["breakdown"]["moe"], sp["breakdown"]["moe"]):
        assert kept_tp["name"] == kept_sp["name"]
        shrinks = kept_tp["name"].startswith(token_wise)
        assert kept_sp["nbytes"] == kept_tp["nbytes"] // (8 if shrinks else 1), kept_tp["name"]
        assert kept_sp["split_by_tp"] == (shrinks or kept_tp["split_by_tp"]), kept_tp["name"]
    assert main(["memory", *args, "--sequence-parallel"]) == 0
    assert "t=8 (the model's TP plan, sequence parallel)" in capsys.readouterr().out


def _gemma2_dir(tmp_path) -> Path:
    """transformers' own save_pretrained files of a tiny Gemma2: sliding and full layers (window 8),
    soft-capped eager attention, four norms a layer."""
    import transformers

    transformers.Gemma2Config(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
                              max_position_embeddings=128).save_pretrained(tmp_path)  # fmt: skip
    return tmp_path


def test_config_of_a_dense_family_prices_each_layer_kind_in_its_attention(capsys, tmp_path):
    """A dense family's file: its kinds are its attention variants, the attention defaults to what
    transformers runs (eager for Gemma2), the MoE modules are left out of the table; sdpa is
    refused in one line."""
    report = _run_json(capsys, "--config", str(_gemma2_dir(tmp_path)), "--seq", "16", "--tp", "2")
    assert report["spec"]["attention"] == "eager" and report["spec"]["kinds"] == {"dense/sliding": 1, "dense": 1}
    assert report["per_layer_bytes"]["dense"]["moe"] is None and "use_cache" in report["notices"][0]
    assert main(["memory", "--config", str(tmp_path), "--seq", "16"]) == 0
    table = capsys.readouterr().out
    assert "dense/sliding layer" in table and "\nmoe " not in table and "experts" not in table.splitlines()[2]
    _exits_2_with_one_line(capsys, ["--config", str(tmp_path), "--seq", "16", "--attention", "sdpa"], "eager only")


def test_config_measure_runs_one_layer_of_each_kind_on_tp_ranks(capsys, tmp_path, monkeypatch, world):
    """--measure with --config: one real layer of each kind on --tp gloo ranks under every module;
    what autograd keeps there is the analytic figure to the byte, on both ranks. (On the test
    session's pool of ranks: the command's own spawn is the one ``--model llama --measure`` runs.)"""
    from neuron_ckpt.distributed import local

    monkeypatch.setattr(local, "run_local", lambda fn, n, *a, **k: world(n).run(fn, *a, **k))
    args = ("--config", str(_gemma2_dir(tmp_path)), "--seq", "16", "--micro-batch", "2", "--tp", "2")
    report = _run_json(capsys, *args, "--sequence-parallel", "--measure")
    assert list(report["measured"]) == ["dense/sliding", "dense"]
    for kind, rows in report["measured"].items():
        assert set(rows) == {c for c, v in report["per_layer_bytes"][kind].items() if v is not None}
        for choice, row in rows.items():
            assert row["per_rank"] == [row["measured"]] * 2 and row["measured"] == row["analytic"], (kind, choice)
            assert row["analytic"] == report["per_layer_bytes"][kind][choice]  # a dense layer: nothing outside autograd


def test_config_file_or_directory_and_the_dropped_quantization_notice(capsys, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY_QWEN3))
    report = _run_json(capsys, "--config", str(tmp_path), "--seq", "16", "--tp", "2", "--dtype", "fp32")
    assert report["spec"]["dense_layers"] == 1 and report["model"]["head_dim"] == 16 and report["notices"] == []
    quantized = json.loads((Path(__file__).parents[1] / "neuron_ckpt/memory/moe/presets/deepseek-v3.json").read_text())
    quantized["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    (tmp_path / "ds.json").write_text(json.dumps(quantized))
    assert main(["memory", "--config", str(tmp_path / "ds.json"), "--seq", "64"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert "quantization_config dropped" in first


@pytest.mark.parametrize("change,needle", [
    ({"num_hidden_layers": None, "num_hiden_layers": 3}, "is 'num_hiden_layers' a misspelling of it?"),
    ({"moe_intermediate_size": None}, "missing key 'moe_intermediate_size'"),
    ({"hidden_size": "64"}, "hidden_size"),
    ({"hidden_act": "relu"}, "the activation is 'relu'"),
    ({"model_type": "bert"}, "this reads the families ['llama'"),
    ({"num_experts_per_tok": 8}, "top_k"),
])  # fmt: skip
def test_bad_config_files_are_one_line_and_exit_2(capsys, tmp_path, change, needle):
    data = {k: v for k, v in {**TINY_QWEN3, **change}.items() if v is not None}
    (tmp_path / "config.json").write_text(json.dumps(data))
    _exits_2_with_one_line(capsys, ["--config", str(tmp_path / "config.json"), "--seq", "16"], needle)


@pytest.mark.parametrize("args,needle", [
    (["--config", "mixtral-8x7b", "--seq", "64", "--hidden", "128"], "drop --hidden"),
    (["--config", "mixtral-8x7b", "--seq", "64", "--recompute", "full", "--measure"], "drop --recompute"),
    (["--config", "llama2-7b", "--seq", "64", "--experts", "eager"], "--experts: llama has no experts"),
    (["--config", "mixtral-8x7b", "--seq", "64", "--plot", "x.png"], "drop --plot"),
    (["--config", "mixtral-8x7b", "--seq", "64", "--attention", "flash"], "sdpa"),
    (["--config", "mixtral-8x7b", "--seq", "64", "--tp", "16"], "kv_heads"),
    (["--config", "mixtral-8x7b", "--seq", "60", "--tp", "8", "--sequence-parallel"],
     "seq_len (60) must be a multiple of tp (8) when sequence_parallel is True"),
    (["--config", "no-such-model", "--seq", "64"], "or preset (deepseek-v3, llama2-70b"),
    (["--hidden", "128", "--heads", "8", "--seq", "64", "--experts", "eager"], "--experts"),
    (["--heads", "8", "--seq", "64"], "--hidden is required"),
])  # fmt: skip
def test_bad_config_options_are_one_line_and_exit_2(capsys, args, needle):
    _exits_2_with_one_line(capsys, args, needle)
