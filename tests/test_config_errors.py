"""Nothing is silently lost: model config typos, options that do not apply, and the
``neuron-ckpt`` promise (every error: one line on stderr, exit status 2).

- ``load_llama_config``: unknown keys (with the closest valid name), missing required keys, wrong
  types, what the model does not build, invalid JSON (file and line) are ValueErrors; real Hugging
  Face configs load, into the ``LlamaArgs`` that transformers' reading of the same file gives.
- NxD's example configs load: their training options are dropped with one notice naming them.
- ``train.py``: the data's block length against ``max_position_embeddings`` (raised with a
  notice, as NxD does, unless that changes the RoPE tables); options given
  without the option they act with (``--recompute-method`` without ``--recompute full`` ...).
- ``neuron-ckpt plan`` / ``memory``: refused options, non-finite numbers, a reserve as large as
  the device, config file errors, ``--plot`` into a directory that is not there.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import transformers

from neuron_ckpt.models import LlamaArgs, load_llama_config
from neuron_ckpt.models.config_file import PRESETS_DIR

from .helpers import TINY, neuron_ckpt_cli, tiny_config
from .tutorial_run import TUTORIAL
from .tutorial_run import train_module as _train_module


def _write(tmp_path: Path, data, name: str = "config.json") -> Path:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data, indent=2))
    return path


def _error(path: Path) -> str:
    with pytest.raises(ValueError) as exc:
        load_llama_config(path)
    return str(exc.value)


# ---- load_llama_config ------------------------------------------------------------------------


def test_a_typo_names_the_key_and_the_closest_valid_name(tmp_path):
    data = {k: v for k, v in TINY.items() if k != "num_hidden_layers"} | {"num_hiden_layers": 4}
    message = _error(_write(tmp_path, data))
    assert str(tmp_path / "config.json") in message
    assert "unknown key 'num_hiden_layers'" in message and "did you mean 'num_hidden_layers'" in message
    assert "missing key 'num_hidden_layers'" in message  # and what LlamaConfig would have used instead
    assert "32" in message


@pytest.mark.parametrize(
    "key", ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"]
)
def test_a_missing_shape_key_is_an_error(tmp_path, key):
    message = _error(_write(tmp_path, {k: v for k, v in TINY.items() if k != key}))
    assert f"missing key {key!r}" in message


def test_an_unknown_key_without_a_near_name(tmp_path):
    assert "unknown key 'banana'" in _error(_write(tmp_path, TINY | {"banana": 1}))


@pytest.mark.parametrize("key, value, needle", [
    ("hidden_size", "64", "hidden_size must be a positive integer, got '64' (str)"),
    ("num_hidden_layers", 2.0, "num_hidden_layers must be a positive integer"),
    ("vocab_size", 0, "vocab_size must be a positive integer"),
    ("tie_word_embeddings", "false", "tie_word_embeddings must be true or false"),
    ("rms_norm_eps", 0, "rms_norm_eps must be a number > 0"),
    ("max_position_embeddings", None, "max_position_embeddings must be a positive integer"),
    ("model_type", "mistral", "model_type is 'mistral'"),
    ("num_key_value_heads", 3, "num_key_value_heads (3) must divide num_attention_heads (4)"),
    ("hidden_act", "gelu", "hidden_act must be 'silu' (SwiGLU), got 'gelu'"),
    ("pretraining_tp", 2, "pretraining_tp must be 1"),
    ("rope_scaling", {"rope_type": "linear"}, "transformers.LlamaConfig refuses it"),  # no factor
    ("bos_token_id", "1", "bos_token_id must be a token id"),
])  # fmt: skip
def test_wrong_types_and_values_name_the_key(tmp_path, key, value, needle):
    assert needle in _error(_write(tmp_path, TINY | {key: value}))


def test_invalid_json_names_the_file_and_line(tmp_path):
    path = _write(tmp_path, '{\n  "vocab_size": 128,\n  "hidden_size": ,\n}')
    message = _error(path)
    assert str(path) in message and "line 3" in message


@pytest.mark.parametrize("text, needle", [
    ('{"vocab_size": 128, "vocab_size": 256}', "'vocab_size' is given twice"),
    ('{"rms_norm_eps": NaN}', "NaN"),
    ("[1, 2]", "expected a JSON object"),
])  # fmt: skip
def test_json_that_parses_but_would_lose_something(tmp_path, text, needle):
    assert needle in _error(_write(tmp_path, text))


def test_a_missing_file_is_a_value_error_naming_it(tmp_path):
    assert str(tmp_path / "nope.json") in _error(tmp_path / "nope.json")


def _as_transformers_reads_it(path: Path) -> None:
    args, hf = load_llama_config(path), transformers.LlamaConfig.from_json_file(str(path))
    assert isinstance(args, LlamaArgs) and args == LlamaArgs.from_hf(hf)
    for token in ("bos_token_id", "eos_token_id", "pad_token_id"):  # not compared by ==, written to exports
        assert getattr(args, token) == getattr(hf, token)


@pytest.mark.parametrize(
    "path", [TUTORIAL / "configs" / "tiny.json", *sorted(PRESETS_DIR.glob("*.json"))], ids=lambda p: p.name
)
def test_the_tutorial_and_preset_configs_load_as_transformers_reads_them(path):
    _as_transformers_reads_it(path)


def test_absent_optional_keys_mean_what_transformers_reads(tmp_path):
    """LlamaArgs' defaults are LlamaConfig's (rms_norm_eps 1e-6, 2048 positions, token ids 1 and 2),
    and the 4.x RoPE spelling with a llama3 variant takes its original length as 5.x does."""
    _as_transformers_reads_it(
        _write(
            tmp_path,
            {
                k: TINY[k]
                for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
            },
        )
    )
    assert load_llama_config(tmp_path / "config.json").rms_norm_eps == 1e-6
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    _as_transformers_reads_it(_write(tmp_path, TINY | {"rope_theta": 500000.0, "rope_scaling": llama3}, "4x.json"))
    assert load_llama_config(tmp_path / "4x.json").rope_parameters["original_max_position_embeddings"] == 64


def test_hugging_face_metadata_keys_are_accepted(tmp_path):
    """A config.json as the Hub has it (Llama-2-7b-hf style, transformers 4.x names)."""
    hub = TINY | {
        "_name_or_path": "meta-llama/Llama-2-7b-hf", "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": None, "hidden_act": "silu", "initializer_range": 0.02,
        "pretraining_tp": 1, "rope_scaling": None, "rope_theta": 10000.0, "torch_dtype": "float16",
        "transformers_version": "4.31.0.dev0", "use_cache": True, "attention_bias": False, "attention_dropout": 0.0,
        "mlp_bias": False, "head_dim": 16,
    }  # fmt: skip
    config = load_llama_config(_write(tmp_path, hub))
    assert config.num_hidden_layers == 2 and config.hidden_size == 64 and config.rope_parameters["rope_theta"] == 1e4
    # what transformers itself writes (5.x names: rope_parameters, dtype) loads too, as the same model
    config.to_hf().to_json_file(str(tmp_path / "saved.json"))
    saved = load_llama_config(tmp_path / "saved.json")
    assert saved == config and (saved.bos_token_id, saved.eos_token_id) == (1, 2)


def test_a_directory_or_a_preset_name_reads_strictly(tmp_path):
    _write(tmp_path, TINY | {"hidden_sise": 64})
    with pytest.raises(ValueError, match="did you mean 'hidden_size'"):
        load_llama_config(str(tmp_path))  # a directory holding config.json
    assert load_llama_config("llama2-7b").num_hidden_layers == 32
    assert load_llama_config("Llama3-8B").num_key_value_heads == 8  # names are case-insensitive
    with pytest.raises(
        ValueError,
        match=r"llama2-8b: no such file.*preset name \(llama2-70b, llama2-7b, llama3-8b, llama3.1-70b, llama3.1-8b\)",
    ):
        load_llama_config("llama2-8b")


# ---- train.py: options that do not apply, the data's length ------------------------------------


@pytest.mark.parametrize("kwargs, needle", [
    ({"recompute_method": "uniform"}, "--recompute-method uniform applies only with --recompute full"),
    ({"recompute": "selective", "recompute_num_layers": 2},
     "--recompute-num-layers 2 applies only with --recompute full"),
    ({"recompute": "full", "recompute_modules": "core_attn,mlp"},
     "--recompute-modules core_attn,mlp applies only with --recompute selective"),
    ({"recompute": "selective", "device_memory": "16"}, "--device-memory 16 applies only with --recompute auto"),
    ({"checkpoint_every": 5}, "--checkpoint-every 5 applies only with --checkpoint-dir"),
    ({"keep_last": 2}, "--keep-last 2 applies only with --checkpoint-dir"),
    ({"checkpoint_writers": 4}, "--checkpoint-writers 4 applies only with --checkpoint-dir or --resume"),
    ({"decay": "constant", "min_lr_ratio": 0.0}, "--min-lr-ratio 0.0 applies only with --decay cosine or linear"),
    ({"lr": float("nan")}, "--lr must be a finite number"),
    ({"grad_clip": float("inf")}, "--grad-clip must be a finite number"),
    ({"adam_eps": float("nan")}, "--adam-eps must be a finite number"),  # an optional float (float | None)
    ({"collective_timeout": float("inf")}, "--collective-timeout must be a finite number"),
    ({"beta2": 1.0}, "--beta2 must be in [0, 1)"),
    ({"max_steps": 10, "stop_at_step": 12}, "--stop-at-step must be in [1, --max-steps 10]"),
    ({"recompute": "selective", "recompute_modules": "core_atn"},
     "--recompute selective: modules: unknown module 'core_atn'"),
])  # fmt: skip
def test_options_that_would_be_ignored_are_errors(kwargs, needle):
    train = _train_module()
    with pytest.raises(ValueError) as exc:
        train.TrainConfig(**kwargs)
    assert needle in str(exc.value), str(exc.value)


def test_options_with_what_they_act_with_are_accepted():
    train = _train_module()
    full = train.TrainConfig(recompute="full", recompute_method="block", recompute_num_layers=2)
    assert full.recompute_config().num_layers == 2
    selective = train.TrainConfig(recompute="selective", recompute_modules="core_attn,mlp")
    assert selective.recompute_config().modules == ("core_attn", "mlp")
    train.TrainConfig(recompute="auto", device_memory="trn1", checkpoint_dir="c", checkpoint_every=5, keep_last=2)
    train.TrainConfig(decay="constant", resume="some/step_00000004", checkpoint_writers=0)


def test_parse_args_refuses_in_one_usage_error(capsys):
    train = _train_module()
    with pytest.raises(SystemExit) as exc:
        train.parse_args(["--recompute-num-layers", "2"])
    assert exc.value.code == 2 and "applies only with --recompute full" in capsys.readouterr().err


def test_parse_args_reads_each_flag_as_its_field_type():
    """Optional numbers (``int | None``, ``float | None``) parse as numbers, not strings."""
    train = _train_module()
    cfg = train.parse_args(["--seed", "7", "--adam-eps", "1e-6", "--stop-at-step", "3", "--log-every", "5"])
    assert (cfg.seed, cfg.adam_eps, cfg.stop_at_step, cfg.log_every) == (7, 1e-6, 3, 5)
    assert type(cfg.seed) is int and type(cfg.adam_eps) is float and type(cfg.stop_at_step) is int


def test_block_length_above_max_position_embeddings_is_raised_with_a_notice():
    train = _train_module()
    cfg = train.TrainConfig(model_config="m.json", data="d.safetensors")
    config = tiny_config(max_position_embeddings=64)
    notices: list[str] = []
    assert train.check_seq_len(64, config, cfg, notices) is config and not notices  # equal: fits
    fitted = train.check_seq_len(128, config, cfg, notices)
    assert fitted.max_position_embeddings == 128 and config.max_position_embeddings == 64  # a copy
    (notice,) = notices
    assert "max_position_embeddings 64 < block length 128: raised to 128" in notice and "m.json" in notice


def _main_error(argv: list[str]) -> str:
    try:
        _train_module().main(argv)
    except ValueError as e:
        return str(e)
    return ""


def test_train_main_refuses_a_typo_config_and_too_long_blocks(world, tmp_path):
    """End to end on one rank: the strict config reader and the seq-len check are wired in."""
    from neuron_ckpt.data import write_packed

    blocks = np.random.default_rng(0).integers(0, 128, size=(8, 16))
    data = write_packed(tmp_path / "train.safetensors", blocks, vocab_size=128, tokenizer="random")
    common = ["--data", str(data), "--max-steps", "1", "--warmup-steps", "0", "--global-batch-size", "1"]
    typo = _write(tmp_path, TINY | {"num_hiden_layers": 4}, "typo.json")
    message = world(1).run(_main_error, ["--model-config", str(typo), *common])[0]
    assert "num_hiden_layers" in message and "did you mean 'num_hidden_layers'" in message
    # A too-short max_position_embeddings is now raised with a notice: test_train_main_takes_an_nxd_style_config.


# ---- neuron-ckpt: every error is one line on stderr and exit status 2 ----------------------------


def _assert_one_line(result: tuple[int, str, str], *needles: str) -> None:
    """``result``: ``neuron_ckpt_cli``'s (exit status, stdout, stderr)."""
    code, _, err = result
    assert code == 2, (code, err)
    assert err.count("\n") == 1 and err.endswith("\n"), err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in err, err


