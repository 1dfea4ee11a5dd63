"""Llama (Llama-2 / Llama-3 architecture) built from the tensor- and sequence-parallel layers.

Data flow of one forward, ``t`` = tensor-parallel size (activations sequence-first)::

    ids [b, s] -> transpose -> VocabParallelEmbedding -> [s, b, h]  ([s/t, b, h] under SP)
    per layer:  RMSNorm -> QKV (GQA, local heads, full s) -> RoPE -> CoreAttention -> o_proj (row)
                + residual -> RMSNorm -> gate/up (column, one gather) -> silu(gate) * up
                -> down (row) + residual
    RMSNorm -> lm_head (column) -> vocab-parallel logits [s, b, v/t] -> vocab-parallel CE

Module and parameter names mirror ``transformers`` (``embed_tokens``, ``layers.N.self_attn``,
``mlp.gate_proj``...) so the conversion in :mod:`.hf_conversion` is a short table; the only
structural difference is the fused ``self_attn.qkv`` (``q_weight``/``k_weight``/``v_weight``).
The module that selective recompute targets is ``self_attn.core_attn``.

Initialisation draws every full weight from the default generator (``normal_init`` with the
config's ``initializer_range``), so the model built at any ``t`` from one seed is the same model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..distributed.mappings import gather_from_tensor_parallel_region
from ..distributed.parallel_state import ParallelState, get_parallel_state
from ..parallel import (
    ColumnParallelLinear,
    CoreAttention,
    QKVParallelLinear,
    RMSNorm,
    RowParallelLinear,
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
)
from ..parallel.init import normal_init
from ..parallel.linear import parallel_linear
from . import hf_conversion
from .rotary import RotaryEmbedding, apply_rotary

IGNORE_INDEX = -100
RETURN_LOGITS = (None, "local", "full")


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _check_config(config) -> None:
    if getattr(config, "tie_word_embeddings", False):
        raise ValueError(
            "tie_word_embeddings=True is not supported: the vocab-parallel embedding and the LM head "
            "hold their own weights (Llama-2 unties them); set config.tie_word_embeddings=False"
        )
    act = getattr(config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act must be 'silu' (SwiGLU), got {act!r}")
    if getattr(config, "pretraining_tp", 1) != 1:
        raise ValueError("config.pretraining_tp must be 1 (the sliced-matmul emulation is not reproduced)")


@dataclass
class CausalLMOutput:
    """``loss``: mean cross entropy over the non-ignored next-token targets (None without labels).

    ``logits``: ``[s, b, v/t]`` vocab-parallel and sequence-first (``"local"``), ``[b, s, v]``
    gathered like ``transformers`` (``"full"``), or None.
    """

    loss: torch.Tensor | None
    logits: torch.Tensor | None


class LlamaAttention(torch.nn.Module):
    """QKV projection (local heads), RoPE on the full sequence, core attention, row-parallel out."""

    def __init__(self, config, sequence_parallel: bool, implementation: str, dtype, state: ParallelState):
        super().__init__()
        self.head_dim = head_dim_of(config)
        init = normal_init(config.initializer_range)
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv = QKVParallelLinear(
            config.hidden_size,
            config.num_attention_heads,
            config.num_key_value_heads,
            self.head_dim,
            bias=bias,
            sequence_parallel=sequence_parallel,
            init_method=init,
            dtype=dtype,
            parallel_state=state,
        )
        self.core_attn = CoreAttention(
            self.qkv.local_heads,
            self.qkv.local_kv_heads,
            self.head_dim,
            attention_dropout=float(getattr(config, "attention_dropout", 0.0)),
            softmax_in_fp32=True,
            implementation=implementation,
        )
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * self.head_dim,
            config.hidden_size,
            bias=bias,
            input_is_parallel=True,
            sequence_parallel=sequence_parallel,
            init_method=init,
            dtype=dtype,
            parallel_state=state,
        )

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x)  # [s, b, local heads * d]: the sequence is whole here, even under SP
        q, k = apply_rotary(q, cos, sin, self.head_dim), apply_rotary(k, cos, sin, self.head_dim)
        return self.o_proj(self.core_attn(q, k, v))


class SwiGLU(torch.nn.Module):
    """``silu(gate) * up``: a module of its own so selective recompute can name it (``mlp_act``)."""

    def forward(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return F.silu(gate) * up


class LlamaMLP(torch.nn.Module):
    """SwiGLU MLP: ``down(silu(gate(x)) * up(x))``; gate and up share one input gather under SP.

    ``gate_proj`` and ``up_proj`` hold the weights (named as in ``transformers``) but their forward
    never runs: :func:`~neuron_ckpt.parallel.linear.parallel_linear` multiplies by both weights after
    one gather. ``down_proj`` and ``act_fn`` (``mlp_act``) do run theirs, so selective recompute
    and hooks can target them; ``weights_only_children`` tells ``apply_recompute`` to refuse the
    other two rather than wrap a forward that is never called.
    """

    weights_only_children = ("gate_proj", "up_proj")

    def __init__(self, config, sequence_parallel: bool, dtype, state: ParallelState):
        super().__init__()
        init = normal_init(config.initializer_range)
        bias = bool(getattr(config, "mlp_bias", False))
        h, i = config.hidden_size, config.intermediate_size
        column = dict(bias=bias, sequence_parallel=sequence_parallel, init_method=init, dtype=dtype, parallel_state=state)
        self.gate_proj = ColumnParallelLinear(h, i, **column)
        self.up_proj = ColumnParallelLinear(h, i, **column)
        self.down_proj = RowParallelLinear(i, h, input_is_parallel=True, **column)
        self.act_fn = SwiGLU()
        self.sequence_parallel, self.state = sequence_parallel, state

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = parallel_linear(
            x,
            [self.gate_proj.weight, self.up_proj.weight],
            [self.gate_proj.bias, self.up_proj.bias],
            self.state.tp,
            self.sequence_parallel,
        )
        return self.down_proj(self.act_fn(gate, up))


class LlamaDecoderLayer(torch.nn.Module):
    """Pre-norm residual block: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``."""

    def __init__(self, config, sequence_parallel: bool, implementation: str, dtype, state: ParallelState):
        super().__init__()
        norm = dict(eps=config.rms_norm_eps, sequence_parallel=sequence_parallel, dtype=dtype, parallel_state=state)
        self.input_layernorm = RMSNorm(config.hidden_size, **norm)
        self.self_attn = LlamaAttention(config, sequence_parallel, implementation, dtype, state)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, **norm)
        self.mlp = LlamaMLP(config, sequence_parallel, dtype, state)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), cos, sin)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class LlamaForCausalLM(torch.nn.Module):
    """A ``transformers.LlamaConfig`` model, tensor parallel over the TP group of ``parallel_state``.

    Args:
        config: a ``transformers.LlamaConfig`` (or any object with its fields).
        sequence_parallel: keep the activations outside attention/MLP split along the sequence
            (``[s/t, b, h]``); the sequence length must then be divisible by ``t``.
        recompute: a ``neuron_ckpt.recompute.RecomputeConfig``, or one per layer (a list whose None
            entries keep everything, as ``neuron-ckpt plan`` produces); None: keep every activation.
        attention_implementation: ``"explicit"`` or ``"sdpa"`` (see ``CoreAttention``).
        dtype: parameter dtype (fp32, or bf16 for pure-bf16 training).
        parallel_state: defaults to the global one set by ``initialize_model_parallel``.
    """

    def __init__(
        self,
        config,
        sequence_parallel: bool = False,
        recompute=None,
        attention_implementation: str = "explicit",
        dtype: torch.dtype = torch.float32,
        parallel_state: ParallelState | None = None,
    ):
        super().__init__()
        _check_config(config)
        self.config = config
        self.state = parallel_state if parallel_state is not None else get_parallel_state()
        self.sequence_parallel = sequence_parallel
        state, init = self.state, normal_init(config.initializer_range)
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, sequence_parallel, init, dtype, parallel_state=state
        )
        self.layers = torch.nn.ModuleList(
            LlamaDecoderLayer(config, sequence_parallel, attention_implementation, dtype, state)
            for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, sequence_parallel, dtype, parallel_state=state)
        self.lm_head = ColumnParallelLinear(
            config.hidden_size,
            config.vocab_size,
            bias=False,
            sequence_parallel=sequence_parallel,
            init_method=init,
            dtype=dtype,
            parallel_state=state,
        )
        self.rotary = RotaryEmbedding(config, head_dim_of(config))
        self.recompute = recompute
        self._run_layers = self._plain_layers
        if recompute is not None and (isinstance(recompute, (list, tuple)) or recompute.enabled):
            from ..recompute import layer_runner  # validates the config against this model first

            self._run_layers = layer_runner(self, recompute, sequence_parallel=sequence_parallel)

    def _plain_layers(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            hidden = layer(hidden, cos, sin)
        return hidden

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        return_logits: str | None = None,
    ) -> CausalLMOutput:
        """``input_ids`` and ``labels`` are ``[b, s]`` as ``transformers`` takes them.

        ``labels`` are shifted here (position ``i`` predicts ``labels[:, i + 1]``; ``-100`` is
        ignored), as ``transformers`` does. ``return_logits``: None (the default) returns the
        ``"local"`` logits when there are no labels and none otherwise, so a training step does
        not keep the logits alive through backward.
        """
        if return_logits not in RETURN_LOGITS:
            raise ValueError(f"return_logits must be one of {RETURN_LOGITS}, got {return_logits!r}")
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}")
        if labels is not None and labels.shape != input_ids.shape:
            raise ValueError(f"labels shape {tuple(labels.shape)} must equal input_ids shape {tuple(input_ids.shape)}")
        ids = input_ids.t()  # [s, b]
        hidden = self.embed_tokens(ids)
        cos, sin = self.rotary(ids.shape[0], hidden.dtype, hidden.device)
        hidden = self._run_layers(hidden, cos, sin)
        logits = self.lm_head(self.norm(hidden))  # [s, b, v/t]
        loss = None
        if labels is not None:
            target = F.pad(labels, (0, 1), value=IGNORE_INDEX)[:, 1:].t()  # [s, b], next token
            loss = vocab_parallel_cross_entropy(logits, target, IGNORE_INDEX, group=self.state.tp)
        if return_logits is None:
            return_logits = "local" if labels is None else None
        if return_logits == "full":
            logits = gather_from_tensor_parallel_region(logits, self.state.tp).transpose(0, 1)
        return CausalLMOutput(loss=loss, logits=logits if return_logits else None)

    # --- transformers checkpoints -------------------------------------------------------------

    def load_hf_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load a full ``transformers`` Llama state dict; every rank keeps its own shard."""
        hf_conversion.load_hf_state_dict(self, state_dict)

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The full ``transformers`` state dict (gathered over TP, on CPU) on every rank."""
        return hf_conversion.hf_state_dict(self)

    def hf_grad_dict(self) -> dict[str, torch.Tensor]:
        """The full gradients, named and shaped like ``hf_state_dict`` (parameters without a grad: zeros)."""
        return hf_conversion.hf_state_dict(self, grads=True)

