"""What a transformers model keeps outside its decoder layers, per rank: the embedding, the rotary
tables, the final norm, the LM head and the loss (transformers 5.24, torch 2.13 on CPU); the
masks the forward builds; the loss's transient bytes. The layers are :mod:`.layer`'s.

**Before the layers.** The embedding keeps its int64 ids ``[b, s]``; split by vocabulary rows
(``embedding_rowwise``: our :class:`~neuron_ckpt.parallel.VocabParallelEmbedding`) also its bool
out-of-shard mask. Gemma2 scales the embedding by ``sqrt(h)``, a 0-d tensor of the model's dtype
the multiply keeps. The rotary tables are computed once per forward and kept by every layer's
RoPE (as inputs of a checkpoint too): ``cos`` and ``sin`` ``[1, s, r]`` in the model's dtype
(``r``: the head size; DeepSeek-V3's ``qk_rope_head_dim``; GPT-OSS's half head), or one complex64
``[1, s, r/2]`` (DeepSeek-V2, Llama 4). Under tensor and sequence parallel they are whole.

**After the layers.** The final norm as a layer's (:func:`~.norms.rms_norm`: this rank's ``s/t``
tokens under sequence parallel), the LM head's input (the whole sequence: sequence parallel
gathers the norm's output first), Gemma2's final soft-capping (``tanh`` keeps its output, the
logits' size), and the loss: transformers' own at TP 1 (``logits.float()``, then
``cross_entropy``: the fp32 log-softmax ``[b s, v]``, the int64 targets, an fp32 total weight), the
vocabulary-parallel one ``apply_tensor_parallel`` installs at TP > 1 on ``logits.float()``
(:func:`~neuron_ckpt.parallel.vocab_parallel_cross_entropy`: its fp32 softmax ``[b s, v/t]``, the
targets, two bool masks, the mean's int64 count).

**Masks.** transformers builds one ``[b, 1, s, s]`` mask per attention variant a forward needs
and hands it to every layer of that variant: eager attention always (in the model's dtype: one
for the full layers, one for the sliding or chunked ones), sdpa only for a window or chunk the
sequence is not shorter than (bool; the kernel's converted copy is the layer's). They live while
the layers run (and as a checkpoint's inputs through backward): counted with the static items,
as the Llama budget counts its explicit attention's mask.

Measured against a whole model (``SavedTensorRecorder`` over a forward with labels, every family
at TP 1, less the layers' :func:`~.layer.layer_memory`): ``tests/test_planner_families.py``.
"""

from __future__ import annotations

from .families import FAMILY
from .norms import FP32, rms_norm
from .rules import LayerTensors
from .shape import MoESetup, MoEShape

INT64, BOOL, COMPLEX64 = 8, 1, 8
COMPLEX_ROTARY = ("deepseek_v2", "llama4_text")  # freqs_cis, complex64


def rotary_bytes(shape: MoEShape, setup: MoESetup) -> int:
    """The rotary tables every layer's RoPE keeps (one copy per forward)."""
    r = shape.mla.qk_rope_head_dim if shape.mla is not None else shape.head_dim
    if shape.family == "gpt_oss":
        r //= 2
    if shape.family in COMPLEX_ROTARY:
        return setup.seq_len * (r // 2) * COMPLEX64
    return 2 * setup.seq_len * r * setup.width


def embedding_bytes(shape: MoEShape, setup: MoESetup) -> int:
    """The embedding's ids (and out-of-shard mask when split, ``tp`` > 1), Gemma2's scale."""
    T = setup.tokens
    return T * INT64 + (T * BOOL if setup.tp > 1 else 0) + (setup.width if shape.family == "gemma2" else 0)


def final_norm_bytes(shape: MoEShape, setup: MoESetup) -> int:
    """The final norm (as :func:`~.norms.rms_norm` prices a layer's, its input included: the last
    layer's output, which no layer counts) and the LM head's whole-sequence input."""
    T, h, w = setup.local_tokens, shape.hidden, setup.width
    layer = LayerTensors()
    x = layer.save("input", w * T * h, setup.sequence_parallel)
    rms_norm(layer, "norm", x, T * h, T, w, setup.sequence_parallel, FAMILY[shape.family].norm)
    kept, _ = layer.kept(())  # a 16-bit input itself is not kept (its fp32 copy is); an fp32 one is
    return sum(t.nbytes for t in kept) + w * setup.tokens * h


def logits_elements(shape: MoEShape, setup: MoESetup) -> int:
    """Elements of this rank's logits ``[b, s, v/t]`` (the LM head split by vocabulary at t > 1)."""
    return setup.tokens * shape.vocab // setup.tp


def loss_bytes(shape: MoEShape, setup: MoESetup) -> int:
    """What the loss keeps (Gemma2's soft-capping included)."""
    T, n = setup.tokens, logits_elements(shape, setup)
    softcap = n * setup.width if shape.family == "gemma2" else 0
    if setup.tp == 1:  # cross_entropy on logits.float(): log_softmax's fp32 output, nll_loss's targets and weight
        return softcap + n * FP32 + T * INT64 + FP32
    return softcap + n * FP32 + T * (INT64 + 2 * BOOL) + INT64


def loss_transient_bytes(shape: MoEShape, setup: MoESetup) -> int:
    """The most the loss holds beyond what it keeps, while it runs: the logits and their fp32 copy;
    at TP > 1 also the vocabulary-parallel cross entropy's fp32 working buffer."""
    return logits_elements(shape, setup) * (setup.width + FP32 + (FP32 if setup.tp > 1 else 0))


def mask_bytes(shape: MoEShape, setup: MoESetup) -> tuple[int, str]:
    """The masks the forward builds (bytes, what they are)."""
    variants = {shape.variant(i) for i in range(shape.layers)}
    square = setup.micro_batch * setup.seq_len**2
    if setup.attention == "eager":
        groups = {"full" if v in ("full", "norope") else v for v in variants}
        what = f"{len(groups)} x [b, 1, s, s] {setup.dtype} ({', '.join(sorted(groups))})"
        return len(groups) * square * setup.width, what
    masked = {v for v in variants if v in ("sliding", "chunked") and setup.seq_len >= shape.window}
    return len(masked) * square * BOOL, f"{len(masked)} x [b, 1, s, s] bool ({', '.join(sorted(masked))})"


__all__ = [
    "embedding_bytes", "final_norm_bytes", "logits_elements", "loss_bytes", "loss_transient_bytes", "mask_bytes",
    "rotary_bytes",
]  # fmt: skip