SEVEN_B = ("plan", "--tp", "8", "--dp", "4", "--seq", "4096")


@pytest.mark.parametrize("extra, needles", [
    (("--hidden", "64"), ("--hidden is for --model gpt", "use --config")),
    (("--hidden", "64", "--layers", "2", "--vocab", "100"), ("--hidden, --layers, --vocab are for --model gpt",)),
    (("--model", "gpt", "--hidden", "64", "--heads", "4", "--layers", "2", "--config", "llama2-7b"),
     ("--config is for --model llama",)),
    (("--no-zero1", "--bucket-cap-mb", "64"), ("--bucket-cap-mb", "--no-zero1")),
])  # fmt: skip
def test_plan_refuses_options_it_would_ignore(capsys, extra, needles):
    _assert_one_line(neuron_ckpt_cli(capsys, *SEVEN_B, "--device-memory", "trn1", *extra), *needles)


@pytest.mark.parametrize("extra, needles", [
    (("--device-memory", "inf"), ("--device-memory must be a finite number", "'inf'")),
    (("--device-memory", "nan"), ("--device-memory must be a finite number",)),
    (("--device-memory", "1e308"), ("--device-memory",)),  # finite GiB, but inf bytes
    (("--device-memory", "16", "--reserve", "inf"), ("argument --reserve", "finite")),
    (("--device-memory", "16", "--reserve", "nan"), ("argument --reserve", "finite")),
    (("--device-memory", "16", "--bucket-cap-mb", "inf"), ("argument --bucket-cap-mb", "finite")),
])  # fmt: skip
def test_plan_non_finite_numbers(capsys, extra, needles):
    _assert_one_line(neuron_ckpt_cli(capsys, *SEVEN_B, *extra), *needles)


