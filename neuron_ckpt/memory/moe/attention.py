"""The norms and the attention of a transformers MoE layer, storage by storage (transformers
5.24, torch 2.13 on CPU).

**RMSNorm** (every family's ``*RMSNorm``: ``x.to(fp32)``, ``* rsqrt(mean(x^2) + eps)``,
``.to(dtype)``, ``weight *``): the pow and the multiply keep the fp32 input (in bf16 a new fp32
copy; in fp32 ``.to`` is the input itself, so the norm keeps its input's storage, all of it even
when the input is a slice of a wider tensor, as DeepSeek's ``kv_a_layernorm`` is), the multiply
its fp32 ``1/rms`` (one per row), the weight's multiply the normalised value in the input dtype;
its output is kept by whatever reads it next.

**GQA** (Mixtral, Qwen): q, k, v projections keep the norm's output; RoPE's multiplies keep only
the shared cos/sin tables (outside the layer); Qwen3's per-head q/k norms are RMSNorms on
``[T, heads, d]``. Core attention, the function transformers' ``AttentionInterface`` runs:

* ``sdpa``: with no mask and ``d <= 256`` transformers passes the kv heads as they are
  (``enable_gqa``) and torch runs its fused flash kernel, which keeps q and k (RoPE's outputs),
  v (the v projection's output, a strided view of it), its output and an fp32 logsumexp per
  query row. The output takes q's memory layout, ``[b, s, heads, d]`` (RoPE keeps the
  projection's), so ``o_proj`` keeps the same storage.
* ``eager``: ``repeat_kv`` copies k and v to the query heads (v is copied by the matmul itself
  when nothing is repeated: a strided view); the score matmul keeps q and the repeated k, the
  softmax its fp32 output, the second matmul the probabilities in the activation dtype (the same
  storage in fp32) and v; ``o_proj`` keeps the transposed output's contiguous copy.

**MLA** (DeepSeek-V3): ``q_a_proj -> q_a_layernorm -> q_b_proj`` (``q_proj`` without a q
latent), ``kv_a_proj_with_mqa -> [latent | k_rot] -> kv_a_layernorm -> kv_b_proj``, RoPE on the
rope parts, q and k concatenated into new tensors (``expand_kv`` writes k into ``new_empty``), v
a slice of ``kv_b_proj``'s output. The up part (``q_b_proj``, ``kv_b_proj``) keeps the two
latents; ``mla_up_proj`` keeps them and a copy of k_rot. torch's CPU flash kernel needs q, k and
v of one head size; DeepSeek's differ (``qk_nope + qk_rope`` against ``v_head_dim``), so sdpa
runs the math path: fp32 copies of q and k scaled, the fp32 probabilities and an fp32 copy of v,
whatever the model's dtype. CUDA runs its memory-efficient kernel there, which keeps what the
flash kernel keeps: ``sdpa-fused`` prices that (the flash path's storages; on CPU measured where
the head sizes are equal).
"""

from __future__ import annotations

from ..rerun import RMSNORM, ROTARY, SOFTMAX
from .rules import LayerTensors
from .shape import MoESetup, MoEShape

_FP32 = 4
SDPA_GQA_MAX_HEAD_DIM = 256  # transformers' use_gqa_in_sdpa: above it, repeat_kv copies


def rms_norm(layer: LayerTensors, place: str, source: str, elements: int, rows: int, w: int, split: bool) -> str:
    """transformers' RMSNorm at ``place`` over ``elements`` values in ``rows`` rows, read from the
    storage ``source``; returns its output's name (kept by nobody yet). One op: its own products
    (the fp32 copy, ``1/rms``, the normalised value) are saved as it runs."""
    layer.op(place, elementwise=RMSNORM * elements)
    if w == _FP32:
        layer.keep(source, place)  # .to(float32) is the input: its whole storage stays
    else:
        layer.save(f"{place}.input_fp32", _FP32 * elements, split, place + "+")
    layer.save(f"{place}.rstd_fp32", _FP32 * rows, split, place + "+")
    layer.save(f"{place}.normalized", w * elements, split, place + "+")
    return layer.save(f"{place}.out", w * elements, split)


