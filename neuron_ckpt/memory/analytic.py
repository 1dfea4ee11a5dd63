"""Analytic activation memory of one transformer layer, tensor by tensor.

Two layers, both built tensor by tensor rather than from closed forms, so a report can print
where the bytes go and a measurement can be compared term by term:

* the paper's GPT layer (Korthikanti et al. 2022, Table 2): LayerNorm -> QKV -> softmax(QK^T)
  -> dropout -> attention over V -> output projection -> dropout -> residual; LayerNorm -> fc1
  (h -> 4h) -> GeLU -> fc2 -> dropout -> residual. Activations are ``setup.width`` bytes wide,
  dropout masks 1 byte (what ``torch.native_dropout`` saves). Presets none, selective, full:
  exactly the rows of Table 2.
* the Llama layer (:mod:`neuron_ckpt.models.llama`): RMSNorm, GQA, rotary, fp32 softmax kept in 16 bits, SwiGLU,
  no dropout; derived in docs/memory.md ("The Llama layer"). Every preset, with either core
  attention (``setup.attention``): explicit (the ``s^2`` probabilities) or flash (torch's SDPA
  flash kernel: an fp32 logsumexp per query row instead).

Every function takes ``(model, setup, recompute)``: a :class:`~.shape.ModelShape`, a
:class:`~.shape.TrainingSetup` (its seq_len, micro_batch, tp, dtype and sequence_parallel) and a
recompute preset, by name (:data:`~neuron_ckpt.recompute.PRESETS`) or as the
:class:`~neuron_ckpt.recompute.RecomputeConfig` it names (which also carries
``distribute_saved_activations``). Every count is an exact integer: the checks make every
division by t exact.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Union

from ..recompute import PRESETS, RecomputeConfig
from .shape import ModelShape, TrainingSetup

Recompute = Union[str, RecomputeConfig]
_FP32, _BOOL = 4, 1


@dataclass(frozen=True)
class ActivationTerm:
    """One tensor kept for backward: its name, its bytes on one rank, and whether TP split it."""

    name: str
    nbytes: int
    split_by_tp: bool


def supported_presets(model: ModelShape) -> tuple[str, ...]:
    """The presets the model prices: every one for Llama; for GPT those without ``mlp_act`` (the
    paper's layer has no SwiGLU; Table 2 has none, selective and full)."""
    return tuple(p for p in PRESETS if model.kind == "llama" or "mlp_act" not in RecomputeConfig.preset(p).modules)


def resolve(model: ModelShape, setup: TrainingSetup, recompute: Recompute) -> tuple[str, bool]:
    """``(preset name, distribute_saved_activations)`` of ``recompute``, checked against the
    model and the setup; a ``ValueError`` naming the field otherwise."""
    config = recompute if isinstance(recompute, RecomputeConfig) else RecomputeConfig.preset(recompute)
    name = config.preset_name
    if name is None:
        raise ValueError(f"recompute: {config!r} is none of the presets {list(PRESETS)} the memory model prices")
    if name not in supported_presets(model):
        raise ValueError(f"recompute {name!r} is not modelled for {model.kind}; choose from "
                         f"{list(supported_presets(model))}")
    if setup.attention == "flash" and model.kind == "gpt":
        raise ValueError("attention 'flash' is modelled for llama only: the paper's GPT layer has attention dropout, "
                         "with which torch's CPU flash kernel falls back to its math path (fp32 [b, a, s, s] tensors "
                         "kept, not modelled); use attention='explicit' for gpt")
    distribute = config.distribute_saved_activations
    # Megatron refuses distributing with sequence parallel and with anything but full recompute.
    if distribute and setup.sequence_parallel:
        raise ValueError("distribute_saved_activations must be False when sequence_parallel is True "
                         "(the saved layer input is already a 1/t sequence shard)")
    if distribute and name != "full":
        raise ValueError(f"distribute_saved_activations requires recompute='full', got recompute={name!r}")
    why = model.valid_tp(setup.tp, setup.seq_len if setup.sequence_parallel else None, include_vocab=False)
    if why is not None:
        raise ValueError(why)
    if model.head_dim * model.heads != model.hidden:
        raise ValueError(f"head_dim ({model.head_dim}) * heads ({model.heads}) must equal hidden "
                         f"({model.hidden}) for the memory model")
    return name, distribute


def layer_activation_terms(model: ModelShape, setup: TrainingSetup, recompute: Recompute) -> list[ActivationTerm]:
    """The tensors one layer keeps for backward on one rank, with their bytes.

    Full recompute keeps one term, ``layer_input``: 2sbh, or 2sbh/t when it is a sequence
    shard (sequence parallel) or distributed across the TP group.
    """
    name, distribute = resolve(model, setup, recompute)
    terms = _gpt_terms if model.kind == "gpt" else _llama_terms
    return terms(model, setup, name, distribute)


def layer_activation_bytes(model: ModelShape, setup: TrainingSetup, recompute: Recompute) -> int:
    """Activation bytes one layer keeps for backward on one rank (for GPT, a row of Table 2)."""
    return sum(term.nbytes for term in layer_activation_terms(model, setup, recompute))


def outside_layer_terms(model: ModelShape, setup: TrainingSetup, recompute: Recompute) -> list[ActivationTerm]:
    """Terms one stack of layers shares: Llama's rotary tables (:func:`rotary_terms`), none
    under full recompute; none for GPT."""
    name, _ = resolve(model, setup, recompute)
    return rotary_terms(model, setup) if model.kind == "llama" and name != "full" else []


def model_activation_bytes(
    model: ModelShape, setup: TrainingSetup, recompute: Recompute, outside: Sequence[ActivationTerm] = ()
) -> int:
    """Activation bytes of ``model.layers`` identical layers plus the terms ``outside`` them.

    ``outside`` is the hook for what the layers do not cover: the embedding's dropout mask, the
    final norm's input, the LM head input and the loss's logits (the paper's section 4.3).
    Nothing is added by default; the whole-model budget (:mod:`.budget`) adds them.
    """
    return model.layers * layer_activation_bytes(model, setup, recompute) + sum(t.nbytes for t in outside)


# --------------------------------------------------------------------------------------------
# The paper's GPT layer.

# name, elements in units of sbh, is a mask, split by t under TP without SP.
# Under TP alone the norms, the QKV and fc1 inputs and the dropouts after the row-parallel
# layers see the full [s, b, h] activation on every rank (10sbh); everything between a column
# and a row layer is split by heads or by the 4h dimension (24sbh/t + 5as^2b/t).
_SBH_TERMS: tuple[tuple[str, int, bool, bool], ...] = (
    ("ln1_input", 1, False, False),
    ("qkv_input", 1, False, False),
    ("q_k", 2, False, True),
    ("v", 1, False, True),
    ("proj_input", 1, False, True),
    ("attn_dropout_mask", 1, True, False),
    ("ln2_input", 1, False, False),
    ("mlp_fc1_input", 1, False, False),
    ("gelu_input", 4, False, True),
    ("fc2_input", 4, False, True),
    ("mlp_dropout_mask", 1, True, False),
)
# The attention core, in units of as^2b: what selective recompute drops. Split by heads under TP.
_CORE_TERMS: tuple[tuple[str, int, bool], ...] = (
    ("softmax_out", 1, False),
    ("softmax_dropout_mask", 1, True),
    ("attn_dropout_out", 1, False),
)


def _gpt_terms(model: ModelShape, setup: TrainingSetup, name: str, distribute: bool) -> list[ActivationTerm]:
    t, w, sp = setup.tp, setup.width, setup.sequence_parallel
    sbh = setup.seq_len * setup.micro_batch * model.hidden
    as2b = model.heads * setup.seq_len * setup.seq_len * setup.micro_batch
    if name == "full":
        split = sp or distribute
        return [ActivationTerm("layer_input", w * sbh // t if split else w * sbh, split)]
    terms = []
    for term, units, is_mask, split_under_tp in _SBH_TERMS:
        split = split_under_tp or sp
        nbytes = units * (_BOOL if is_mask else w) * sbh
        terms.append(ActivationTerm(term, nbytes // t if split else nbytes, split))
    if name == "none":
        for term, units, is_mask in _CORE_TERMS:
            terms.append(ActivationTerm(term, units * (_BOOL if is_mask else w) * as2b // t, True))
    return terms


# --------------------------------------------------------------------------------------------
# The Llama layer.


def _rmsnorm_terms(prefix: str, sb: int, h: int, width: int) -> list[tuple[str, int]]:
    # The fused RMSNorm (parallel/fused_ops.py) keeps its input as it is and the [s, b, 1] fp32
    # 1/rms; backward recomputes the normalised value from them.
    return [(f"{prefix}_input", width * sb * h), (f"{prefix}_rstd_fp32", _FP32 * sb)]


def _llama_terms(model: ModelShape, setup: TrainingSetup, name: str, distribute: bool) -> list[ActivationTerm]:
    """The Llama layer's terms. Selective recompute drops the attention core: with explicit
    attention the softmax output in the activation dtype (the ``s^2`` term), with flash the
    kernel's fp32 logsumexp (its output is the projection's input, kept either way; its q, k
    and v are the checkpoint's inputs). ``mlp_act`` drops nothing more (the fused SwiGLU keeps
    only gate and up, which its checkpoint would keep too); full recompute keeps only the layer
    input."""
    s, b, h, t, w = setup.seq_len, setup.micro_batch, model.hidden, setup.tp, setup.width
    sp = setup.sequence_parallel
    if name == "full":
        split = sp or distribute
        nbytes = w * s * b * h
        return [ActivationTerm("layer_input", -(-nbytes // t) if split else nbytes, split)]
    # Replicated over TP without sequence parallel, a 1/t sequence shard with it.
    sb = s * b // t if sp else s * b
    outside = [
        *_rmsnorm_terms("norm1", sb, h, w),
        ("qkv_input", w * sb * h),
        *_rmsnorm_terms("norm2", sb, h, w),
        ("mlp_input", w * sb * h),
    ]
    d, a_loc, g_loc, f_loc = model.head_dim, model.local_heads(t), model.local_kv_heads(t), model.ffn // t
    inside = [
        ("q", w * s * b * a_loc * d),  # after rotary: the score matmul (or checkpoint) keeps it
        ("k", w * s * b * g_loc * d),  # at kv heads: never repeated to the query heads
        ("v", w * s * b * g_loc * d),
        ("proj_input", w * s * b * a_loc * d),
        ("gate", w * s * b * f_loc),  # the fused SwiGLU keeps its inputs and recomputes silu(gate)
        ("up", w * s * b * f_loc),
        ("down_input", w * s * b * f_loc),
    ]
    if name == "none" and setup.attention == "explicit":
        # The fused masked softmax keeps only its output, in the activation dtype: the tensor
        # the matmul with V keeps too (one storage).
        inside.append(("probs", w * a_loc * s * s * b))
    elif name == "none":
        # torch's flash kernel: q, k, v (k and v at kv heads, as above; it keeps contiguous
        # [b, heads, s, d] copies of them instead of the rotary outputs), its output (the
        # projection's input) and one fp32 logsumexp per query row.
        inside.append(("softmax_lse_fp32", _FP32 * a_loc * s * b))
    return [ActivationTerm(n, v, sp) for n, v in outside] + [ActivationTerm(n, v, True) for n, v in inside]


def rotary_terms(model: ModelShape, setup: TrainingSetup) -> list[ActivationTerm]:
    """Llama's rotary cos and sin tables ``[s, d]``, shared by every layer.

    Rotary multiplies q and k by them, which keeps the tables (not q, k: the tables need no
    gradient). The embedding, final norm, LM head input and loss terms are in the whole-model
    budget (:mod:`.budget`).
    """
    nbytes = setup.width * setup.seq_len * model.head_dim
    return [ActivationTerm("rope_cos", nbytes, False), ActivationTerm("rope_sin", nbytes, False)]


__all__ = [
    "ActivationTerm", "layer_activation_bytes", "layer_activation_terms", "model_activation_bytes",
    "outside_layer_terms", "resolve", "rotary_terms", "supported_presets",
]  # fmt: skip