@pytest.mark.parametrize("memory, reserve", [("trn1", "20"), ("16", "16")])
def test_plan_a_reserve_that_leaves_nothing(capsys, memory, reserve):
    _assert_one_line(
        neuron_ckpt_cli(capsys, *SEVEN_B, "--device-memory", memory, "--reserve", reserve),
        f"--reserve {reserve} GiB leaves nothing of a 16 GiB device",
    )


@pytest.mark.parametrize("content, needles", [
    (json.dumps(TINY | {"hidden_size": "64"}), ("hidden_size must be a positive integer", "str")),
    (json.dumps(TINY | {"num_hiden_layers": 4}), ("did you mean 'num_hidden_layers'",)),
    ('{\n  "vocab_size": 128,\n  oops\n}', ("invalid JSON at line 3",)),
    ("\xff\xfe", ("not UTF-8",)),
])  # fmt: skip
def test_plan_config_file_errors(capsys, tmp_path, content, needles):
    path = tmp_path / "config.json"
    path.write_bytes(content.encode("latin-1") if content.startswith("\xff") else content.encode())
    result = neuron_ckpt_cli(capsys, "plan", "--config", str(path), "--seq", "64", "--device-memory", "16")
    _assert_one_line(result, str(path), *needles)


MEMORY = ("memory", "--hidden", "64", "--heads", "4", "--seq", "64")


