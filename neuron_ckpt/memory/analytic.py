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
    section 4.3). Nothing is added by default. TODO(planner): provide those terms for Llama,
    including the vocab-parallel split of the logits.
    """
    _require_positive_int("num_layers", num_layers)
    per_layer = layer_activation_bytes(shape, config)
    return num_layers * per_layer + sum(term.nbytes for term in outside_layer_terms)
