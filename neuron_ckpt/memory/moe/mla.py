"""DeepSeek's multi-head latent attention (DeepSeek-V2 and V3), storage by storage (transformers
5.24, torch 2.13 on CPU).

``q_a_proj -> q_a_layernorm -> q_b_proj`` (``q_proj`` without a q latent), ``kv_a_proj_with_mqa
-> [latent | k_rot] -> kv_a_layernorm -> kv_b_proj``, RoPE on the rope parts, q and k
concatenated into new tensors (``expand_kv`` writes k into ``new_empty``), v a slice of
``kv_b_proj``'s output. The up part (``q_b_proj``, ``kv_b_proj``) keeps the two latents;
``mla_up_proj`` keeps them and a copy of k_rot. torch's CPU flash kernel needs q, k and v of one
head size; DeepSeek's differ (``qk_nope + qk_rope`` against ``v_head_dim``), so sdpa runs the math
path: fp32 copies of q and k scaled, the fp32 probabilities and an fp32 copy of v, whatever the
model's dtype. CUDA runs its memory-efficient kernel there, which keeps what the flash kernel
keeps: ``sdpa-fused`` prices that (the flash path's storages; on CPU measured where the head
sizes are equal). DeepSeek-V3's plan leaves MLA whole on every rank; DeepSeek-V2's splits the
heads (q/k/v and ``o_proj``'s input by ``t``; the latents, computed before the split, whole).
"""

from __future__ import annotations

from .norms import FP32, rms_norm
from .rules import LayerTensors
from .shape import MoESetup, MoEShape


def mla(layer: LayerTensors, shape: MoEShape, setup: MoESetup, x: str, variant: str = "full") -> None:
    """Latent attention reading the norm output ``x``; its ``core_attn`` and (DeepSeek-V3)
    ``mla_up_proj`` units."""
    m, t = shape.mla, shape.split("attention", setup.tp)
    assert m is not None  # an MLA family's shape carries its MLA sizes (checked at construction)
    T, b, s, w = setup.tokens, setup.micro_batch, setup.seq_len, setup.width
    a, split = shape.heads // t, t > 1
    layer.keep(x, "attn.proj")  # q_a_proj (or q_proj) and kv_a_proj_with_mqa
    if m.q_lora_rank is None:
        q_latent = layer.keep(x, "attn.mla.up")  # q_proj is the up part's
    else:
        q_a = layer.save("q_a_proj.out", w * T * m.q_lora_rank, False)
        q_latent = rms_norm(layer, "attn.q_a_layernorm", q_a, T * m.q_lora_rank, T, w, False)
        layer.keep(q_latent, "attn.mla.up")
    compressed = layer.save("kv_a_proj.out", w * T * (m.kv_lora_rank + m.qk_rope_head_dim), False)
    kv_latent = rms_norm(layer, "attn.kv_a_layernorm", compressed, T * m.kv_lora_rank, T, w, False)
    layer.keep(kv_latent, "attn.mla.up")
    q = layer.save("q", w * T * a * m.qk_head_dim, split)  # the concat of q_pass and q_rot
    k = layer.save("k", w * T * a * m.qk_head_dim, split)  # expand_kv's new_empty
    v = layer.save("kv_b_proj.out", w * T * a * (m.qk_nope_head_dim + m.v_head_dim), split)  # v: a slice of it
    dv = m.v_head_dim
    if setup.attention == "sdpa-fused" or (setup.attention == "sdpa" and m.qk_head_dim == dv):  # a fused kernel
        for name in (q, k, v):
            layer.keep(name, "attn.core")
        layer.save("logsumexp_fp32", FP32 * b * a * s, split, "attn.core")
        layer.save("attn_out", w * T * a * dv, split, "attn.core")
        # q is the concat's [b, a, s, d] tensor, so the output is too: o_proj keeps its transposed copy
        layer.save("o_proj.input", w * T * a * dv, split, "attn.o_proj")
    elif setup.attention == "sdpa":  # the math path, in fp32 on CPU
        layer.save("q_scaled_fp32", FP32 * T * a * m.qk_head_dim, split, "attn.core")
        layer.save("k_scaled_fp32", FP32 * T * a * m.qk_head_dim, split, "attn.core")
        layer.save("probs_fp32", FP32 * b * a * s * s, split, "attn.core")
        layer.save("v_fp32", FP32 * T * a * dv, split, "attn.core")
        layer.save("o_proj.input", w * T * a * dv, split, "attn.o_proj")
    else:
        layer.keep(q, "attn.core")
        layer.keep(k, "attn.core")  # one kv head per query head: nothing repeated, k's storage
        layer.save("v_contiguous", w * T * a * dv, split, "attn.core")
        probs = b * a * s * s
        layer.save("probs_fp32", FP32 * probs, split, "attn.core")
        if w != FP32:  # .to(dtype) is a copy the second matmul keeps
            layer.save("probs", w * probs, split, "attn.core")
        layer.save("o_proj.input", w * T * a * dv, split, "attn.o_proj")
    layer.unit("core_attn", ["attn.core"], [q, k, v])
    # The up part keeps the latents and a contiguous copy of k_rot (recompute/mla.py: the slice
    # would keep all of kv_a_proj's output); q, k and v (kv_b_proj's output) become notes.
    k_rot = layer.save("k_rot", w * T * m.qk_rope_head_dim, False)
    layer.unit("mla_up_proj", ["attn.mla.up"], [q_latent, kv_latent, k_rot], discards=[q, k, v])


__all__ = ["mla"]