def gqa(layer: LayerTensors, shape: MoEShape, setup: MoESetup, x: str) -> None:
    """Mixtral's and Qwen's attention, reading the norm output ``x``; its ``core_attn`` unit."""
    t = shape.split("attention", setup.tp)
    T, b, s, w, d = setup.tokens, setup.micro_batch, setup.seq_len, setup.width, shape.head_dim
    a, g = shape.heads // t, shape.kv_heads // t
    split = t > 1
    layer.op("attn.proj", matmul=2 * T * shape.hidden * (a + 2 * g) * d)
    layer.keep(x, "attn.proj")
    if shape.family == "qwen3_moe":  # q_norm / k_norm: RMSNorm per head, on the projections' outputs
        rms_norm(layer, "attn.q_norm", layer.save("q_proj.out", w * T * a * d, split), T * a * d, T * a, w, split)
        rms_norm(layer, "attn.k_norm", layer.save("k_proj.out", w * T * g * d, split), T * g * d, T * g, w, split)
    layer.op("attn.rotary", elementwise=ROTARY * T * (a + g) * d)
    q = layer.save("q", w * T * a * d, split)  # RoPE's output
    k = layer.save("k", w * T * g * d, split)
    v = layer.save("v", w * T * g * d, split)  # v_proj's output, read through a strided view
    if setup.attention != "eager":
        if d > SDPA_GQA_MAX_HEAD_DIM:
            raise ValueError(
                f"head_dim ({d}) > {SDPA_GQA_MAX_HEAD_DIM}: transformers' sdpa repeats k and v, "
                "which this model does not price; use attention='eager'"
            )
        _kernel(layer, setup, a, d, d)
        layer.keep(q, "attn.core")
        layer.keep(k, "attn.core")
        layer.keep(v, "attn.core")
        layer.save("logsumexp_fp32", _FP32 * b * a * s, split, "attn.core+")
        layer.save("attn_out", w * T * a * d, split, "attn.core+", "attn.o_proj")
    else:
        _unfused(layer, setup, a, d, d)
        layer.keep(q, "attn.core.scores")
        if a == g:
            layer.keep(k, "attn.core.scores")
        else:
            layer.save("k_repeated", w * T * a * d, split, "attn.core.scores")
        layer.save("v_repeated" if a != g else "v_contiguous", w * T * a * d, split, "attn.core.pv")
        _eager_probabilities(layer, setup, a, split)
        layer.save("o_proj.input", w * T * a * d, split, "attn.o_proj")
    layer.op("attn.o_proj", matmul=2 * T * a * d * shape.hidden)
    layer.unit("core_attn", ["attn.core"], [q, k, v])


