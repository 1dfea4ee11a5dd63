"""A transformers config object (any family of :mod:`.families`) as a :class:`~.shape.MoEShape`:
:func:`shape_of`; and what in it this memory model does not price: :func:`unpriced`.

It reads the object transformers built (not the file), so renamed and derived keys are already
resolved: ``num_experts`` / ``num_local_experts`` through the class's ``attribute_map``,
``layer_types`` from ``use_sliding_window`` and ``max_window_layers``, Llama 4's ``moe_layers``
and ``no_rope_layers`` from their intervals. Only what the families name differently is looked
up per family (:data:`SIZES`).
"""

from __future__ import annotations

from .families import FAMILY
from .shape import MLA, MoEShape

# Where each family keeps a size the shape needs, tried in order (transformers' own names).
EXPERTS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
TOP_K = ("num_experts_per_tok", "moe_topk")
SIZES = {  # family -> (the experts' ffn, the dense layers' ffn)
    "mixtral": ("intermediate_size", None),
    "olmoe": ("intermediate_size", None),
    "gpt_oss": ("intermediate_size", None),
    "aria_text": ("intermediate_size", None),
    "llama4_text": ("intermediate_size", "intermediate_size_mlp"),
}
VARIANT_OF = {"full_attention": "full", "sliding_attention": "sliding", "chunked_attention": "chunked"}
ACTIVATIONS = ("silu", "gelu", "gelu_pytorch_tanh")  # each keeps only its input, as silu does


def _first(config, names: tuple[str, ...]):
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return None


def _dense_layers(config, family: str, layers: int) -> tuple[int, ...]:
    if not FAMILY[family].moe:
        return tuple(range(layers))
    if family.startswith("deepseek"):
        return tuple(range(min(config.first_k_dense_replace, layers)))
    if family == "llama4_text":
        return tuple(i for i in range(layers) if i not in set(config.moe_layers))
    if family in ("qwen2_moe", "qwen3_moe"):
        step, only = config.decoder_sparse_step, set(config.mlp_only_layers or ())
        return tuple(i for i in range(layers) if i in only or (i + 1) % step)
    return ()


def _attention(config, family: str, layers: int) -> tuple[tuple[str, ...], int]:
    """Each layer's variant and the window (0 where no layer has one)."""
    types = getattr(config, "layer_types", None)
    if types:
        unknown = sorted({t for t in types if t not in VARIANT_OF})
        if unknown:
            raise ValueError(f"layer_types {unknown} are not priced (only {list(VARIANT_OF)})")
        variants = [VARIANT_OF[t] for t in types[:layers]]
    else:
        variants = ["sliding" if getattr(config, "sliding_window", None) else "full"] * layers
    if family == "llama4_text":  # no_rope_layers: 1 where the layer uses RoPE
        variants = [v if config.no_rope_layers[i] else "norope" for i, v in enumerate(variants)]
    window = 0
    if "sliding" in variants:
        window = config.sliding_window
    elif "chunked" in variants:
        window = config.attention_chunk_size
    return (tuple(variants) if set(variants) != {"full"} else ()), window


def shape_of(config, family: str, name: str = "") -> MoEShape:
    """The :class:`MoEShape` of transformers' config object ``config`` of ``family``."""
    traits = FAMILY[family]
    h, a, L = config.hidden_size, config.num_attention_heads, config.num_hidden_layers
    head_dim = getattr(config, "head_dim", None) or (h // a if isinstance(h, int) and isinstance(a, int) and a else 1)
    moe_key, dense_key = SIZES.get(family, ("moe_intermediate_size", "intermediate_size"))
    dense = _dense_layers(config, family, L)
    types, window = _attention(config, family, L)
    sizes = dict(family=family, hidden=h, layers=L, heads=a, kv_heads=config.num_key_value_heads or a,
                 head_dim=head_dim, vocab=config.vocab_size, tied_embeddings=bool(config.tie_word_embeddings),
                 dense_layers=dense, dense_ffn=getattr(config, dense_key) if dense and dense_key else 0,
                 attention_types=types, window=window or 0, name=name)  # fmt: skip
    if traits.moe:
        sizes |= dict(experts=_first(config, EXPERTS), top_k=_first(config, TOP_K), moe_ffn=getattr(config, moe_key))
        if family in ("qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3"):
            sizes["norm_topk_prob"] = config.norm_topk_prob
    if family == "deepseek_v2":
        sizes["topk_method"] = config.topk_method
    if traits.router == "sigmoid_group" or sizes.get("topk_method") == "group_limited_greedy":
        sizes |= dict(n_group=config.n_group, topk_group=config.topk_group)
    if traits.shared == "gated":
        sizes["shared_ffn"] = config.shared_expert_intermediate_size
    elif family == "aria_text":
        sizes["shared_ffn"] = config.intermediate_size * config.moe_num_shared_experts
    elif family == "llama4_text":
        sizes["shared_ffn"] = config.intermediate_size
    elif traits.shared:
        sizes["shared_ffn"] = config.moe_intermediate_size * config.n_shared_experts
    if traits.mla:
        sizes["mla"] = MLA(config.q_lora_rank, config.kv_lora_rank, config.qk_nope_head_dim, config.qk_rope_head_dim,
                           config.v_head_dim)  # fmt: skip
        sizes["head_dim"] = sizes["mla"].qk_head_dim
    if family == "gemma2":
        sizes["softcap"] = config.attn_logit_softcapping is not None
    if family == "llama4_text":
        sizes |= dict(
            qk_norm=config.use_qk_norm, temperature_tuning=config.attn_temperature_tuning and "norope" in types
        )
    return MoEShape(**sizes)


def unpriced(config, family: str) -> list[str]:
    """What the config asks for that this memory model does not price (one line each)."""
    problems = []
    act = getattr(config, "hidden_activation", None) or config.hidden_act
    if family != "gpt_oss" and act not in ACTIVATIONS:  # GPT-OSS's experts run their own clamped SwiGLU
        problems.append(f"the activation is {act!r}: priced for {', '.join(ACTIVATIONS)} only (each keeps its input)")
    for key in ("attention_dropout", "resid_pdrop", "router_jitter_noise"):
        if getattr(config, key, 0):
            problems.append(f"{key} is {getattr(config, key)}: the dropout masks and noise are not priced; use 0.0")
    if getattr(config, "clip_qkv", None) is not None:
        problems.append(f"clip_qkv is {config.clip_qkv}: the in-place clamps are not priced; use null")
    if getattr(config, "use_bidirectional_attention", False):
        problems.append("use_bidirectional_attention is true: only causal attention is priced")
    if FAMILY[family].mla and config.num_key_value_heads != config.num_attention_heads:
        problems.append(
            f"num_key_value_heads ({config.num_key_value_heads}) must equal num_attention_heads "
            f"({config.num_attention_heads}): transformers' MLA fails otherwise"
        )
    return problems


__all__ = ["ACTIVATIONS", "EXPERTS", "SIZES", "TOP_K", "shape_of", "unpriced"]
