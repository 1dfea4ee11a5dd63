"""One pipeline stage of our Llama: the modules of its layers (and the embedding or the head), only.

::

    first stage:  ids [b, s] -> embed_tokens -> layers a..b-1 -> hidden [s, b, h]   ([s/t, b, h] under SP)
    middle:       hidden     -> layers a..b-1 -> hidden
    last stage:   hidden     -> layers a..b-1 -> norm -> lm_head -> logits [s, b, v/t]

Only the hidden states cross a stage boundary; every stage computes the rotary tables itself from
the sequence length (``hidden.shape[0] * t`` under sequence parallel). Each rank builds only its
stage's modules, tensor (and sequence) parallel over its TP group exactly as
:class:`~neuron_ckpt.models.LlamaForCausalLM` builds them.

Names are the full model's: ``embed_tokens.weight``, ``layers.<global index>.…``, ``norm.weight``,
``lm_head.weight`` (``layers`` is an ``nn.ModuleDict`` keyed by the global index, as torchtitan
does), so a stage's ``state_dict()`` is a slice of the full model's and
:func:`~neuron_ckpt.recompute.apply_recompute` works on a stage as on a model.

Initialisation, independent of the cut, ``t`` and ``p``: each part draws its weights from the
default generator seeded by ``(seed, part)`` (:func:`~neuron_ckpt.parallel.init.drawn_for`: the
embedding, each layer by its global index, the head), so the stages of any cut of one seed hold
the same model, and it is ``LlamaForCausalLM(..., seed=seed)``'s.

Tied embeddings (``tie_word_embeddings``): a stage holding both ends (one stage) shares one
parameter, as ``LlamaForCausalLM`` does. Otherwise the last stage's ``lm_head.weight`` is its own
parameter, drawn from the embedding's seed (the same values), and its gradient is summed with the
first stage's by :func:`~neuron_ckpt.pipeline.tied.all_reduce_tied_gradients`.
"""

from __future__ import annotations

from typing import Any

import torch

from ..distributed.parallel_state import ParallelState
from ..models.llama import LlamaDecoderLayer, LlamaOptions
from ..models.llama_args import LlamaArgs
from ..models.rotary import RotaryEmbedding
from ..parallel import ColumnParallelLinear, RMSNorm, VocabParallelEmbedding
from ..parallel.init import drawn_for, normal_init
from ..recompute import run_layers
from .rng import StageRNG


class LlamaStage(torch.nn.Module):
    """Stage ``stage_index`` of ``num_stages``, holding the global layers ``layers`` (a range).

    ``config``: a :class:`LlamaArgs` or a ``transformers.LlamaConfig``. ``sequence_parallel``,
    ``attention_implementation``, ``dtype``, ``parallel_state``: as for ``LlamaForCausalLM``.
    ``seed``: the initialisation (module docstring) and the stage's dropout streams
    (:class:`~.rng.StageRNG`).
    """

    def __init__(
        self,
        config: LlamaArgs | Any,
        layers: range,
        stage_index: int,
        num_stages: int,
        sequence_parallel: bool = False,
        attention_implementation: str = "explicit",
        dtype: torch.dtype = torch.float32,
        parallel_state: ParallelState | None = None,
        seed: int = 0,
    ):
        super().__init__()
        self.args = args = LlamaArgs.from_hf(config)
        L = args.num_hidden_layers
        if not isinstance(layers, range) or layers.step != 1 or not 0 <= layers.start <= layers.stop <= L:
            raise ValueError(f"layers must be a range of consecutive layers within 0..{L}, got {layers!r}")
        if (
            not isinstance(num_stages, int)
            or num_stages < 1
            or not isinstance(stage_index, int)
            or not 0 <= stage_index < num_stages
        ):
            raise ValueError(f"stage_index must be in 0..num_stages-1, got {stage_index!r} of {num_stages!r}")
        self.options = options = LlamaOptions(
            sequence_parallel,
            attention_implementation,
            dtype,
            parallel_state,  # type: ignore[arg-type]  # None: resolved there
        )
        self.layer_ids, self.stage_index, self.num_stages = layers, stage_index, num_stages
        state, sp = options.parallel_state, options.sequence_parallel
        init = normal_init(args.initializer_range)
        if self.is_first:
            with drawn_for(seed, "embedding"):
                self.embed_tokens = VocabParallelEmbedding(
                    args.vocab_size, args.hidden_size, sp, init, dtype, parallel_state=state
                )
        self.layers = torch.nn.ModuleDict()
        for i in layers:
            with drawn_for(seed, f"layer {i}"):
                self.layers[str(i)] = LlamaDecoderLayer(args, options)
        if self.is_last:
            self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, sp, dtype, parallel_state=state)
            # Tied: the embedding's draw, so a head on another stage starts equal to the table.
            with drawn_for(seed, "embedding" if args.tie_word_embeddings else "head"):
                self.lm_head = ColumnParallelLinear(
                    args.hidden_size, args.vocab_size, **options.linear(args, bias=False)
                )
            if self.is_first and args.tie_word_embeddings:
                self.lm_head.weight = self.embed_tokens.weight  # one parameter, as LlamaForCausalLM
        if self.tied_weight is not None and not (self.is_first and self.is_last):
            # Two stages hold these values (summed gradients, the same updates): a gradient norm
            # over the pipeline weighs each end 1/2 (neuron_ckpt.optim.buckets.stage_replicas).
            self.tied_weight.pipeline_replicas = 2  # type: ignore[attr-defined]  # a marker torch does not declare
        self.rotary = RotaryEmbedding(args)
        self.rng = StageRNG(seed, stage_index, state.tp_rank)

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1

    @property
    def parallel_state(self) -> ParallelState:
        return self.options.parallel_state

    @property
    def tied_weight(self) -> torch.nn.Parameter | None:
        """The parameter a tied model shares across the first and last stage (the embedding on
        the first, the head on the last), None when untied or on a middle stage."""
        if not self.args.tie_word_embeddings:
            return None
        if self.is_first:
            return self.embed_tokens.weight
        return self.lm_head.weight if self.is_last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ids ``[b, s]`` on the first stage, hidden ``[s, b, h]`` (``[s/t, b, h]`` under SP)
        elsewhere. Returns the hidden states, or on the last stage the logits ``[s, b, v/t]``."""
        if self.is_first:
            if x.dim() != 2:
                raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(x.shape)}")
            ids = x.t()  # [s, b]
            seq_len, hidden = ids.shape[0], self.embed_tokens(ids)
        else:
            hidden = x
            seq_len = x.shape[0] * (self.parallel_state.tp_size if self.options.sequence_parallel else 1)
        cos, sin = self.rotary(seq_len, hidden.dtype, hidden.device)
        with self.rng.active():
            hidden = run_layers(list(self.layers.values()), hidden, cos, sin)
        if self.is_last:
            return self.lm_head(self.norm(hidden))
        return hidden
