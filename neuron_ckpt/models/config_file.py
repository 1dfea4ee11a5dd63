"""Reading a Llama model config JSON strictly: :func:`load_llama_config`.

It takes a file, a directory holding ``config.json``, or the name of a config shipped with the
package (:data:`PRESET_NAMES`: ``llama2-7b``, ``llama3-8b``, the JSON files in ``presets/``).

``transformers.LlamaConfig.from_json_file`` keeps a key it does not know as a stray attribute
and fills a key that is missing with Llama-7B's default, so ``"num_hiden_layers": 4`` builds 32
layers and a config without ``hidden_size`` builds a 4096-wide model, without a word. This reads
the same files and refuses, with a ``ValueError`` naming the file and the key:

- a key that is neither a ``LlamaConfig`` field (everything ``LlamaConfig().to_dict()`` holds)
  nor one of the metadata keys Hugging Face ``config.json`` files carry (:data:`METADATA_KEYS`);
  the closest valid name is suggested (difflib);
- a missing shape key (:data:`SHAPE_KEYS`);
- a value of the wrong type or range (a string ``hidden_size``, ``rms_norm_eps: 0``), heads that
  do not divide the width, a ``model_type`` other than ``llama``;
- invalid JSON (file, line and column), non-finite numbers (``NaN``, ``Infinity``), a key given
  twice, anything but a JSON object at the top.

NxD's example configs (``examples/training/llama/*/config.json`` of neuronx-distributed) carry
options of NxD's training script beside the model (:data:`NXD_KEYS`: ``sequence_parallel_enabled``,
``selective_checkpoint_enabled``...); they are dropped with a one-line notice naming them (this
library takes them as flags: ``--sequence-parallel``, ``--recompute``). NxD's ``get_model`` also
raises ``max_position_embeddings`` to the training block length; :func:`fit_positions` does the
same, with a notice, where that leaves the RoPE tables as they are.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import json
import math
import warnings
from pathlib import Path
from typing import Any

PRESETS_DIR = Path(__file__).with_name("presets")
PRESET_NAMES = tuple(sorted(p.stem for p in PRESETS_DIR.glob("*.json")))
SHAPE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")

# Keys a Hugging Face config.json may hold beyond LlamaConfig().to_dict() of the installed
# transformers: names older or newer versions use (rope_theta / rope_scaling in 4.x, torch_dtype
# before dtype), bookkeeping, and the generation defaults transformers 4.x saved with every
# config. None of them changes the model this library builds.
METADATA_KEYS = frozenset({
    "architectures", "model_type", "dtype", "torch_dtype", "transformers_version", "_name_or_path",
    "_commit_hash", "_attn_implementation", "_attn_implementation_autoset", "attn_implementation",
    "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id",
    "rope_theta", "rope_scaling", "rope_parameters", "head_dim", "pretraining_tp", "use_cache",
    "tokenizer_class", "prefix", "task_specific_params", "finetuning_task", "problem_type",
    "id2label", "label2id", "num_labels", "return_dict", "output_hidden_states", "output_attentions",
    "torchscript", "use_bfloat16", "tf_legacy_loss", "pruned_heads", "chunk_size_feed_forward",
    "is_encoder_decoder", "is_decoder", "cross_attention_hidden_size", "add_cross_attention",
    "tie_encoder_decoder", "quantization_config",
    # generation defaults (transformers 4.x wrote them into every config.json)
    "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups",
    "diversity_penalty", "temperature", "top_k", "top_p", "typical_p", "repetition_penalty",
    "length_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "bad_words_ids",
    "num_return_sequences", "output_scores", "return_dict_in_generate", "forced_bos_token_id",
    "forced_eos_token_id", "remove_invalid_values", "exponential_decay_length_penalty",
    "suppress_tokens", "begin_suppress_tokens",
})  # fmt: skip

# Keys of neuronx-distributed's example Llama configs (7B_config_llama2, 8B_config_llama3(.1),
# 13B/70B tp_pp, lightning) and the attributes its get_model / modeling_llama_nxd.py set on the
# config: options of NxD's training script, not of the model. Dropped with a notice.
NXD_KEYS = frozenset({
    "sequence_parallel_enabled", "selective_checkpoint_enabled", "move_model_to_device",
    "kv_shared_group_size", "qkv_linear", "fuse_qkv", "use_flash_attention", "transpose_nki_inputs",
})  # fmt: skip

_POSITIVE_INTS = (*SHAPE_KEYS, "max_position_embeddings")
_OPTIONAL_POSITIVE_INTS = ("num_key_value_heads", "head_dim", "pretraining_tp")
_OPTIONAL_TOKEN_IDS = ("bos_token_id", "pad_token_id")
_BOOLS = ("attention_bias", "mlp_bias", "tie_word_embeddings", "use_cache")
# name: (lowest, lowest allowed itself?, highest or None)
_NUMBERS = {
    "rms_norm_eps": (0.0, False, None),
    "initializer_range": (0.0, True, None),
    "attention_dropout": (0.0, True, 1.0),
    "rope_theta": (0.0, False, None),
}
_STRINGS = ("hidden_act", "model_type")
_OPTIONAL_DICTS = ("rope_scaling", "rope_parameters")


def valid_keys() -> frozenset[str]:
    """Every key :func:`load_llama_config` accepts: the installed ``LlamaConfig``'s fields and
    :data:`METADATA_KEYS`."""
    import transformers

    return frozenset(transformers.LlamaConfig().to_dict()) | METADATA_KEYS


def _closest(name: str, candidates) -> str | None:
    match = difflib.get_close_matches(name, sorted(candidates), n=1, cutoff=0.6)
    return match[0] if match else None


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _no_constants(name: str):
    raise ValueError(f"{name} is not a number JSON allows (values must be finite)")


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict:
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise ValueError(f"key {key!r} is given twice (the second would silently win)")
        seen[key] = value
    return seen


def read_json_object(path: str | Path) -> dict:
    """The JSON object in ``path``; a ``ValueError`` naming the file (and the line for a syntax
    error) for an unreadable file, invalid JSON, ``NaN``/``Infinity``, a duplicate key or a
    top-level value that is not an object."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text (byte {exc.start}): is it a JSON config?") from None
    except OSError as exc:
        raise ValueError(f"{path}: cannot read the model config: {exc.strerror or exc}") from None
    try:
        data = json.loads(text, parse_constant=_no_constants, object_pairs_hook=_no_duplicates)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}") from None
    except ValueError as exc:  # from the hooks above
        raise ValueError(f"{path}: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object of LlamaConfig fields, got {_kind(data)}")
    return data


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _type_errors(data: dict) -> list[str]:
    errors = []
    for key in _POSITIVE_INTS + _OPTIONAL_POSITIVE_INTS:
        if key not in data or (data[key] is None and key in _OPTIONAL_POSITIVE_INTS):
            continue
        if not _is_int(data[key]) or data[key] < 1:
            errors.append(f"{key} must be a positive integer, got {data[key]!r} ({_kind(data[key])})")
    for key in _OPTIONAL_TOKEN_IDS:
        if data.get(key) is not None and (not _is_int(data[key]) or data[key] < 0):
            errors.append(f"{key} must be a token id (an integer >= 0) or null, got {data[key]!r}")
    eos = data.get("eos_token_id")
    ids = eos if isinstance(eos, list) else [eos]
    if eos is not None and not all(_is_int(i) and i >= 0 for i in ids):
        errors.append(f"eos_token_id must be a token id, a list of them or null, got {eos!r}")
    for key in _BOOLS:
        if key in data and not isinstance(data[key], bool):
            errors.append(f"{key} must be true or false, got {data[key]!r} ({_kind(data[key])})")
    for key, (low, low_ok, high) in _NUMBERS.items():
        if key not in data:
            continue
        value = data[key]
        number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if not number or value < low or (value == low and not low_ok) or (high is not None and value > high):
            where = f"{'>=' if low_ok else '>'} {low:g}" + (f" and <= {high:g}" if high is not None else "")
            errors.append(f"{key} must be a number {where}, got {value!r} ({_kind(value)})")
    for key in _STRINGS:
        if key in data and not isinstance(data[key], str):
            errors.append(f"{key} must be a string, got {data[key]!r} ({_kind(data[key])})")
    for key in _OPTIONAL_DICTS:
        if data.get(key) is not None and not isinstance(data[key], dict):
            errors.append(f"{key} must be an object or null, got {data[key]!r} ({_kind(data[key])})")
    if isinstance(data.get("model_type"), str) and data["model_type"] != "llama":
        errors.append(f"model_type is {data['model_type']!r}: this reads Llama configs (model_type 'llama') only")
    return errors


