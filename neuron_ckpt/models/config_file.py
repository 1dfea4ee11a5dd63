"""Reading a Llama model config JSON strictly into :class:`~.llama_args.LlamaArgs`: :func:`load_llama_config`.

It takes a file, a directory holding ``config.json``, or the name of a config shipped with the
package (:data:`PRESET_NAMES`: ``llama2-7b``, ``llama3-8b``, the JSON files in ``presets/``).

``transformers.LlamaConfig.from_json_file`` keeps a key it does not know as a stray attribute
and fills a key that is missing with Llama-7B's default, so ``"num_hiden_layers": 4`` builds 32
layers and a config without ``hidden_size`` builds a 4096-wide model, without a word. This reads
the same files and refuses, with a ``ValueError`` naming the file and the key:

- a key that is neither a ``LlamaConfig`` field (everything ``LlamaConfig().to_dict()`` holds)
  nor one of the metadata keys Hugging Face ``config.json`` files carry (:data:`METADATA_KEYS`);
  the closest valid name is suggested (difflib);
- a missing required key (a ``LlamaArgs`` field without a default: the five sizes);
- a value of the wrong type or range (a string ``hidden_size``, ``rms_norm_eps: 0``), heads that
  do not divide the width (``LlamaArgs`` checks its fields), a ``model_type`` other than
  ``llama``, what the model does not build (``hidden_act`` other than ``silu``, ``pretraining_tp``
  other than 1), and what ``transformers.LlamaConfig`` itself refuses (a token id of the wrong
  type, RoPE parameters its ``rope_type`` needs), so the file also loads there;
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
import warnings
from pathlib import Path
from typing import Any

from .llama_args import LlamaArgs

PRESETS_DIR = Path(__file__).with_name("presets")
PRESET_NAMES = tuple(sorted(p.stem for p in PRESETS_DIR.glob("*.json")))

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


def _required_keys() -> tuple[str, ...]:
    """The ``LlamaArgs`` fields without a default: a file must give them."""
    return tuple(f.name for f in dataclasses.fields(LlamaArgs)
                 if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)  # fmt: skip


def _key_problems(data: dict) -> list[str]:
    """Unknown keys with the closest valid name, missing required keys, a ``model_type`` other than llama."""
    import transformers

    valid = valid_keys()
    unknown = [k for k in data if k not in valid]
    problems = []
    for key in unknown:
        guess = _closest(key, valid)
        hint = f" (did you mean {guess!r}?)" if guess else " (not a LlamaConfig field)"
        problems.append(f"unknown key {key!r}{hint}")
    defaults = transformers.LlamaConfig().to_dict()
    for key in _required_keys():
        if key not in data:
            typo = _closest(key, unknown)
            hint = f"; is {typo!r} a misspelling of it?" if typo else ""
            problems.append(f"missing key {key!r} (LlamaConfig would silently use Llama-7B's {defaults[key]}{hint})")
    model_type = data.get("model_type", "llama")
    if model_type != "llama":
        problems.append(f"model_type is {model_type!r}: this reads Llama configs (model_type 'llama') only")
    return problems


def _llama_args(data: dict, source: str = "the model config") -> LlamaArgs:
    """The :class:`~.llama_args.LlamaArgs` of ``data`` (a parsed config.json), or one ``ValueError``
    starting with ``source`` and listing every problem: unknown keys with the closest valid name,
    missing required keys, the field checks of ``LlamaArgs``, what ``transformers`` refuses."""
    import transformers

    problems = _key_problems(data)
    args = None
    if not any(p.startswith("missing key") for p in problems):
        try:
            args = LlamaArgs.from_dict(data)
        except ValueError as exc:
            problems.append(str(exc))
    if problems:
        raise ValueError(f"{source}: " + "; ".join(problems))
    try:  # its own checks too (strict field types, the keys each rope_type needs): the file loads there
        transformers.LlamaConfig.from_dict(copy.deepcopy(data))
    except Exception as exc:  # noqa: BLE001  its checks raise many kinds; re-raised as one ValueError
        raise ValueError(f"{source}: transformers.LlamaConfig refuses it: {' '.join(str(exc).split())}") from None
    assert args is not None  # no problems: it was built
    return args


def config_path(path_or_name: str | Path) -> Path:
    """The JSON file of a preset name (case-insensitive), a directory's ``config.json``, or the
    file itself; a ``ValueError`` naming it and the presets when it is none of them."""
    if str(path_or_name).lower() in PRESET_NAMES:
        return PRESETS_DIR / f"{str(path_or_name).lower()}.json"
    path = Path(path_or_name)
    if path.is_dir():
        path = path / "config.json"
    if not path.exists():
        raise ValueError(
            f"{path_or_name}: no such file, directory holding config.json, or preset name ({', '.join(PRESET_NAMES)})"
        )
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
        _notify(
            f"{source}: dropped NxD training options {', '.join(dropped)} (not model fields; "
            "this library takes them as flags: --sequence-parallel, --recompute)",
            notices,
        )
    return {k: v for k, v in data.items() if k not in NXD_KEYS}


def load_llama_config(path_or_name: str | Path, notices: list[str] | None = None) -> LlamaArgs:
    """The :class:`~.llama_args.LlamaArgs` of a JSON file, a directory holding ``config.json`` or a
    preset name (:func:`config_path`), checked as the module docstring says; a ``ValueError``
    naming the file and every problem otherwise.

    ``notices``: where the one-line notice about dropped NxD keys (:data:`NXD_KEYS`) goes, for the
    caller to print once; None: a ``UserWarning``.
    """
    path = config_path(path_or_name)
    return _llama_args(drop_nxd_keys(read_json_object(path), str(path), notices), str(path))


def _rope_tables(config: Any) -> list:
    import torch

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
        fitted = dataclasses.replace(config, max_position_embeddings=seq_len)  # type: ignore[type-var]  # an instance
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
    return fitted, (
        f"{source}: max_position_embeddings {limit} < block length {seq_len}: raised to {seq_len}, "
        "as NxD's get_model does (the RoPE tables are unchanged)"
    )


__all__ = [
    "METADATA_KEYS",
    "NXD_KEYS",
    "PRESET_NAMES",
    "config_path",
    "drop_nxd_keys",
    "fit_positions",
    "load_llama_config",
    "read_json_object",
    "valid_keys",
]
