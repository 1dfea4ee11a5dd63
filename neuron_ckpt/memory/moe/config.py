"""Reading a transformers MoE config.json strictly into a :class:`~.shape.MoEShape`:
:func:`load_moe_config`.

``model_type`` picks the family (mixtral, qwen3_moe, qwen2_moe, deepseek_v3). As
:mod:`neuron_ckpt.models.config_file` does for Llama, it refuses in one ``ValueError`` naming the
file and every problem what transformers would silently read another way: a key that is not a
field of the family's config class (nor one of Hugging Face's metadata keys, nor one of
DeepSeek's remote-code keys: :data:`DEEPSEEK_REMOTE_KEYS`), with the closest valid name; a
missing size (transformers would fill in its 7B-or-so default); a value of the wrong type (the
config class's own strict check); and what this memory model does not price: an activation
other than SiLU, attention dropout, Mixtral's router jitter, sliding windows, DeepSeek routing
other than transformers' (``scoring_func`` sigmoid, ``topk_method`` noaux_tc, an MoE block on
every layer after the dense ones). A ``quantization_config`` (DeepSeek-V3 ships fp8 weights)
is dropped with a notice: ``Model(config)`` builds the model in its dtype and so does this.

Presets (:data:`PRESET_NAMES`): the JSON files in ``presets/``: ``mixtral-8x7b`` and
``deepseek-v3``, their public config.json as transformers reads it (fp8 quantization stripped).
"""

from __future__ import annotations

import copy
import difflib
import warnings
from pathlib import Path

from ...checks import is_int
from ...models.config_file import METADATA_KEYS, read_json_object
from ...models.config_file import config_path as find_config
from .shape import FAMILIES, MLA, MoEShape

PRESETS_DIR = Path(__file__).with_name("presets")
PRESET_NAMES = tuple(sorted(p.stem for p in PRESETS_DIR.glob("*.json")))
CONFIG_CLASSES = {"mixtral": "MixtralConfig", "qwen3_moe": "Qwen3MoeConfig", "qwen2_moe": "Qwen2MoeConfig",
                  "deepseek_v3": "DeepseekV3Config"}  # fmt: skip

# Keys of DeepSeek's own config.json (its remote code) that transformers' DeepseekV3Config lacks,
# with the value transformers' implementation means (None: any value; not a model size).
DEEPSEEK_REMOTE_KEYS = {"auto_map": None, "aux_loss_alpha": None, "seq_aux": None, "ep_size": None,
                        "scoring_func": "sigmoid", "topk_method": "noaux_tc", "moe_layer_freq": 1}  # fmt: skip

_COMMON = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
           "num_experts_per_tok")  # fmt: skip
# The sizes a file must give (aliases: transformers' attribute_map), beyond _COMMON.
REQUIRED = {
    "mixtral": (("intermediate_size",), ("num_local_experts", "num_experts")),
    "qwen3_moe": (("moe_intermediate_size",), ("num_experts", "num_local_experts")),
    "qwen2_moe": (("moe_intermediate_size",), ("num_experts",), ("shared_expert_intermediate_size",)),
    "deepseek_v3": (("moe_intermediate_size",), ("n_routed_experts", "num_local_experts"), ("n_shared_experts",),
                    ("first_k_dense_replace",), ("q_lora_rank",), ("kv_lora_rank",), ("qk_rope_head_dim",),
                    ("qk_nope_head_dim",), ("v_head_dim",), ("n_group",), ("topk_group",)),
}  # fmt: skip


def _config_class(family: str):
    import transformers

    return getattr(transformers, CONFIG_CLASSES[family])


def _valid_keys(family: str) -> frozenset[str]:
    cls = _config_class(family)
    extra = DEEPSEEK_REMOTE_KEYS if family == "deepseek_v3" else {}
    return frozenset(cls().to_dict()) | frozenset(cls.attribute_map) | METADATA_KEYS | frozenset(extra)


def _problems(data: dict, family: str) -> list[str]:
    valid = _valid_keys(family)
    problems = []
    for key in (k for k in data if k not in valid):
        guess = difflib.get_close_matches(key, sorted(valid), n=1, cutoff=0.6)
        problems.append(
            f"unknown key {key!r}"
            + (f" (did you mean {guess[0]!r}?)" if guess else f" (not a {CONFIG_CLASSES[family]} field)")
        )
    for names in (*((n,) for n in _COMMON), *REQUIRED[family]):
        if not any(n in data for n in names):
            problems.append(f"missing key {names[0]!r} (transformers would use its default)")
    if family == "deepseek_v3":
        for key, want in DEEPSEEK_REMOTE_KEYS.items():
            if want is not None and key in data and data[key] != want:
                problems.append(f"{key} is {data[key]!r}: transformers' DeepseekV3 implements {want!r} only")
    return problems


def _unpriced(config, family: str) -> list[str]:
    """What the file asks for that this memory model does not price (one line each)."""
    problems = []
    if config.hidden_act != "silu":
        problems.append(f"hidden_act is {config.hidden_act!r}: the experts' SwiGLU is priced with silu only")
    if config.attention_dropout:
        problems.append(f"attention_dropout is {config.attention_dropout}: dropout masks are not priced; use 0.0")
    if getattr(config, "router_jitter_noise", 0):
        problems.append(f"router_jitter_noise is {config.router_jitter_noise}: the jitter's noise is not priced")
    if getattr(config, "sliding_window", None) and (
        family == "mixtral" or getattr(config, "use_sliding_window", False)
    ):
        problems.append(f"sliding_window {config.sliding_window}: a windowed mask is not priced; use null")
    if family == "deepseek_v3" and config.num_key_value_heads != config.num_attention_heads:
        problems.append(
            f"num_key_value_heads ({config.num_key_value_heads}) must equal num_attention_heads "
            f"({config.num_attention_heads}): transformers' MLA fails otherwise"
        )
    return problems