def mla(layer: LayerTensors, shape: MoEShape, setup: MoESetup, x: str) -> None:
    """DeepSeek-V3's latent attention, reading the norm output ``x``; its ``core_attn`` and
    ``mla_up_proj`` units."""
    m, t = shape.mla, shape.split("attention", setup.tp)
    assert m is not None  # a deepseek_v3 shape carries its MLA sizes (checked at construction)
    T, b, s, w, h = setup.tokens, setup.micro_batch, setup.seq_len, setup.width, shape.hidden
    a, split = shape.heads // t, t > 1
    q_in = m.q_lora_rank or h  # q_b_proj's input: the q latent, or q_proj's: the norm output
    layer.op("attn.proj", matmul=2 * T * h * ((m.q_lora_rank or 0) + m.kv_lora_rank + m.qk_rope_head_dim))
    layer.keep(x, "attn.proj")  # q_a_proj (or q_proj) and kv_a_proj_with_mqa
    if m.q_lora_rank is None:
        q_latent = layer.keep(x, "attn.mla.up")  # q_proj is the up part's
    else:
        q_a = layer.save("q_a_proj.out", w * T * m.q_lora_rank, False)
        q_latent = rms_norm(layer, "attn.q_a_layernorm", q_a, T * m.q_lora_rank, T, w, False)
        layer.keep(q_latent, "attn.mla.up")
    compressed = layer.save("kv_a_proj.out", w * T * (m.kv_lora_rank + m.qk_rope_head_dim), False)
    kv_latent = rms_norm(layer, "attn.kv_a_layernorm", compressed, T * m.kv_lora_rank, T, w, False)
    up = 2 * T * (q_in * a * m.qk_head_dim + m.kv_lora_rank * a * (m.qk_nope_head_dim + m.v_head_dim))
    layer.op("attn.mla.up", matmul=up, elementwise=ROTARY * T * (a + 1) * m.qk_rope_head_dim)
    layer.keep(kv_latent, "attn.mla.up")
    q = layer.save("q", w * T * a * m.qk_head_dim, split)  # the concat of q_pass and q_rot
    k = layer.save("k", w * T * a * m.qk_head_dim, split)  # expand_kv's new_empty
    v = layer.save("kv_b_proj.out", w * T * a * (m.qk_nope_head_dim + m.v_head_dim), split)  # v: a slice of it
    dv = m.v_head_dim
    if setup.attention == "sdpa-fused" or (setup.attention == "sdpa" and m.qk_head_dim == dv):  # a fused kernel
        _kernel(layer, setup, a, m.qk_head_dim, dv)
        for name in (q, k, v):
            layer.keep(name, "attn.core")
        layer.save("logsumexp_fp32", _FP32 * b * a * s, split, "attn.core+")
        layer.save("attn_out", w * T * a * dv, split, "attn.core+")
        # q is the concat's [b, a, s, d] tensor, so the output is too: o_proj keeps its transposed copy
        layer.save("o_proj.input", w * T * a * dv, split, "attn.o_proj")
    elif setup.attention == "sdpa":  # the math path, in fp32 on CPU
        _unfused(layer, setup, a, m.qk_head_dim, dv)
        layer.save("q_scaled_fp32", _FP32 * T * a * m.qk_head_dim, split, "attn.core.scores")
        layer.save("k_scaled_fp32", _FP32 * T * a * m.qk_head_dim, split, "attn.core.scores")
        layer.save("probs_fp32", _FP32 * b * a * s * s, split, "attn.core.softmax+", "attn.core.pv")
        layer.save("v_fp32", _FP32 * T * a * dv, split, "attn.core.pv")
        layer.save("o_proj.input", w * T * a * dv, split, "attn.o_proj")
    else:
        _unfused(layer, setup, a, m.qk_head_dim, dv)
        layer.keep(q, "attn.core.scores")
        layer.keep(k, "attn.core.scores")  # one kv head per query head: nothing repeated, k's storage
        layer.save("v_contiguous", w * T * a * dv, split, "attn.core.pv")
        _eager_probabilities(layer, setup, a, split)
        layer.save("o_proj.input", w * T * a * dv, split, "attn.o_proj")
    layer.op("attn.o_proj", matmul=2 * T * a * dv * h)
    layer.unit("core_attn", ["attn.core"], [q, k, v])
    # The up part keeps the latents and a contiguous copy of k_rot (recompute/mla.py: the slice
    # would keep all of kv_a_proj's output); q, k and v (kv_b_proj's output) become notes.
    k_rot = layer.save("k_rot", w * T * m.qk_rope_head_dim, False)
    layer.unit("mla_up_proj", ["attn.mla.up"], [q_latent, kv_latent, k_rot], discards=[q, k, v])


def _kernel(layer: LayerTensors, setup: MoESetup, heads: int, dqk: int, dv: int) -> None:
    """A fused attention kernel, one op: ``QK^T`` and ``probs @ V`` over the whole square (as torch
    counts them), saving its inputs before and its output and logsumexp after."""
    square = setup.micro_batch * heads * setup.seq_len**2
    layer.op("attn.core", matmul=2 * square * (dqk + dv), elementwise=SOFTMAX * square)


def _unfused(layer: LayerTensors, setup: MoESetup, heads: int, dqk: int, dv: int) -> None:
    """Eager attention (or sdpa's math path): the score matmul, the softmax, the matmul with V."""
    square = setup.micro_batch * heads * setup.seq_len**2
    layer.op("attn.core.scores", matmul=2 * square * dqk)
    layer.op("attn.core.softmax", elementwise=SOFTMAX * square)
    layer.op("attn.core.pv", matmul=2 * square * dv)


def _eager_probabilities(layer: LayerTensors, setup: MoESetup, heads: int, split: bool) -> None:
    probs = setup.micro_batch * heads * setup.seq_len**2
    fp32 = setup.width == _FP32  # .to(fp32) is the softmax output itself, which the second matmul keeps
    layer.save("probs_fp32", _FP32 * probs, split, "attn.core.softmax+", *(["attn.core.pv"] if fp32 else []))
    if not fp32:  # .to(dtype) is a copy the second matmul keeps
        layer.save("probs", setup.width * probs, split, "attn.core.pv")


__all__ = ["gqa", "mla", "rms_norm"]
