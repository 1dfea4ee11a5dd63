"""Real transformers MoE layers for a :class:`~.shape.MoEShape`, and what autograd keeps of each.

:func:`hf_config` writes the shape as the family's transformers config (no download);
:func:`build_model` builds the ``*ForCausalLM`` with ``AutoModelForCausalLM.from_config`` in the
setup's dtype (DeepSeek's router weight and bias stay fp32, as ``from_pretrained`` keeps them),
the setup's attention and experts implementations, split over the tensor-parallel group when
``setup.tp > 1`` or it runs sequence parallel (``apply_tensor_parallel``: call it on every rank of
an initialised world) and with a recompute choice applied (``apply_recompute``).
:func:`measure_layers` runs the base model's own forward from the embedding's output on (so
sequence parallel splits the first layer's input and gathers the final norm's output where
training does) under :class:`~neuron_ckpt.memory.SavedTensorRecorder`, one scope per decoder
layer and one for the final norm. Left out, as shared by every layer (a per-model term):
parameters, the rotary tables, the position ids, the mask.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ...recompute import RecomputeConfig, apply_recompute
from ..measure import SavedTensorRecorder
from .layer import Recompute, modules_of
from .shape import MoESetup, MoEShape

TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
LAYER_SCOPE = "layer{}"


def hf_config(shape: MoEShape, setup: MoESetup, layers: int | None = None, vocab: int | None = None):
    """The family's transformers config for ``shape`` (``layers`` / ``vocab``: fewer layers, a
    smaller vocabulary; neither changes a layer)."""
    import transformers

    L, v = layers or shape.layers, vocab or shape.vocab
    common: dict[str, Any] = dict(
        vocab_size=v, hidden_size=shape.hidden, num_hidden_layers=L, num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads, num_experts_per_tok=shape.top_k,
        max_position_embeddings=max(setup.seq_len, 128), use_cache=False, attention_dropout=0.0,
    )  # fmt: skip
    dense = [i for i in shape.dense_layers if i < L]
    config: transformers.PretrainedConfig
    if shape.family == "mixtral":
        config = transformers.MixtralConfig(
            **common, head_dim=shape.head_dim, intermediate_size=shape.moe_ffn, num_local_experts=shape.experts
        )
    elif shape.family == "deepseek_v3":
        m = shape.mla
        assert m is not None  # a deepseek_v3 shape carries its MLA sizes (checked at construction)
        config = transformers.DeepseekV3Config(
            **common, intermediate_size=shape.dense_ffn or 1, moe_intermediate_size=shape.moe_ffn,
            n_routed_experts=shape.experts, n_shared_experts=shape.shared_ffn // shape.moe_ffn,
            first_k_dense_replace=len(dense), n_group=shape.n_group, topk_group=shape.topk_group,
            norm_topk_prob=shape.norm_topk_prob, q_lora_rank=m.q_lora_rank, kv_lora_rank=m.kv_lora_rank,
            qk_rope_head_dim=m.qk_rope_head_dim, qk_nope_head_dim=m.qk_nope_head_dim, v_head_dim=m.v_head_dim,
        )  # fmt: skip
    else:
        cls = transformers.Qwen3MoeConfig if shape.family == "qwen3_moe" else transformers.Qwen2MoeConfig
        extra = {"shared_expert_intermediate_size": shape.shared_ffn} if shape.family == "qwen2_moe" else {}
        config = cls(
            **common,
            **extra,  # type: ignore[arg-type]  # a weight target always names its param
            intermediate_size=shape.dense_ffn or 1,
            moe_intermediate_size=shape.moe_ffn,
            num_experts=shape.experts,
            norm_topk_prob=shape.norm_topk_prob,
            mlp_only_layers=dense,
        )
        config.head_dim = shape.head_dim
    fused_only = setup.attention == "sdpa-fused" and shape.mla and shape.mla.qk_head_dim != shape.mla.v_head_dim
    if fused_only:
        raise ValueError(
            "attention 'sdpa-fused' with MLA head sizes that differ is not what torch runs on CPU "
            "(the math path); build it with 'sdpa'"
        )
    config._attn_implementation = "eager" if setup.attention == "eager" else "sdpa"
    return config


def recompute_config(recompute: Recompute) -> RecomputeConfig | None:
    """The :class:`RecomputeConfig` ``apply_recompute`` takes for a choice (None: none)."""
    if isinstance(recompute, RecomputeConfig):
        return recompute
    modules = modules_of(recompute)
    if not modules:
        return None
    if modules == ("full",):
        return RecomputeConfig.preset("full")
    return RecomputeConfig(granularity="selective", modules=list(modules))  # type: ignore[arg-type]  # a list is fine: stored as a tuple


def build_model(
    shape: MoEShape,
    setup: MoESetup,
    recompute: Recompute = "none",
    layers: int | None = None,
    vocab: int | None = None,
    seed: int = 0,
):
    """The ``*ForCausalLM`` of ``shape`` (``layers`` of them), split over TP and recomputing as told."""
    import transformers

    torch.manual_seed(seed)
    config = hf_config(shape, setup, layers, vocab)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=TORCH_DTYPES[setup.dtype])
    model.set_experts_implementation(setup.experts)
    model.train()
    if setup.tp > 1 or setup.sequence_parallel:
        from ...parallel.hf import apply_tensor_parallel

        model = apply_tensor_parallel(model, sequence_parallel=setup.sequence_parallel)
    config = recompute_config(recompute)
    if config is not None:
        apply_recompute(model, config)
    return model


@dataclass(frozen=True)
class Measured:
    """What one rank's layers kept: bytes per layer, and each kept storage
    ``(scope, dtype, shape, nbytes)``, largest first."""

    per_layer_bytes: list[int]
    unscoped_bytes: int
    storages: list[tuple[str, str, tuple[int, ...], int]]


FINAL_NORM_SCOPE = "final_norm"


def layer_inputs(model, setup: MoESetup, seed: int = 0):
    """``(x, position ids, shared)``: the embedding's output the base model is run from, and the
    tensors its layers share, as its forward makes them (``{"position_embeddings": the rotary
    tables, "attention_mask": the causal mask or None}``)."""
    from transformers.masking_utils import create_causal_mask

    g = torch.Generator().manual_seed(seed)
    inner = model.model
    x = torch.randn(setup.micro_batch, setup.seq_len, inner.config.hidden_size, generator=g)
    x = x.to(TORCH_DTYPES[setup.dtype])
    position_ids = torch.arange(setup.seq_len).unsqueeze(0)
    mask = create_causal_mask(config=inner.config, inputs_embeds=x, attention_mask=None, cache=None,
                              position_ids=position_ids)  # fmt: skip
    shared = {"position_embeddings": inner.rotary_emb(x, position_ids=position_ids), "attention_mask": mask}
    return x.requires_grad_(), position_ids, shared


def measure_layers(model, setup: MoESetup, seed: int = 0, backward: bool = True) -> Measured:
    """Run ``model``'s decoder layers once on this rank and count what each keeps for backward.

    Through the base model's forward, not layer by layer: sequence parallel learns the whole
    length from that forward's call (a fully recomputed first layer would split its input twice
    without it) and gathers after the final norm (counted apart, in its own scope)."""
    x, position_ids, shared = layer_inputs(model, setup, seed)
    inner = model.model
    layers = list(inner.layers)
    scopes = {LAYER_SCOPE.format(i): layer for i, layer in enumerate(layers)} | {FINAL_NORM_SCOPE: inner.norm}

    # Each layer gets these shared tensors (the values the forward made itself), which the recorder
    # knows to leave out: a checkpoint keeping the mask would count it in the first layer only.
    def share(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return args, {**kwargs, **shared}

    handles = [layer.register_forward_pre_hook(share, with_kwargs=True) for layer in layers]
    mask = shared["attention_mask"]
    excluded = [position_ids, *shared["position_embeddings"], *([mask] if torch.is_tensor(mask) else [])]
    try:
        with SavedTensorRecorder(exclude_modules=[model], exclude_tensors=excluded) as rec:
            handles += rec.attach(scopes)
            hidden = inner(inputs_embeds=x, position_ids=position_ids).last_hidden_state
    finally:
        for handle in handles:
            handle.remove()
    by_scope = rec.bytes_by_scope()
    per_layer = [by_scope.pop(LAYER_SCOPE.format(i), 0) for i in range(len(layers))]
    by_scope.pop(FINAL_NORM_SCOPE, None)
    storages = sorted(
        ((s.scope, str(s.dtype).removeprefix("torch."), s.shape, s.nbytes) for s in rec.storages),
        key=lambda row: -row[3],
    )
    if backward:
        hidden.float().square().mean().backward()
    return Measured(per_layer, sum(by_scope.values()), storages)


__all__ = ["Measured", "build_model", "hf_config", "layer_inputs", "measure_layers", "recompute_config"]
