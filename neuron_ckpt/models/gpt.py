"""The paper's GPT layer, built from the parallel layers: the reference for activation memory.

Korthikanti et al. (2022) count the activations of exactly this layer (``[s, b, h]``, 16-bit)::

    x -> LayerNorm -> QKV (column) -> scores, 16-bit softmax, dropout (1-byte mask), @V
      -> output projection (row) -> dropout -> + x
      -> LayerNorm -> fc1 (column, h -> 4h) -> GeLU -> fc2 (row) -> dropout -> + residual

so a measurement of this layer can be held to Table 2 (see docs/memory.md). Choices that matter
for that: every dropout is ``torch.native_dropout`` (a 1-byte bool mask; ``F.dropout`` on CPU
keeps a 2-byte scaled-noise tensor), attention scores are computed explicitly with the softmax in
the activation dtype (``CoreAttention(softmax_in_fp32=False)``), and under sequence parallelism
the column layers save their local ``[s/t, b, h]`` input and all-gather it again in backward.

RNG streams: attention dropout acts on this rank's heads and draws from the model-parallel
stream (``CoreAttention`` forks it). The hidden dropouts act on replicated ``[s, b, h]``
activations without sequence parallelism and draw from the default stream, identical on every
TP rank; under sequence parallelism each rank holds a different slice of the sequence and they
draw from the model-parallel stream instead, as Megatron does, so the slices get independent
masks rather than the same mask repeated.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch

from ..distributed.parallel_state import ParallelState, get_parallel_state
from ..distributed.random import get_rng_tracker
from ..parallel import ColumnParallelLinear, CoreAttention, LayerNorm, QKVParallelLinear, RowParallelLinear
from ..parallel.dropout import dropout
from ..parallel.init import normal_init
from ..recompute import run_layers


@dataclass(frozen=True)
class GPTConfig:
    """One GPT layer's sizes and options.

    hidden_size: h. num_heads: a (a multiple of the TP degree; h a multiple of a).
    ffn_hidden_size: the MLP width; None means 4h, the paper's layer.
    hidden_dropout / attention_dropout: probabilities in [0, 1); the paper's accounting assumes
        both are active (> 0), otherwise no masks are kept.
    sequence_parallel: norms, dropouts and residuals on ``[s/t, b, h]`` sequence shards.
    dtype: parameter and activation dtype; 16-bit (bf16) is what Table 2 counts.
    """

    hidden_size: int
    num_heads: int
    ffn_hidden_size: int | None = None
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    layernorm_eps: float = 1e-5
    init_std: float = 0.02
    sequence_parallel: bool = False
    dtype: torch.dtype = torch.bfloat16

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size={self.hidden_size} must be a multiple of num_heads={self.num_heads}")
        if self.ffn_hidden_size is not None and (not isinstance(self.ffn_hidden_size, int) or self.ffn_hidden_size < 1):
            raise ValueError(f"ffn_hidden_size must be a positive int or None, got {self.ffn_hidden_size!r}")
        for name in ("hidden_dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)!r}")

    @property
    def ffn_size(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size


def hidden_dropout(x: torch.Tensor, p: float, training: bool, sequence_parallel: bool) -> torch.Tensor:
    """Dropout with a 1-byte mask on an ``[s, b, h]`` (or ``[s/t, b, h]``) activation."""
    if not training or p == 0.0:
        return x
    with get_rng_tracker().fork() if sequence_parallel else contextlib.nullcontext():
        return dropout(x, p)


class GPTAttention(torch.nn.Module):
    """QKV (column, local heads) -> explicit core attention -> output projection (row)."""

    def __init__(self, config: GPTConfig, state: ParallelState):
        super().__init__()
        h, a, sp, init = config.hidden_size, config.num_heads, config.sequence_parallel, normal_init(config.init_std)
        self.qkv = QKVParallelLinear(
            h, a, bias=True, sequence_parallel=sp, init_method=init, dtype=config.dtype, parallel_state=state
        )
        self.core_attn = CoreAttention(
            self.qkv.local_heads,
            self.qkv.local_heads,
            h // a,
            attention_dropout=config.attention_dropout,
            softmax_in_fp32=False,  # the paper's 16-bit softmax output (2as^2b)
        )
        self.dense = RowParallelLinear(
            h, h, sequence_parallel=sp, init_method=init, dtype=config.dtype, parallel_state=state
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense(self.core_attn(*self.qkv(x)))


class GPTMLP(torch.nn.Module):
    """fc1 (column, h -> 4h) -> GeLU -> fc2 (row, 4h -> h)."""

    def __init__(self, config: GPTConfig, state: ParallelState):
        super().__init__()
        h, f, sp, init = config.hidden_size, config.ffn_size, config.sequence_parallel, normal_init(config.init_std)
        common: dict[str, Any] = dict(sequence_parallel=sp, init_method=init, dtype=config.dtype, parallel_state=state)
        self.fc1 = ColumnParallelLinear(h, f, **common)
        self.act_fn = torch.nn.GELU()  # a module, so selective recompute can name it (mlp_act)
        self.fc2 = RowParallelLinear(f, h, input_is_parallel=True, **common)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act_fn(self.fc1(x)))


class GPTLayer(torch.nn.Module):
    """Pre-norm GPT layer; ``[s, b, h]`` in and out (``[s/t, b, h]`` under sequence parallel)."""

    def __init__(self, config: GPTConfig, parallel_state: ParallelState | None = None):
        super().__init__()
        state = parallel_state if parallel_state is not None else get_parallel_state()
        norm: dict[str, Any] = dict(
            eps=config.layernorm_eps,
            sequence_parallel=config.sequence_parallel,
            dtype=config.dtype,
            parallel_state=state,
        )
        self.config = config
        self.ln1 = LayerNorm(config.hidden_size, **norm)
        self.attention = GPTAttention(config, state)
        self.ln2 = LayerNorm(config.hidden_size, **norm)
        self.mlp = GPTMLP(config, state)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p, sp = self.config.hidden_dropout, self.config.sequence_parallel
        x = x + hidden_dropout(self.attention(self.ln1(x)), p, self.training, sp)
        return x + hidden_dropout(self.mlp(self.ln2(x)), p, self.training, sp)


class GPTStack(torch.nn.Module):
    """``num_layers`` GPT layers, run through :func:`neuron_ckpt.recompute.run_layers`, so every
    recompute that ``apply_recompute(stack, config)`` applies works (grouped full too)."""

    def __init__(self, num_layers: int, config: GPTConfig, parallel_state: ParallelState | None = None):
        super().__init__()
        if not isinstance(num_layers, int) or isinstance(num_layers, bool) or num_layers < 1:
            raise ValueError(f"num_layers must be a positive int, got {num_layers!r}")
        self.config = config
        self.layers = torch.nn.ModuleList(GPTLayer(config, parallel_state) for _ in range(num_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return run_layers(self.layers, x)