@pytest.mark.parametrize("where, needle", [
    ("missing/dir/m.png", "does not exist"),
    ("a_file/m.png", "is not a directory"),
    (".", "is a directory"),
])  # fmt: skip
def test_memory_plot_path_is_checked_before_any_work(capsys, tmp_path, monkeypatch, where, needle):
    from neuron_ckpt.memory import report

    def no_measuring(*_):
        raise AssertionError("measured before the --plot path was checked")

    monkeypatch.setattr(report, "measure", no_measuring)
    (tmp_path / "a_file").write_text("x")
    _assert_one_line(neuron_ckpt_cli(capsys, *MEMORY, "--measure", "--plot", str(tmp_path / where)), "--plot", needle)


def test_memory_plot_into_an_unwritable_directory(capsys, tmp_path, monkeypatch):
    from neuron_ckpt.memory import report

    def refuse(path, *args, **kwargs):  # root ignores chmod: refuse as a read-only mount would
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(report, "open", refuse, raising=False)
    _assert_one_line(
        neuron_ckpt_cli(capsys, *MEMORY, "--plot", str(tmp_path / "m.png")), "cannot write there: Permission denied"
    )
    assert not (tmp_path / "m.png").exists()


def test_memory_plot_check_leaves_no_file_behind_and_the_plot_is_written(capsys, tmp_path):
    from neuron_ckpt.memory.report import check_plot_path

    check_plot_path(str(tmp_path / "m.png"))
    assert not (tmp_path / "m.png").exists()
    assert neuron_ckpt_cli(capsys, *MEMORY, "--plot", str(tmp_path / "m.png"))[0] == 0
    assert (tmp_path / "m.png").read_bytes()[:4] == b"\x89PNG"


