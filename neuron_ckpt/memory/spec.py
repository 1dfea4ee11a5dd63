"""``LayerSpec``: one layer to account for (model, shape, parallelism, recompute), validated once.

The report, the CLI, the measurement and the profiler script all take a ``LayerSpec``, so a
configuration is checked in one place, with errors that name the field, and the analytic model
and the real layer always describe the same thing.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from .analytic import (
    RECOMPUTE_MODES,
    ActivationConfig,
    ActivationTerm,
    LayerShape,
    LlamaLayerShape,
    layer_activation_terms,
    llama_layer_activation_terms,
    llama_outside_layer_terms,
)

MODELS = ("gpt", "llama")
DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def llama_default_ffn(hidden: int) -> int:
    """Llama's SwiGLU width: 2/3 of 4h rounded up to a multiple of 256 (11008 for h = 4096)."""
    return 256 * -(-(8 * hidden) // (3 * 256))


@dataclass(frozen=True)
class LayerSpec:
    """A transformer layer and how it runs.

    model: "gpt" (the paper's layer, ``neuron_ckpt.models.gpt``) or "llama".
    seq_len, micro_batch, hidden, heads: s, b, h, a.
    kv_heads: Llama's key/value heads (GQA); None means ``heads``. GPT has none.
    ffn: the MLP width; None means 4h (GPT, which requires exactly 4h) or Llama's 8h/3 rule.
    tp: tensor-parallel degree. sequence_parallel, recompute ("none" | "selective" | "full"),
    distribute_saved_activations: as in :class:`~.analytic.ActivationConfig`.
    layers: how many layers (totals are ``layers`` x per layer). dtype: "bf16" | "fp16" | "fp32".
    """

    model: str
    seq_len: int
    micro_batch: int
    hidden: int
    heads: int
    kv_heads: int | None = None
    ffn: int | None = None
    tp: int = 1
    sequence_parallel: bool = False
    recompute: str = "none"
    distribute_saved_activations: bool = False
    layers: int = 1
    dtype: str = "bf16"

    def __post_init__(self) -> None:
        if self.model not in MODELS:
            raise ValueError(f"model must be one of {MODELS}, got {self.model!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {tuple(DTYPES)}, got {self.dtype!r}")
        if self.recompute not in RECOMPUTE_MODES:
            raise ValueError(f"recompute must be one of {RECOMPUTE_MODES}, got {self.recompute!r}")
        if not isinstance(self.layers, int) or isinstance(self.layers, bool) or self.layers < 1:
            raise ValueError(f"layers must be a positive int, got {self.layers!r}")
        if self.model == "gpt":
            if self.kv_heads not in (None, self.heads):
                raise ValueError(f"kv_heads applies to llama only; gpt has kv_heads = heads, got {self.kv_heads!r}")
            if self.ffn not in (None, 4 * self.hidden):
                raise ValueError(f"ffn for gpt must be 4 * hidden = {4 * self.hidden} (the paper's layer), got {self.ffn!r}")
        self.activation_config()  # config-level checks (distribute needs full, not with SP)
        self.shape()  # shape-level checks (divisibility by tp, positivity)
        self.terms()  # checks that need both (seq_len divisible by tp under SP)

    # --- derived ------------------------------------------------------------------------
    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def bytes_per_element(self) -> int:
        return torch.empty(0, dtype=self.torch_dtype).element_size()

    @property
    def resolved_kv_heads(self) -> int:
        return self.heads if self.kv_heads is None else self.kv_heads

    @property
    def resolved_ffn(self) -> int:
        if self.ffn is not None:
            return self.ffn
        return 4 * self.hidden if self.model == "gpt" else llama_default_ffn(self.hidden)

    def activation_config(self) -> ActivationConfig:
        return ActivationConfig(self.sequence_parallel, self.recompute, self.distribute_saved_activations)

    def shape(self) -> LayerShape | LlamaLayerShape:
        common = dict(seq_len=self.seq_len, micro_batch=self.micro_batch, hidden=self.hidden, heads=self.heads,
                      tp=self.tp, bytes_per_element=self.bytes_per_element)
        if self.model == "gpt":
            return LayerShape(**common)
        return LlamaLayerShape(kv_heads=self.resolved_kv_heads, ffn=self.resolved_ffn, **common)

    def with_(self, **changes) -> "LayerSpec":
        """A copy with some fields changed (validated again)."""
        return replace(self, **changes)

    # --- the analytic model -------------------------------------------------------------
    def terms(self) -> list[ActivationTerm]:
        """Bytes kept per layer on one rank, tensor by tensor."""
        if self.model == "gpt":
            return layer_activation_terms(self.shape(), self.activation_config())
        return llama_layer_activation_terms(self.shape(), self.activation_config())

    def bytes_per_layer(self) -> int:
        return sum(t.nbytes for t in self.terms())

    def outside_layer_terms(self) -> list[ActivationTerm]:
        """Terms shared by all layers (Llama's rotary tables; none kept under full recompute)."""
        if self.model == "llama" and self.recompute != "full":
            return llama_outside_layer_terms(self.shape())
        return []