def _dense_layers(config, family: str) -> tuple[int, ...]:
    if family == "deepseek_v3":
        return tuple(range(min(config.first_k_dense_replace, config.num_hidden_layers)))
    if family == "mixtral":
        return ()
    step, only = config.decoder_sparse_step, set(config.mlp_only_layers or ())
    return tuple(i for i in range(config.num_hidden_layers) if i in only or (i + 1) % step)


def _shape(config, family: str, name: str) -> MoEShape:
    h, a = config.hidden_size, config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or (h // a if is_int(h) and is_int(a) and a else 1)
    dense = _dense_layers(config, family)
    common = dict(family=family, hidden=h, layers=config.num_hidden_layers, heads=a,
                  kv_heads=config.num_key_value_heads, top_k=config.num_experts_per_tok, vocab=config.vocab_size,
                  dense_layers=dense, dense_ffn=config.intermediate_size if dense else 0, name=name)  # fmt: skip
    if family == "mixtral":
        return MoEShape(**common, head_dim=head_dim, experts=config.num_local_experts, moe_ffn=config.intermediate_size)
    if family == "deepseek_v3":
        mla = MLA(
            config.q_lora_rank, config.kv_lora_rank, config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        )
        return MoEShape(**common, head_dim=mla.qk_head_dim, experts=config.n_routed_experts,
                        moe_ffn=config.moe_intermediate_size,
                        shared_ffn=config.moe_intermediate_size * config.n_shared_experts,
                        norm_topk_prob=config.norm_topk_prob, n_group=config.n_group, topk_group=config.topk_group,
                        mla=mla)  # fmt: skip
    shared = config.shared_expert_intermediate_size if family == "qwen2_moe" else 0
    return MoEShape(
        **common,
        head_dim=head_dim,
        experts=config.num_experts,
        moe_ffn=config.moe_intermediate_size,
        shared_ffn=shared,
        norm_topk_prob=config.norm_topk_prob,
    )


def moe_shape_from_dict(
    data: dict, source: str = "the model config", name: str = "", notices: list[str] | None = None
) -> MoEShape:
    """The :class:`MoEShape` of a parsed config.json, or one ``ValueError`` starting with ``source``
    listing every problem (module docstring). ``notices``: where the note about a dropped
    ``quantization_config`` goes; None: a warning."""
    family = data.get("model_type")
    if family not in FAMILIES:
        raise ValueError(f"{source}: model_type is {family!r}: this reads the MoE families {list(FAMILIES)}")
    data = dict(data)
    if data.pop("quantization_config", None) is not None:
        notice = (
            f"{source}: quantization_config dropped: priced as Model(config) builds it, in the model's dtype "
            "(activations do not depend on how the weights are stored)"
        )
        notices.append(notice) if notices is not None else warnings.warn(notice, stacklevel=2)
    problems = _problems(data, family)
    if problems:
        raise ValueError(f"{source}: " + "; ".join(problems))
    known = {k: v for k, v in data.items() if k not in DEEPSEEK_REMOTE_KEYS or family != "deepseek_v3"}
    try:  # the class's own strict field checks (a string size, a float count)
        config = _config_class(family).from_dict(copy.deepcopy(known))
    except Exception as exc:  # noqa: BLE001  its checks raise many kinds; re-raised as one ValueError
        raise ValueError(
            f"{source}: transformers.{CONFIG_CLASSES[family]} refuses it: {' '.join(str(exc).split())}"
        ) from None
    problems = _unpriced(config, family)
    if problems:
        raise ValueError(f"{source}: " + "; ".join(problems))
    try:
        return _shape(config, family, name)
    except ValueError as exc:
        raise ValueError(f"{source}: {exc}") from None


def config_path(path_or_name: str | Path) -> Path:
    """The JSON file of an MoE preset name, else as :func:`neuron_ckpt.models.config_file.config_path`
    finds it (a file, a directory's ``config.json``, a Llama preset, which is then refused by type)."""
    if str(path_or_name).lower() in PRESET_NAMES:
        return PRESETS_DIR / f"{str(path_or_name).lower()}.json"
    try:
        return find_config(path_or_name)
    except ValueError as exc:
        raise ValueError(f"{exc}; MoE presets: {', '.join(PRESET_NAMES)}") from None


def load_moe_config(path_or_name: str | Path, notices: list[str] | None = None) -> MoEShape:
    """The :class:`MoEShape` of a config.json file, a directory holding one, or a preset name."""
    path = config_path(path_or_name)
    name = path.stem if path.parent == PRESETS_DIR else path.parent.name if path.name == "config.json" else path.stem
    return moe_shape_from_dict(read_json_object(path), str(path), name, notices)


__all__ = [
    "CONFIG_CLASSES",
    "DEEPSEEK_REMOTE_KEYS",
    "PRESET_NAMES",
    "config_path",
    "load_moe_config",
    "moe_shape_from_dict",
]