def test_an_os_error_during_the_command_is_one_line(capsys, monkeypatch):
    """A file-system error the checks could not foresee (disk full at savefig) still ends in
    one line and exit status 2."""
    from neuron_ckpt.memory import report

    def full(*_):
        raise OSError(28, "No space left on device", "/data/x.json")

    monkeypatch.setattr(report, "build_report", full)
    _assert_one_line(neuron_ckpt_cli(capsys, *MEMORY), "/data/x.json: No space left on device")


def test_the_console_script_prints_no_traceback(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY | {"hidden_size": "64"}))
    for argv in (
        ["plan", "--config", str(path), "--seq", "64", "--device-memory", "16"],
        ["plan", "--seq", "64", "--device-memory", "inf"],
    ):
        proc = subprocess.run(
            [sys.executable, "-m", "neuron_ckpt.cli", *argv], capture_output=True, text=True, timeout=300
        )
        assert proc.returncode == 2 and proc.stdout == "", proc
        assert len(proc.stderr.splitlines()) == 1 and "Traceback" not in proc.stderr, proc.stderr


# ---- NxD's config.json files (neuronx-distributed examples/training/llama/*) -----------------------

# NxD's 7B_config_llama2/config.json as shipped (2.29): max_position_embeddings 2048 (its
# get_model raises it to --seq_len 4096), and three options of NxD's training script.
NXD_7B = {
    "architectures": ["LlamaForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
    "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 11008, "max_position_embeddings": 2048,
    "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32,
    "pad_token_id": 0, "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 10000.0,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.31.0", "use_cache": True,
    "vocab_size": 32000, "sequence_parallel_enabled": False, "selective_checkpoint_enabled": False,
    "move_model_to_device": True,
}  # fmt: skip
# NxD's 8B_config_llama3.1/config.json (2.24 to 2.29): Meta's Llama-3.1 8B values.
NXD_8B_31 = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 128000,
    "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 14336, "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "pad_token_id": 0,
    "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.31.0",
    "use_cache": True, "vocab_size": 128256, "sequence_parallel_enabled": False, "selective_checkpoint_enabled": False,
}  # fmt: skip


@pytest.mark.parametrize("data, dropped", [
    (NXD_7B, "move_model_to_device, selective_checkpoint_enabled, sequence_parallel_enabled"),
    (NXD_8B_31, "selective_checkpoint_enabled, sequence_parallel_enabled"),
], ids=["7B_config_llama2", "8B_config_llama3.1"])  # fmt: skip
def test_nxd_configs_load_with_one_notice_naming_the_dropped_keys(tmp_path, data, dropped):
    path = _write(tmp_path, data)
    notices: list[str] = []
    config = load_llama_config(tmp_path, notices)  # NxD's directory layout: config.json
    (notice,) = notices
    assert "\n" not in notice and str(path) in notice and f"dropped NxD training options {dropped} " in notice
    assert not hasattr(config, "sequence_parallel_enabled") and config.hidden_size == 4096
    with pytest.warns(UserWarning, match="sequence_parallel_enabled"):  # no list: never silent
        load_llama_config(path)
    with pytest.warns(UserWarning):  # a misspelt NxD key is not dropped: an unknown key
        assert (
            _error(_write(tmp_path, data | {"sequence_paralel_enabled": True}, "typo.json")).count("unknown key") == 1
        )


