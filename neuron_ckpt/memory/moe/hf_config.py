"""A :class:`~.shape.MoEShape` written as its family's transformers config (no download):
:func:`hf_config`, what :mod:`.measure` builds real layers from. The inverse of
:func:`~.from_config.shape_of`: reading the config back gives the shape (tested); everything the
shape does not hold is left at transformers' defaults, which change nothing priced.
"""

from __future__ import annotations

from typing import Any

from .config import quiet_transformers
from .families import FAMILY
from .from_config import SIZES
from .shape import MoESetup, MoEShape

EXPERTS_KEY = {"mixtral": "num_local_experts", "gpt_oss": "num_local_experts", "llama4_text": "num_local_experts",
               "qwen2_moe": "num_experts", "qwen3_moe": "num_experts", "olmoe": "num_experts",
               "deepseek_v2": "n_routed_experts", "deepseek_v3": "n_routed_experts",
               "aria_text": "moe_num_experts"}  # fmt: skip
LAYER_TYPES = ("qwen2", "qwen3", "qwen2_moe", "gemma2", "gpt_oss", "llama4_text")  # configs with layer_types
_TYPE = {"full": "full_attention", "norope": "full_attention", "sliding": "sliding_attention",
         "chunked": "chunked_attention"}  # fmt: skip


def _moe(shape: MoEShape, kept: list[int]) -> dict[str, Any]:
    family = shape.family
    moe_key = SIZES.get(family, ("moe_intermediate_size", None))[0]
    out: dict[str, Any] = {EXPERTS_KEY[family]: shape.experts, moe_key: shape.moe_ffn}
    out["moe_topk" if family == "aria_text" else "num_experts_per_tok"] = shape.top_k
    if family in ("qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3"):
        out["norm_topk_prob"] = shape.norm_topk_prob
    dense = [i for i, layer in enumerate(kept) if shape.is_dense(layer)]
    if family.startswith("deepseek"):
        if dense != list(range(len(dense))):
            raise ValueError(f"dense_layers: {family}'s dense layers are its first ones, got {dense}")
        out |= dict(first_k_dense_replace=len(dense), n_shared_experts=shape.shared_ffn // shape.moe_ffn,
                    n_group=shape.n_group, topk_group=shape.topk_group)  # fmt: skip
        if family == "deepseek_v2":
            out["topk_method"] = shape.topk_method
    elif family in ("qwen2_moe", "qwen3_moe"):
        out["mlp_only_layers"] = dense
    elif family == "llama4_text":
        out["moe_layers"] = [i for i in range(len(kept)) if i not in dense]
    if family == "llama4_text" and shape.shared_ffn != shape.moe_ffn:
        raise ValueError(f"shared_ffn: Llama 4's shared expert is as wide as an expert ({shape.moe_ffn})")
    if family == "qwen2_moe":
        out["shared_expert_intermediate_size"] = shape.shared_ffn
    elif family == "aria_text":
        out["moe_num_shared_experts"] = shape.shared_ffn // shape.moe_ffn
    if dense or family == "deepseek_v3":  # V3's config checks its dense size even without dense layers
        out[SIZES.get(family, (None, None))[1] or "intermediate_size"] = shape.dense_ffn or 1
    return out


def _attention(shape: MoEShape, kept: list[int]) -> dict[str, Any]:
    variants = [shape.variant(i) for i in kept]
    family, out = shape.family, dict[str, Any]()
    if family == "llama4_text":
        out |= dict(no_rope_layers=[int(v != "norope") for v in variants], use_qk_norm=shape.qk_norm,
                    attn_temperature_tuning=shape.temperature_tuning,
                    attention_chunk_size=shape.window if "chunked" in variants else None)  # fmt: skip
    if family in LAYER_TYPES:
        out["layer_types"] = [_TYPE[v] for v in variants]
        if "sliding" in variants:
            out |= dict(sliding_window=shape.window, use_sliding_window=True)
    elif "sliding" in variants:
        if set(variants) != {"sliding"}:
            raise ValueError(f"attention_types: {family} slides on every layer or none, got {variants}")
        out["sliding_window"] = shape.window
        if family == "qwen3_moe":
            out["use_sliding_window"] = True
    elif family in ("mistral", "mixtral", "phi3", "qwen3_moe"):
        out["sliding_window"] = None
    if family == "gemma2":
        out["attn_logit_softcapping"] = 50.0 if shape.softcap else None
    return out


def hf_config(shape: MoEShape, setup: MoESetup, layers: int | None = None, vocab: int | None = None):
    """The family's transformers config for ``shape`` (``layers`` / ``vocab``: its first layers
    only, a smaller vocabulary; neither changes a layer)."""
    import transformers

    family, traits = shape.family, FAMILY[shape.family]
    kept = list(range(layers or shape.layers))
    kwargs: dict[str, Any] = dict(
        vocab_size=vocab or shape.vocab, hidden_size=shape.hidden, num_hidden_layers=len(kept),
        num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
        max_position_embeddings=max(setup.seq_len, 128), use_cache=False, attention_dropout=0.0,
        tie_word_embeddings=shape.tied_embeddings,
    )  # fmt: skip
    kwargs |= _moe(shape, kept) if traits.moe else {"intermediate_size": shape.dense_ffn}
    kwargs |= _attention(shape, kept)
    if shape.mla is not None:
        m = shape.mla
        kwargs |= dict(q_lora_rank=m.q_lora_rank, kv_lora_rank=m.kv_lora_rank, qk_rope_head_dim=m.qk_rope_head_dim,
                       qk_nope_head_dim=m.qk_nope_head_dim, v_head_dim=m.v_head_dim)  # fmt: skip
    if family == "olmoe":
        kwargs["eos_token_id"] = min(2, kwargs["vocab_size"] - 1)
    if family in ("gemma2", "phi3"):
        kwargs |= dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
    with quiet_transformers():  # its RoPE checks warn about a short max_position_embeddings
        config = getattr(transformers, traits.config_class)(**kwargs)
    if shape.mla is None:
        config.head_dim = shape.head_dim  # every family's attention reads getattr(config, "head_dim", h // a)
    fused_only = setup.attention == "sdpa-fused" and shape.mla and shape.mla.qk_head_dim != shape.mla.v_head_dim
    if fused_only:
        raise ValueError(
            "attention 'sdpa-fused' with MLA head sizes that differ is not what torch runs on CPU "
            "(the math path); build it with 'sdpa'"
        )
    config._attn_implementation = "eager" if setup.attention == "eager" else "sdpa"
    return config


__all__ = ["EXPERTS_KEY", "hf_config"]
