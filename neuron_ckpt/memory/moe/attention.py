"""The attention of a transformers layer (GQA, every family but DeepSeek's: :mod:`.mla`), storage
by storage (transformers 5.24, torch 2.13 on CPU).

**Projections.** q, k, v projections keep the norm's output (Phi-3's fused ``qkv_proj`` once; v
is then a view of its whole output). RoPE's multiplies keep only the shared cos/sin tables
(outside the layer); where RoPE ends in a ``cat`` (Phi-3, GPT-OSS: ``rope_copy``) q and k are new
``[b, a, s, d]`` tensors, else they keep the projection's ``[b, s, a, d]`` layout. q/k norms
(:mod:`.norms`): Qwen3's per head and OLMoE's over the projection, before RoPE (the projection's
output is their input); Llama 4's weightless L2 norm after RoPE, on RoPE layers. Llama 4's NoPE
layers scale q by an fp32 ``[s]`` factor (``attn_temperature_tuning``), which the multiply keeps.

**Core attention**, the function transformers' ``AttentionInterface`` runs:

* ``sdpa`` without a mask (full attention, or a window or chunk the sequence fits in): with
  ``d <= 256`` transformers passes the kv heads as they are (``enable_gqa``) and torch runs its
  fused flash kernel, which keeps q, k, v (the projection's output v is a view of), its output
  and an fp32 logsumexp per query row. The output takes q's layout, so ``o_proj`` keeps the same
  storage, unless RoPE made q ``[b, a, s, d]``: then it keeps the transposed output's copy.
* ``sdpa`` with a mask (a sliding window or chunk the sequence is not shorter than):
  ``repeat_kv`` copies k and v to the query heads (where there are fewer, and more than one kv
  head: one stays a strided view) and torch converts the boolean ``[b, 1, s, s]`` mask into one
  of the activation dtype, which the kernel keeps.
* ``eager``: ``repeat_kv`` copies k and v (v is copied by the matmul itself when nothing is
  repeated: a strided view); the score matmul keeps q and the repeated k; Gemma2's soft-capping
  keeps ``tanh``'s output; the softmax its fp32 output, the second matmul the probabilities in
  the activation dtype (the same storage in fp32) and v. GPT-OSS's sinks instead: the max
  subtracted keeps its int64 indices, the softmax (in the activation dtype) its ``s + 1``-wide
  output, which the matmul reads through a slice. ``o_proj`` keeps the transposed output's copy.

Under TP a plan that splits heads gives each rank ``a/t`` and ``g/t`` heads of all of it; a plan
that gathers (Phi-3, OLMoE) runs attention whole on every rank and ``o_proj`` keeps a ``1/t``
slice of its input; GPT-OSS's plan leaves attention whole.
"""

from __future__ import annotations

from .families import FAMILY
from .mla import mla
from .norms import FP32, rms_norm
from .rules import LayerTensors
from .shape import MoESetup, MoEShape

SDPA_GQA_MAX_HEAD_DIM = 256  # transformers' use_gqa_in_sdpa: above it, repeat_kv copies
_INT64 = 8


def masked(shape: MoEShape, setup: MoESetup, variant: str) -> bool:
    """Whether transformers passes sdpa a mask for a layer of ``variant``: a window or chunk that
    the sequence is not shorter than (``_ignore_causal_mask_sdpa``)."""
    return variant in ("sliding", "chunked") and setup.seq_len >= shape.window


def gqa(layer: LayerTensors, shape: MoEShape, setup: MoESetup, x: str, variant: str = "full") -> None:
    """Attention reading the norm output ``x``, for a layer of ``variant``; its ``core_attn`` unit."""
    family, t, d = FAMILY[shape.family], shape.split("attention", setup.tp), shape.head_dim
    a, g = shape.heads // t, shape.kv_heads // t
    split = t > 1
    layer.keep(x, "attn.proj")
    q, k, v = _projections(layer, shape, setup, variant, a, g, split)
    if setup.attention != "eager":
        if family.eager_only:
            raise ValueError(
                f"attention: transformers runs {shape.family}'s attention eager only (soft-capping, sinks); "
                "use attention='eager'"
            )
        if d > SDPA_GQA_MAX_HEAD_DIM:
            raise ValueError(
                f"head_dim ({d}) > {SDPA_GQA_MAX_HEAD_DIM}: transformers' sdpa repeats k and v, "
                "which this model does not price; use attention='eager'"
            )
        out = _sdpa(layer, shape, setup, variant, (q, k, v), a, g, split)
    else:
        out = _eager(layer, shape, setup, (q, k, v), a, g, split)
    _o_proj(layer, shape, setup, out, a, split)
    layer.unit("core_attn", ["attn.core"], [q, k, v])


