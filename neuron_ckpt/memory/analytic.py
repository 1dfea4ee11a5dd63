"""Analytic activation memory of the paper's GPT layer (Korthikanti et al. 2022, Table 2).

The model is built tensor by tensor rather than from the closed forms, so a report can print
where the bytes go and a measurement can be compared term by term. Every count is an exact
integer: the shape validation (h % t == 0, a % t == 0) makes every division by t exact.

The layer is the paper's: LayerNorm -> QKV -> softmax(QK^T) -> dropout -> attention over V ->
output projection -> dropout -> residual; LayerNorm -> fc1 (h -> 4h) -> GeLU -> fc2 -> dropout ->
residual. Activations are ``bytes_per_element`` wide, dropout masks ``mask_bytes`` wide.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Sequence, get_args

RecomputeMode = Literal["none", "selective", "full"]
RECOMPUTE_MODES: tuple[str, ...] = get_args(RecomputeMode)


def _require_positive_int(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


@dataclass(frozen=True)
class LayerShape:
    """Shape of one transformer layer's activations, in the paper's symbols.

    seq_len: s, tokens per sequence.
    micro_batch: b, sequences per micro-batch.
    hidden: h, model width.
    heads: a, attention heads; the s^2 terms scale with it.
    tp: t, tensor-parallel degree; must divide hidden and heads so every shard is whole.
    bytes_per_element: 2 for 16-bit activations (the paper's assumption).
    mask_bytes: 1 for a bool dropout mask (what ``torch.native_dropout`` saves).
    """

    seq_len: int
    micro_batch: int
    hidden: int
    heads: int
    tp: int = 1
    bytes_per_element: int = 2
    mask_bytes: int = 1

    def __post_init__(self) -> None:
        for name in ("seq_len", "micro_batch", "hidden", "heads", "tp",
                     "bytes_per_element", "mask_bytes"):
            _require_positive_int(name, getattr(self, name))
        if self.hidden % self.heads:
            raise ValueError(
                f"hidden ({self.hidden}) must be a multiple of heads ({self.heads})")
        if self.hidden % self.tp:
            raise ValueError(f"tp ({self.tp}) must divide hidden ({self.hidden})")
        if self.heads % self.tp:
            raise ValueError(f"tp ({self.tp}) must divide heads ({self.heads})")

    @property
    def sbh(self) -> int:
        """Elements of one [s, b, h] activation: the unit of the paper's 34sbh."""
        return self.seq_len * self.micro_batch * self.hidden

    @property
    def as2b(self) -> int:
        """Elements of the attention scores, a*s*s*b: the unit of the paper's 5as^2b."""
        return self.heads * self.seq_len * self.seq_len * self.micro_batch


@dataclass(frozen=True)
class ActivationConfig:
    """How a layer is parallelised and recomputed; decides which terms are kept and split.

    sequence_parallel: shard the replicated regions (norms, dropouts) along the sequence.
    recompute: "none" keeps every term; "selective" recomputes the attention core (the
        5as^2b terms); "full" keeps only the layer input and recomputes the whole layer.
    distribute_saved_activations: with full recompute, keep only this rank's 1/t slice of the
        layer input. Megatron refuses it with sequence parallel (the input is already a
        sequence shard) and with anything but full recompute; so do we.
    """

    sequence_parallel: bool = False
    recompute: RecomputeMode = "none"
    distribute_saved_activations: bool = False

    def __post_init__(self) -> None:
        if self.recompute not in RECOMPUTE_MODES:
            raise ValueError(
                f"recompute must be one of {RECOMPUTE_MODES}, got {self.recompute!r}")
        if self.distribute_saved_activations and self.sequence_parallel:
            raise ValueError(
                "distribute_saved_activations must be False when sequence_parallel is True "
                "(the saved layer input is already a 1/t sequence shard)")
        if self.distribute_saved_activations and self.recompute != "full":
            raise ValueError(
                "distribute_saved_activations requires recompute='full', "
                f"got recompute={self.recompute!r}")


@dataclass(frozen=True)
class ActivationTerm:
    """One tensor kept for backward: its name, its bytes on one rank, and whether TP split it."""

    name: str
    nbytes: int
    split_by_tp: bool


# name, elements in units of sbh or as^2b, is a mask, split by t under TP without SP.
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
# The attention core: what selective recompute drops. Always split by heads under TP.
_CORE_TERMS: tuple[tuple[str, int, bool], ...] = (
    ("softmax_out", 1, False),
    ("softmax_dropout_mask", 1, True),
    ("attn_dropout_out", 1, False),
)


def _check_compatible(shape: LayerShape, config: ActivationConfig) -> None:
    if config.sequence_parallel and shape.seq_len % shape.tp:
        raise ValueError(
            f"seq_len ({shape.seq_len}) must be a multiple of tp ({shape.tp}) "
            "when sequence_parallel is True")


def _width(shape: LayerShape, is_mask: bool) -> int:
    return shape.mask_bytes if is_mask else shape.bytes_per_element


def layer_activation_terms(shape: LayerShape, config: ActivationConfig) -> list[ActivationTerm]:
    """The tensors one layer keeps for backward on one rank, with their bytes.

    Full recompute keeps one term, ``layer_input``: 2sbh, or 2sbh/t when it is a sequence
    shard (sequence parallel) or distributed across the TP group.
    """
    _check_compatible(shape, config)
    t = shape.tp
    if config.recompute == "full":
        split = config.sequence_parallel or config.distribute_saved_activations
        nbytes = shape.bytes_per_element * shape.sbh
        return [ActivationTerm("layer_input", nbytes // t if split else nbytes, split)]
    terms = []
    for name, units, is_mask, split_under_tp in _SBH_TERMS:
        split = split_under_tp or config.sequence_parallel
        nbytes = units * _width(shape, is_mask) * shape.sbh
        terms.append(ActivationTerm(name, nbytes // t if split else nbytes, split))
    if config.recompute == "none":
        for name, units, is_mask in _CORE_TERMS:
            nbytes = units * _width(shape, is_mask) * shape.as2b
            terms.append(ActivationTerm(name, nbytes // t, True))
    return terms


def layer_activation_bytes(shape: LayerShape, config: ActivationConfig) -> int:
    """Activation bytes one layer keeps for backward on one rank (a row of Table 2)."""
    return sum(term.nbytes for term in layer_activation_terms(shape, config))


def model_activation_bytes(
    shape: LayerShape,
    config: ActivationConfig,
    num_layers: int,
    outside_layer_terms: Sequence[ActivationTerm] = (),
) -> int:
    """Activation bytes of ``num_layers`` identical layers plus the terms outside them.

    ``outside_layer_terms`` is the hook for what the layers do not cover: the embedding's
    dropout mask, the final norm's input, the LM head input and the loss's logits (the paper's
    section 4.3). Nothing is added by default; the whole-model budget
    (:mod:`neuron_ckpt.memory.budget`) adds them for Llama, vocab-parallel logits included.
    """
    _require_positive_int("num_layers", num_layers)
    per_layer = layer_activation_bytes(shape, config)
    return num_layers * per_layer + sum(term.nbytes for term in outside_layer_terms)


# --------------------------------------------------------------------------------------------
# The Llama layer (neuron_ckpt.models.llama): RMSNorm, GQA, rotary, fp32 softmax, SwiGLU, no
# dropout. Derived tensor by tensor in docs/memory.md ("The Llama layer").


@dataclass(frozen=True)
class LlamaLayerShape:
    """Shape of one Llama layer's activations.

    seq_len, micro_batch, hidden, heads, tp: as in :class:`LayerShape` (head_dim = hidden/heads).
    kv_heads: g, key/value heads (GQA); must divide heads, and either be a multiple of tp or
        divide it (then each kv head is replicated on tp/g ranks, as QKVParallelLinear does).
    ffn: f, the SwiGLU width (gate/up/down); must be a multiple of tp.
    bytes_per_element: activation width (2 for bf16). Softmax and RMSNorm statistics are fp32.
    """

    seq_len: int
    micro_batch: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    tp: int = 1
    bytes_per_element: int = 2

    def __post_init__(self) -> None:
        for name in ("seq_len", "micro_batch", "hidden", "heads", "kv_heads", "ffn", "tp",
                     "bytes_per_element"):
            _require_positive_int(name, getattr(self, name))
        if self.hidden % self.heads:
            raise ValueError(
                f"hidden ({self.hidden}) must be a multiple of heads ({self.heads})")
        if self.heads % self.kv_heads:
            raise ValueError(
                f"kv_heads ({self.kv_heads}) must divide heads ({self.heads})")
        if self.heads % self.tp:
            raise ValueError(f"tp ({self.tp}) must divide heads ({self.heads})")
        if self.kv_heads % self.tp and self.tp % self.kv_heads:
            raise ValueError(
                f"kv_heads ({self.kv_heads}) must be a multiple of tp ({self.tp}) or divide it")
        if self.ffn % self.tp:
            raise ValueError(f"tp ({self.tp}) must divide ffn ({self.ffn})")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def local_heads(self) -> int:
        return self.heads // self.tp

    @property
    def local_kv_heads(self) -> int:
        """kv heads on one rank: g/t, or 1 replicated head when g < t."""
        return max(self.kv_heads // self.tp, 1)


_FP32 = 4


def _rmsnorm_terms(prefix: str, sb: int, h: int, width: int) -> list[tuple[str, int]]:
    # h.float() feeds pow(2) and the multiply by rstd: the fp32 copy of the input is kept (for a
    # 16-bit input; for fp32 it is the input itself). rsqrt keeps its [s, b, 1] fp32 output. The
    # scale by the weight keeps the normalised activation (the weight gradient reads it).
    return [
        (f"{prefix}_input_fp32", _FP32 * sb * h),
        (f"{prefix}_rstd_fp32", _FP32 * sb),
        (f"{prefix}_normalized", width * sb * h),
    ]


def llama_layer_activation_terms(
    shape: LlamaLayerShape, config: ActivationConfig
) -> list[ActivationTerm]:
    """The tensors one Llama layer keeps for backward on one rank, with their bytes.

    ``config.recompute``: "selective" drops the attention core (fp32 softmax output and its
    16-bit copy, the ``s^2`` terms); "full" keeps only the layer input (``/t`` when sequence
    parallel or distributed). The rotary cos/sin tables are shared by all layers: see
    :func:`llama_outside_layer_terms`.
    """
    if config.sequence_parallel and shape.seq_len % shape.tp:
        raise ValueError(
            f"seq_len ({shape.seq_len}) must be a multiple of tp ({shape.tp}) "
            "when sequence_parallel is True")
    s, b, h, t, w = shape.seq_len, shape.micro_batch, shape.hidden, shape.tp, shape.bytes_per_element
    if config.recompute == "full":
        split = config.sequence_parallel or config.distribute_saved_activations
        nbytes = w * s * b * h
        return [ActivationTerm("layer_input", -(-nbytes // t) if split else nbytes, split)]
    # Replicated over TP without sequence parallel, a 1/t sequence shard with it.
    sb = s * b // t if config.sequence_parallel else s * b
    outside = [
        *_rmsnorm_terms("norm1", sb, h, w),
        ("qkv_input", w * sb * h),
        *_rmsnorm_terms("norm2", sb, h, w),
        ("mlp_input", w * sb * h),
    ]
    d, a_loc, g_loc, f_loc = shape.head_dim, shape.local_heads, shape.local_kv_heads, shape.ffn // t
    inside = [
        ("q", w * s * b * a_loc * d),  # after rotary: the score matmul (or checkpoint) keeps it
        ("k", w * s * b * g_loc * d),  # at kv heads: never repeated to the query heads
        ("v", w * s * b * g_loc * d),
        ("proj_input", w * s * b * a_loc * d),
        ("gate", w * s * b * f_loc),  # silu input
        ("silu_out", w * s * b * f_loc),  # silu(gate) * up keeps both factors
        ("up", w * s * b * f_loc),
        ("down_input", w * s * b * f_loc),
    ]
    if config.recompute == "none":
        scores = a_loc * s * s * b
        inside.append(("softmax_out_fp32", _FP32 * scores))
        if w != _FP32:  # the cast back to 16 bits, kept by the matmul with V
            inside.append(("probs", w * scores))
    return ([ActivationTerm(n, v, config.sequence_parallel) for n, v in outside]
            + [ActivationTerm(n, v, True) for n, v in inside])


def llama_layer_activation_bytes(shape: LlamaLayerShape, config: ActivationConfig) -> int:
    """Activation bytes one Llama layer keeps for backward on one rank."""
    return sum(term.nbytes for term in llama_layer_activation_terms(shape, config))


def llama_outside_layer_terms(shape: LlamaLayerShape) -> list[ActivationTerm]:
    """Per-model terms shared by every layer: the rotary cos and sin tables ``[s, d]``.

    Rotary multiplies q and k by them, which keeps the tables (not q, k: the tables need no
    gradient). Without recompute and with selective recompute every layer reads the same two
    tables; full recompute keeps none of them. The embedding, final norm, LM head input and
    loss terms are in the whole-model budget (:mod:`neuron_ckpt.memory.budget`).
    """
    nbytes = shape.bytes_per_element * shape.seq_len * shape.head_dim
    return [ActivationTerm("rope_cos", nbytes, False), ActivationTerm("rope_sin", nbytes, False)]