def _shape_errors(data: dict) -> list[str]:
    """Head counts against the width (only when the keys involved passed the type checks)."""
    ok = lambda k: _is_int(data.get(k)) and data[k] >= 1  # noqa: E731
    errors = []
    if ok("hidden_size") and ok("num_attention_heads") and data.get("head_dim") is None:
        if data["hidden_size"] % data["num_attention_heads"]:
            errors.append(f"hidden_size ({data['hidden_size']}) must be a multiple of num_attention_heads "
                          f"({data['num_attention_heads']}), or give head_dim")
    if ok("num_attention_heads") and ok("num_key_value_heads"):
        if data["num_attention_heads"] % data["num_key_value_heads"]:
            errors.append(f"num_key_value_heads ({data['num_key_value_heads']}) must divide num_attention_heads "
                          f"({data['num_attention_heads']})")
    return errors


def check_llama_config_dict(data: dict, source: str = "the model config") -> None:
    """Raise one ``ValueError`` listing every problem of ``data`` (a parsed config.json): unknown
    keys with the closest valid name, missing shape keys, wrong types and ranges."""
    import transformers

    valid = valid_keys()
    defaults = transformers.LlamaConfig().to_dict()
    unknown = [k for k in data if k not in valid]
    errors = []
    for key in unknown:
        guess = _closest(key, valid)
        errors.append(f"unknown key {key!r}" + (f" (did you mean {guess!r}?)" if guess else " (not a LlamaConfig field)"))
    for key in SHAPE_KEYS:
        if key not in data:
            typo = _closest(key, unknown)
            hint = f"; is {typo!r} a misspelling of it?" if typo else ""
            errors.append(f"missing key {key!r} (LlamaConfig would silently use Llama-7B's {defaults[key]}{hint})")
    errors += _type_errors(data)
    if not errors:
        errors += _shape_errors(data)
    if errors:
        raise ValueError(f"{source}: " + "; ".join(errors))