def _projections(layer, shape, setup, variant, a, g, split) -> tuple[str, str, str]:
    family, T, w, d = FAMILY[shape.family], setup.tokens, setup.width, shape.head_dim
    if family.qkv == "fused":  # q and k are slices of qkv_proj's output, v a view of all of it
        v = layer.save("qkv_proj.out", w * T * (a + 2 * g) * d, split)
        q_in, k_in = v, v
    else:
        q_in = layer.save("q_proj.out", w * T * a * d, split)
        k_in = layer.save("k_proj.out", w * T * g * d, split)
        v = layer.save("v", w * T * g * d, split)  # v_proj's output, read through a strided view
    if family.qk_norm in ("head", "proj"):  # RMSNorm per head (rows T a) or over the projection (rows T)
        per_head = family.qk_norm == "head"
        q_in = rms_norm(layer, "attn.q_norm", q_in, T * a * d, T * a if per_head else T, w, split)
        k_in = rms_norm(layer, "attn.k_norm", k_in, T * g * d, T * g if per_head else T, w, split)
    if variant == "norope":  # Llama 4: no RoPE; k is the projection's output
        if shape.temperature_tuning:
            layer.save("attn.temperature_fp32", FP32 * setup.seq_len, False, "attn.temperature")
            return layer.save("q", w * T * a * d, split), k_in, v
        return q_in, k_in, v
    q = layer.save("q", w * T * a * d, split)  # RoPE's output
    k = layer.save("k", w * T * g * d, split)
    if family.qk_norm == "l2" and shape.qk_norm:
        q = rms_norm(layer, "attn.q_norm", q, T * a * d, T * a, w, split, "l2")
        k = rms_norm(layer, "attn.k_norm", k, T * g * d, T * g, w, split, "l2")
    return q, k, v


def _sdpa(layer, shape, setup, variant, qkv, a, g, split) -> str:
    q, k, v = qkv
    T, b, s, w, d = setup.tokens, setup.micro_batch, setup.seq_len, setup.width, shape.head_dim
    layer.keep(q, "attn.core")
    if masked(shape, setup, variant):
        layer.save("attn.mask", w * b * s * s, False, "attn.core")
        if a != g and g > 1:  # one kv head (per rank): repeat_kv's expand and reshape stay a view
            k = layer.save("k_repeated", w * T * a * d, split)
            v = layer.save("v_repeated", w * T * a * d, split)
    layer.keep(k, "attn.core")
    layer.keep(v, "attn.core")
    layer.save("logsumexp_fp32", FP32 * b * a * s, split, "attn.core")
    return layer.save("attn_out", w * T * a * d, split, "attn.core")


def _eager(layer, shape, setup, qkv, a, g, split) -> str:
    q, k, v = qkv
    family, T, w, d = FAMILY[shape.family], setup.tokens, setup.width, shape.head_dim
    b, s = setup.micro_batch, setup.seq_len
    layer.keep(q, "attn.core")
    if a == g:
        layer.keep(k, "attn.core")
    else:
        layer.save("k_repeated", w * T * a * d, split, "attn.core")
    layer.save("v_repeated" if a != g else "v_contiguous", w * T * a * d, split, "attn.core")
    probs = b * a * s * s
    if family.sinks:
        layer.save("sinks.max_indices", _INT64 * b * a * s, split, "attn.core")
        layer.save("probs_with_sink", w * b * a * s * (s + 1), split, "attn.core")
    else:
        if shape.softcap:
            layer.save("softcap.tanh", w * probs, split, "attn.core")
        layer.save("probs_fp32", FP32 * probs, split, "attn.core")
        if w != FP32:  # .to(dtype) is a copy the second matmul keeps
            layer.save("probs", w * probs, split, "attn.core")
    return layer.save("attn_out", w * T * a * d, split)  # transpose(1, 2).contiguous(): o_proj's input


def _o_proj(layer, shape, setup, out, a, split) -> None:
    """``o_proj``'s kept input: the attention output itself, its transposed copy, or (a gathering
    plan) this rank's contiguous ``1/t`` slice of it."""
    family, T, w, d = FAMILY[shape.family], setup.tokens, setup.width, shape.head_dim
    if family.split["attention"] == "gathered" and setup.tp > 1:
        layer.save("o_proj.input_slice", w * T * a * d // setup.tp, True, "attn.o_proj")
    elif setup.attention == "eager" or not family.rope_copy:
        layer.keep(out, "attn.o_proj")
    else:  # the kernel's output is [b, a, s, d]: o_proj keeps its transposed copy
        layer.save("o_proj.input", w * T * a * d, split, "attn.o_proj")


__all__ = ["SDPA_GQA_MAX_HEAD_DIM", "gqa", "masked", "mla", "rms_norm"]