def test_the_llama31_preset_is_nxd_s_and_meta_s_config():
    from neuron_ckpt.models import LlamaArgs

    preset = load_llama_config("llama3.1-8b")
    assert LlamaArgs.from_hf(preset) == LlamaArgs.from_hf(load_llama_config(_nxd_file(NXD_8B_31)[0], []))
    assert LlamaArgs.from_hf(preset).rope_parameters == {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192, "rope_theta": 500000.0}  # fmt: skip
    assert preset.max_position_embeddings == 131072 and preset.vocab_size == 128256


def _nxd_file(data: dict) -> tuple[Path, None]:
    import tempfile

    path = Path(tempfile.mkdtemp()) / "config.json"
    path.write_text(json.dumps(data))
    return path, None


@pytest.mark.parametrize("rope", [None, {"rope_type": "linear", "factor": 2.0}, NXD_8B_31["rope_scaling"],
                                  {"rope_type": "yarn", "factor": 4.0}])  # fmt: skip
def test_fit_positions_raises_max_position_embeddings_with_a_notice(rope):
    from neuron_ckpt.models.config_file import fit_positions

    config = transformers.LlamaConfig(**TINY | {"max_position_embeddings": 2048, "rope_scaling": rope})
    fitted, notice = fit_positions(config, 4096, "NxD's 7B config")
    assert fitted.max_position_embeddings == 4096 and config.max_position_embeddings == 2048
    assert "max_position_embeddings 2048 < block length 4096: raised to 4096" in notice and "NxD's 7B config" in notice
    assert fit_positions(config, 2048) == (config, None)


def test_fit_positions_refuses_where_the_rope_tables_would_change(monkeypatch):
    """transformers 4.x's yarn takes its original length from max_position_embeddings (5.x
    stamps it into rope_parameters at construction): emulated, the raise is refused."""
    from neuron_ckpt.models import rotary
    from neuron_ckpt.models.config_file import fit_positions

    real = rotary.inverse_frequencies
    monkeypatch.setattr(rotary, "inverse_frequencies",
                        lambda args: (real(args)[0] / args.max_position_embeddings, 1.0))  # fmt: skip
    config = transformers.LlamaConfig(
        **TINY | {"max_position_embeddings": 2048, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}
    )
    with pytest.raises(ValueError, match=r"m.json: block length 4096 > max_position_embeddings 2048.*'yarn'") as exc:
        fit_positions(config, 4096, "m.json")
    assert "\n" not in str(exc.value)


def _main_output(argv: list[str]) -> str:
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        _train_module().main(argv)
    return out.getvalue()


def test_train_main_takes_an_nxd_style_config(world, tmp_path):
    """End to end: NxD's keys dropped and max_position_embeddings raised, each said once."""
    from neuron_ckpt.data import write_packed

    blocks = np.random.default_rng(0).integers(0, 128, size=(8, 16))
    data = write_packed(tmp_path / "train.safetensors", blocks, vocab_size=128, tokenizer="random")
    nxd = _write(tmp_path, TINY | {"max_position_embeddings": 8, "sequence_parallel_enabled": False,
                                   "selective_checkpoint_enabled": False}, "nxd.json")  # fmt: skip
    argv = ["--model-config", str(nxd), "--data", str(data), "--max-steps", "1", "--warmup-steps", "0",
            "--global-batch-size", "1"]  # fmt: skip
    output = world(1).run(_main_output, argv)[0]
    notes = [line for line in output.splitlines() if line.startswith("note: ")]
    assert len(notes) == 2, output
    assert "dropped NxD training options selective_checkpoint_enabled, sequence_parallel_enabled" in notes[0]
    assert "max_position_embeddings 8 < block length 16: raised to 16" in notes[1]
