"""Llama (Llama-2 / Llama-3 architecture) built from the tensor- and sequence-parallel layers.

Data flow of one forward, ``t`` = tensor-parallel size (activations sequence-first)::

    ids [b, s] -> transpose -> VocabParallelEmbedding -> [s, b, h]  ([s/t, b, h] under SP)
    per layer:  RMSNorm -> QKV (GQA, local heads, full s) -> RoPE -> CoreAttention -> o_proj (row)
                + residual -> RMSNorm -> gate/up (column, one gather) -> silu(gate) * up
                -> down (row) + residual
    RMSNorm -> lm_head (column) -> vocab-parallel logits [s, b, v/t] -> vocab-parallel CE

Under context parallelism (``parallel_state.cp``, ``c`` ranks) every CP rank takes the whole
``[b, s]`` ids and labels, shifts the labels to next-token targets, and keeps its ``s/c`` tokens
(two chunks of the ``2c``, causal load balance) of ids, targets and RoPE positions; ``s`` above is
then ``s/c`` everywhere, and core attention all-gathers keys and values over CP
(:mod:`neuron_ckpt.parallel.context_parallel`, docs/context_parallel.md).

Module and parameter names mirror ``transformers`` (``embed_tokens``, ``layers.N.self_attn``,
``mlp.gate_proj``...) so the conversion in :mod:`.hf_conversion` is a short table; the only
structural difference is the fused ``self_attn.qkv`` (``q_weight``/``k_weight``/``v_weight``).
The module that selective recompute targets is ``self_attn.core_attn``; recompute is applied to
the built model (``neuron_ckpt.recompute.apply_recompute``), and the forward always runs the
layers through ``run_layers``.

What the model is comes as :class:`LlamaArgs` (``model.args``), how it runs as one
:class:`LlamaOptions` (``model.options``), handed as ``(args, options)`` to every module.

With ``tie_word_embeddings`` the LM head's weight *is* the embedding's parameter (both are
``[v/t, h]`` with rank ``r`` holding vocab rows ``[r v/t, (r+1) v/t)``): one parameter, whose
gradient autograd sums over both uses, one optimizer slot. ``named_parameters()`` and
``state_dict()`` name it once (``embed_tokens.weight``), as ``save_pretrained`` writes it.

Initialisation draws every full weight (``normal_init`` with the config's ``initializer_range``)
and keeps this rank's slice, so the model does not depend on ``t``. With ``seed=S`` each part is
drawn from its own seeded stream (:func:`~neuron_ckpt.parallel.init.drawn_for`), so every layout
(TP, CP, the stages of any pipeline cut, virtual stages) holds the same model from one seed;
without it every part comes from the default generator in turn, as it stands.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ..distributed import collectives
from ..distributed.mappings import gather_from_context_parallel_region, gather_from_tensor_parallel_region
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
from ..parallel import context_parallel as cp_split
from ..parallel.attention import ATTENTION
from ..parallel.fused_ops import swiglu
from ..parallel.init import drawn_for, normal_init
from ..parallel.linear import parallel_linear
from ..recompute import run_layers
from . import hf_conversion
from .llama_args import LlamaArgs
from .rotary import RotaryEmbedding, apply_rotary

IGNORE_INDEX = -100
RETURN_LOGITS = (None, "local", "full")


@dataclass(frozen=True)
class LlamaOptions:
    """How a Llama model runs (beside :class:`LlamaArgs`, what it is); built once by
    :class:`LlamaForCausalLM` and handed to every module it builds."""

    sequence_parallel: bool = False
    """Keep the activations outside attention/MLP split along the sequence (``[s/t, b, h]``)."""
    attention_implementation: str = "explicit"
    """``"explicit"`` or ``"flash"`` (:data:`~neuron_ckpt.parallel.attention.ATTENTION`, see ``CoreAttention``)."""
    dtype: torch.dtype = torch.float32
    """Parameter dtype (fp32, or bf16 for pure-bf16 training)."""
    parallel_state: ParallelState = None  # type: ignore[assignment]  # None: resolved in __post_init__
    """The tensor/data-parallel groups; None: the global one set by ``initialize_model_parallel``."""

    def __post_init__(self) -> None:
        if not isinstance(self.sequence_parallel, bool):
            raise ValueError(f"sequence_parallel must be a bool, got {self.sequence_parallel!r}")
        if self.attention_implementation not in ATTENTION:
            raise ValueError(
                f"attention_implementation must be one of {list(ATTENTION)}, got {self.attention_implementation!r}"
            )
        if not isinstance(self.dtype, torch.dtype):
            raise ValueError(f"dtype must be a torch.dtype, got {self.dtype!r}")
        if self.parallel_state is None:
            object.__setattr__(self, "parallel_state", get_parallel_state())

    def linear(self, args: LlamaArgs, bias: bool) -> dict:
        """The keyword arguments every parallel linear layer of the model takes."""
        return dict(
            bias=bias,
            sequence_parallel=self.sequence_parallel,
            init_method=normal_init(args.initializer_range),
            dtype=self.dtype,
            parallel_state=self.parallel_state,
        )


@dataclass
class CausalLMOutput:
    """``loss``: mean cross entropy over the non-ignored next-token targets (None without labels);
    under context parallelism this CP rank's share, scaled so that the CP ranks' mean is that mean
    (:meth:`LlamaForCausalLM._loss`).

    ``logits``: ``[s, b, v/t]`` vocab-parallel and sequence-first (``"local"``; under context
    parallelism this rank's ``s/c`` tokens in the order it holds them), ``[b, s, v]`` gathered
    like ``transformers`` (``"full"``), or None.
    """

    loss: torch.Tensor | None
    logits: torch.Tensor | None


class LlamaAttention(torch.nn.Module):
    """QKV projection (local heads), RoPE on the full sequence, core attention, row-parallel out."""

    def __init__(self, args: LlamaArgs, options: LlamaOptions):
        super().__init__()
        self.head_dim = args.head_dim
        linear = options.linear(args, args.attention_bias)
        self.qkv = QKVParallelLinear(
            args.hidden_size, args.num_attention_heads, args.num_key_value_heads, self.head_dim, **linear
        )
        self.core_attn = CoreAttention(
            self.qkv.local_heads,
            self.qkv.local_kv_heads,
            self.head_dim,
            attention_dropout=float(args.attention_dropout),
            softmax_in_fp32=True,
            implementation=options.attention_implementation,
            context_parallel_group=options.parallel_state.cp,
        )
        self.o_proj = RowParallelLinear(
            args.num_attention_heads * self.head_dim, args.hidden_size, input_is_parallel=True, **linear
        )

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x)  # [s, b, local heads * d]: the sequence is whole here, even under SP
        q, k = apply_rotary(q, cos, sin, self.head_dim), apply_rotary(k, cos, sin, self.head_dim)
        return self.o_proj(self.core_attn(q, k, v))


class SwiGLU(torch.nn.Module):
    """``silu(gate) * up``: a module of its own so selective recompute can name it (``mlp_act``).

    One autograd Function (:func:`~neuron_ckpt.parallel.swiglu`) that keeps gate and up and
    recomputes ``silu(gate)`` in backward, as Megatron's and TransformerEngine's fused SwiGLU do:
    ``w·sbf/t`` bytes less per layer than the plain expression, for one elementwise pass.
    """

    def forward(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return swiglu(gate, up)


class LlamaMLP(torch.nn.Module):
    """SwiGLU MLP: ``down(silu(gate(x)) * up(x))``; gate and up share one input gather under SP.

    ``gate_proj`` and ``up_proj`` hold the weights (named as in ``transformers``) but their forward
    never runs: :func:`~neuron_ckpt.parallel.linear.parallel_linear` multiplies by both weights after
    one gather. ``down_proj`` and ``act_fn`` (``mlp_act``) do run theirs, so selective recompute
    and hooks can target them; ``weights_only_children`` tells ``apply_recompute`` to refuse the
    other two rather than wrap a forward that is never called.
    """

    weights_only_children = ("gate_proj", "up_proj")

    def __init__(self, args: LlamaArgs, options: LlamaOptions):
        super().__init__()
        h, i = args.hidden_size, args.intermediate_size
        column = options.linear(args, args.mlp_bias)
        self.gate_proj = ColumnParallelLinear(h, i, **column)
        self.up_proj = ColumnParallelLinear(h, i, **column)
        self.down_proj = RowParallelLinear(i, h, input_is_parallel=True, **column)
        self.act_fn = SwiGLU()
        self.options = options

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = parallel_linear(
            x,
            [self.gate_proj.weight, self.up_proj.weight],
            [self.gate_proj.bias, self.up_proj.bias],
            self.options.parallel_state.tp,
            self.options.sequence_parallel,
        )
        return self.down_proj(self.act_fn(gate, up))


class LlamaDecoderLayer(torch.nn.Module):
    """Pre-norm residual block: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``."""

    def __init__(self, args: LlamaArgs, options: LlamaOptions):
        super().__init__()
        norm: dict[str, Any] = dict(
            eps=args.rms_norm_eps,
            sequence_parallel=options.sequence_parallel,
            dtype=options.dtype,
            parallel_state=options.parallel_state,
        )
        self.input_layernorm = RMSNorm(args.hidden_size, **norm)
        self.self_attn = LlamaAttention(args, options)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, **norm)
        self.mlp = LlamaMLP(args, options)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), cos, sin)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class LlamaForCausalLM(torch.nn.Module):
    """A Llama model, tensor parallel over the TP group of ``parallel_state`` (and context
    parallel over its CP group, when it has one).

    Args:
        config: a :class:`LlamaArgs`, or a ``transformers.LlamaConfig`` (read with
            :meth:`LlamaArgs.from_hf`, which refuses what is not built here); kept as ``self.args``.
        sequence_parallel, attention_implementation, dtype, parallel_state: the
            :class:`LlamaOptions` fields, kept as ``self.options``; under sequence parallel the
            sequence length must be divisible by ``t``.
        seed: draw each part from its own stream seeded by ``seed`` (the model every layout
            builds from that seed, ``LlamaPipeline``'s stages included); None: from the default
            generator as it stands.

    Activation recompute is applied to the built model:
    ``neuron_ckpt.recompute.apply_recompute(model, config)``.
    """

    def __init__(
        self,
        config: LlamaArgs | Any,
        sequence_parallel: bool = False,
        attention_implementation: str = "explicit",
        dtype: torch.dtype = torch.float32,
        parallel_state: ParallelState | None = None,
        seed: int | None = None,
    ):
        super().__init__()
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
            raise ValueError(f"seed must be an int or None, got {seed!r}")
        self.args = args = LlamaArgs.from_hf(config)
        self.options = options = LlamaOptions(
            sequence_parallel,
            attention_implementation,
            dtype,
            parallel_state,  # type: ignore[arg-type]  # None: resolved there
        )
        sp, state = options.sequence_parallel, options.parallel_state
        init = normal_init(args.initializer_range)
        with drawn_for(seed, "embedding"):
            self.embed_tokens = VocabParallelEmbedding(
                args.vocab_size, args.hidden_size, sp, init, dtype, parallel_state=state
            )
        layers = []
        for i in range(args.num_hidden_layers):
            with drawn_for(seed, f"layer {i}"):
                layers.append(LlamaDecoderLayer(args, options))
        self.layers = torch.nn.ModuleList(layers)
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, sp, dtype, parallel_state=state)
        with drawn_for(seed, "head"):
            self.lm_head = ColumnParallelLinear(args.hidden_size, args.vocab_size, **options.linear(args, bias=False))
        if args.tie_word_embeddings:  # drawn above all the same, so the other weights do not depend on tying
            self.lm_head.weight = self.embed_tokens.weight
            self._register_state_dict_hook(_drop_tied_head)
            self._register_load_state_dict_pre_hook(_fill_tied_head, with_module=True)
        self.rotary = RotaryEmbedding(args)

    @property
    def parallel_state(self) -> ParallelState:
        """``options.parallel_state``, named as on the parallel layers."""
        return self.options.parallel_state

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
        ps = self.parallel_state
        ids = input_ids.t()  # [s, b]
        s = ids.shape[0]
        # Next-token targets on the whole sequence, before any context-parallel split.
        target = F.pad(labels, (0, 1), value=IGNORE_INDEX)[:, 1:].t() if labels is not None else None
        positions = None
        if ps.cp is not None:  # this rank's two chunks of ids, targets and positions (parallel.context_parallel)
            cp_split.check_sequence(s, ps.cp_size, ps.tp_size, self.options.sequence_parallel)
            ids = cp_split.shard(ids, 0, ps.cp)
            target = cp_split.shard(target, 0, ps.cp) if target is not None else None
            positions = cp_split.positions(s, ps.cp_size, ps.cp_rank, ids.device)
        hidden = self.embed_tokens(ids)
        cos, sin = self.rotary(s, hidden.dtype, hidden.device, positions)
        hidden = run_layers(self.layers, hidden, cos, sin)
        logits = self.lm_head(self.norm(hidden))  # [s/c, b, v/t]
        loss = None
        if target is not None:
            loss = self._loss(logits, target)
        if return_logits is None:
            return_logits = "local" if labels is None else None
        if return_logits == "full":
            logits = gather_from_tensor_parallel_region(logits, ps.tp)
            if ps.cp is not None:
                logits = gather_from_context_parallel_region(logits, ps.cp, partial_grad=False)
                logits = cp_split.unshard(logits, 0, ps.cp_size)
            logits = logits.transpose(0, 1)
        return CausalLMOutput(loss=loss, logits=logits if return_logits else None)

    def _loss(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The mean cross entropy over the non-ignored targets. Under context parallelism each CP
        rank holds some of them: its loss is ``c x`` (its summed loss) / (the count over CP), so the
        CP ranks' mean is the token mean over the whole sequence however the targets fall (never a
        mean of per-rank means), and the mean over DP x CP of the gradients (ZeRO-1's) is its gradient."""
        ps = self.parallel_state
        if ps.cp is None:
            return vocab_parallel_cross_entropy(logits, target, IGNORE_INDEX, group=ps.tp)
        total = vocab_parallel_cross_entropy(logits, target, IGNORE_INDEX, reduction="sum", group=ps.tp)
        count = collectives.all_reduce((target != IGNORE_INDEX).sum().to(total.dtype), ps.cp)
        return total * (ps.cp_size / count)

    @property
    def tied(self) -> bool:
        """The LM head shares the embedding's parameter (``args.tie_word_embeddings``)."""
        return self.args.tie_word_embeddings

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


TIED_HEAD = "lm_head.weight"


def _drop_tied_head(module, state_dict, prefix, local_metadata) -> None:
    """``state_dict()`` of a tied model: the shared parameter once, as ``embed_tokens.weight``
    (two names for one storage would make safetensors refuse the file)."""
    state_dict.pop(prefix + TIED_HEAD, None)


def _fill_tied_head(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
    """``load_state_dict`` of a tied model: the head is the embedding's entry (given or not)."""
    embed = state_dict.get(prefix + "embed_tokens.weight")
    if embed is not None:
        state_dict[prefix + TIED_HEAD] = embed