def config_path(path_or_name: str | Path) -> Path:
    """The JSON file of a preset name (case-insensitive), a directory's ``config.json``, or the
    file itself; a ``ValueError`` naming it and the presets when it is none of them."""
    if str(path_or_name).lower() in PRESET_NAMES:
        return PRESETS_DIR / f"{str(path_or_name).lower()}.json"
    path = Path(path_or_name)
    if path.is_dir():
        path = path / "config.json"
    if not path.exists():
        raise ValueError(f"{path_or_name}: no such file, directory holding config.json, or preset name "
                         f"({', '.join(PRESET_NAMES)})")
    return path


def _notify(notice: str, notices: list[str] | None) -> None:
    """Hand ``notice`` to the caller's list, or warn when the caller keeps none: never silent."""
    if notices is None:
        warnings.warn(notice, stacklevel=3)
    else:
        notices.append(notice)


def drop_nxd_keys(data: dict, source: str, notices: list[str] | None = None) -> dict:
    """``data`` without :data:`NXD_KEYS`; one notice naming the keys dropped (none: no notice)."""
    dropped = sorted(k for k in data if k in NXD_KEYS)
    if dropped:
        _notify(f"{source}: dropped NxD training options {', '.join(dropped)} (not model fields; "
                "this library takes them as flags: --sequence-parallel, --recompute)", notices)
    return {k: v for k, v in data.items() if k not in NXD_KEYS}


def load_llama_config(path_or_name: str | Path, notices: list[str] | None = None) -> Any:
    """A ``transformers.LlamaConfig`` from a JSON file, a directory holding ``config.json`` or a
    preset name (:func:`config_path`), checked as the module docstring says; a ``ValueError``
    naming the file and every problem otherwise.

    ``notices``: where the one-line notice about dropped NxD keys (:data:`NXD_KEYS`) goes, for the
    caller to print once; None: a ``UserWarning``.
    """
    import transformers

    path = config_path(path_or_name)
    data = drop_nxd_keys(read_json_object(path), str(path), notices)
    check_llama_config_dict(data, str(path))
    try:
        return transformers.LlamaConfig.from_dict(data)
    except Exception as exc:  # transformers' own validation (strict dataclass fields, rope checks)
        raise ValueError(f"{path}: transformers.LlamaConfig refuses it: {' '.join(str(exc).split())}") from None


def _rope_tables(config: Any) -> list:
    import torch

    from .llama_args import LlamaArgs
    from .rotary import inverse_frequencies, longrope_long_frequencies

    args = LlamaArgs.from_hf(config)
    inv_freq, scaling = inverse_frequencies(args)
    tables = [inv_freq, torch.tensor(scaling)]
    if args.rope_parameters["rope_type"] == "longrope":
        long_inv_freq, after = longrope_long_frequencies(args)
        tables += [long_inv_freq, torch.tensor(after)]
    return tables


def fit_positions(config: Any, seq_len: int, source: str = "the model config") -> tuple[Any, str | None]:
    """``(config, notice)``: ``config`` with ``max_position_embeddings`` raised to ``seq_len`` when
    it is below (a copy; NxD's ``get_model`` does the same), and a one-line notice saying so; the
    config itself and None when the blocks fit.

    A ``ValueError`` naming the field when the raise would change the RoPE tables (a ``yarn`` or
    ``longrope`` config that takes its original length from ``max_position_embeddings``): that
    model would no longer be the one the config describes. ``config``: a ``LlamaConfig`` or
    :class:`~.llama_args.LlamaArgs`.
    """
    limit = config.max_position_embeddings
    if seq_len <= limit:
        return config, None
    if dataclasses.is_dataclass(config):
        fitted = dataclasses.replace(config, max_position_embeddings=seq_len)
    else:
        fitted = copy.deepcopy(config)
        fitted.max_position_embeddings = seq_len
    before, after = _rope_tables(config), _rope_tables(fitted)
    if any(a.shape != b.shape or not bool((a == b).all()) for a, b in zip(before, after)):
        rope_type = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
        raise ValueError(
            f"{source}: block length {seq_len} > max_position_embeddings {limit}, and raising it would change "
            f"the RoPE tables (rope_type {rope_type.get('rope_type')!r} derives them from max_position_embeddings): "
            f"prepare the data with --seq-len {limit} or less, or give original_max_position_embeddings in the config"
        )
    return fitted, (f"{source}: max_position_embeddings {limit} < block length {seq_len}: raised to {seq_len}, "
                    "as NxD's get_model does (the RoPE tables are unchanged)")


__all__ = ["METADATA_KEYS", "NXD_KEYS", "PRESET_NAMES", "SHAPE_KEYS", "check_llama_config_dict", "config_path",
           "drop_nxd_keys", "fit_positions", "load_llama_config", "read_json_object", "valid_keys"]
