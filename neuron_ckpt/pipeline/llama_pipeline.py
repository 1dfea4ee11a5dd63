"""``LlamaPipeline``: this rank's stages of a Llama, and one training step of ``m`` micro-batches.

::

    nc.initialize_model_parallel(tensor_parallel_size=2, pipeline_parallel_size=2)
    pipe = LlamaPipeline(config, PipelineConfig(schedule="1F1B", micro_batches=8),
                         micro_batch_size=1, seq_len=4096, sequence_parallel=True)
    apply_pipeline_recompute(pipe, RecomputeConfig(granularity="full", method="block", num_layers=2))
    optimizer = torch.optim.AdamW(pipe.parameters())
    loss = pipe.step(input_ids, labels)     # [m * b, s] each; the loss on the last stage, else None
    optimizer.step(); optimizer.zero_grad()

Every rank passes the same batch (its data-parallel replica's); the first stage reads the ids, the
last the labels, the others neither (None is accepted there). The step runs torch's schedule
(:mod:`.schedule`) and then :meth:`LlamaPipeline.finish_gradients` (tied embeddings, :mod:`.tied`).
Gradients are then this replica's; reducing them over data parallel (ZeRO-1) is the trainer's job,
after the step.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from ..distributed import runtime
from ..distributed.parallel_state import ParallelState, get_parallel_state
from ..models.llama_args import LlamaArgs
from .config import CP_REFUSAL, PipelineConfig
from .cut import PipelineCut, cut_layers
from .hf_weights import load_stage_hf_state_dict, stage_hf_state_dict
from .llama_stage import LlamaStage
from .loss import PipelineLoss
from .schedule import build_schedule, check_recompute_composes, torch_stage
from .tied import all_reduce_tied_gradients
from .xla import refuse_on_xla


class LlamaPipeline:
    """The stages pipeline rank ``pp_rank`` holds (``modules``, one per virtual stage, in loop
    order), torch's ``PipelineStage`` for each and the schedule.

    ``micro_batch_size`` (``b``) and ``seq_len`` (``s``): the shape of one micro-batch, fixed, so
    torch knows every message's shape up front. The rest as for ``LlamaForCausalLM``; ``seed``: see
    :class:`~.llama_stage.LlamaStage`. Checks run before anything is built.
    """

    def __init__(
        self,
        config: LlamaArgs | Any,
        pipeline: PipelineConfig,
        micro_batch_size: int,
        seq_len: int,
        sequence_parallel: bool = False,
        attention_implementation: str = "explicit",
        dtype: torch.dtype = torch.float32,
        parallel_state: ParallelState | None = None,
        seed: int = 0,
    ):
        refuse_on_xla(runtime.is_xla())
        args = LlamaArgs.from_hf(config)
        if not isinstance(pipeline, PipelineConfig):
            raise TypeError(f"pipeline must be a PipelineConfig, got {type(pipeline).__name__}")
        state = parallel_state if parallel_state is not None else get_parallel_state()
        if state.cp_size > 1:
            raise ValueError(CP_REFUSAL.format(cp=state.cp_size))
        pipeline.validate(state.pp_size)
        for name, value in (("micro_batch_size", micro_batch_size), ("seq_len", seq_len)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if sequence_parallel and seq_len % state.tp_size:
            raise ValueError(
                f"seq_len={seq_len} must be divisible by the tensor-parallel size {state.tp_size} "
                "under sequence parallel"
            )
        self.args, self.config, self.parallel_state = args, pipeline, state
        self.micro_batch_size, self.seq_len = micro_batch_size, seq_len
        self.cut: PipelineCut = cut_layers(
            args.num_hidden_layers, state.pp_size, pipeline.virtual_stages, pipeline.layers_per_stage,
            pipeline.embedding_cost, pipeline.head_cost,
        )  # fmt: skip
        self.stage_indices = self.cut.stages_of_rank(state.pp_rank)
        S = self.cut.num_stages
        self.device = runtime.get_runtime().device
        self.modules = [
            LlamaStage(args, self.cut.layers[k], k, S, sequence_parallel, attention_implementation, dtype, state, seed)
            .to(self.device)
            for k in self.stage_indices
        ]  # fmt: skip
        self.loss = PipelineLoss(state.tp, pipeline.loss_average, pipeline.micro_batches)
        assert state.pp is not None  # a pipeline has a PP group
        self.torch_stages = [
            torch_stage(m, k, S, *self._example_io(m), state.pp.process_group, self.device)
            for k, m in zip(self.stage_indices, self.modules)
        ]
        self.schedule = build_schedule(self.torch_stages, pipeline, self.loss)

    # --- shapes ---------------------------------------------------------------------------------

    @property
    def batch_shape(self) -> tuple[int, int]:
        """``(m * b, s)``: the ids and labels one :meth:`step` takes."""
        return (self.config.micro_batches * self.micro_batch_size, self.seq_len)

    def _example_io(self, stage: LlamaStage) -> tuple[torch.Tensor, torch.Tensor]:
        """One micro-batch's input and output of ``stage``, as meta tensors."""
        b, s, a = self.micro_batch_size, self.seq_len, self.args
        t, dtype = self.parallel_state.tp_size, stage.options.dtype
        local_s = s // t if stage.options.sequence_parallel else s
        meta: dict[str, Any] = dict(device="meta")
        hidden = torch.empty(local_s, b, a.hidden_size, dtype=dtype, requires_grad=True, **meta)
        x = torch.empty(b, s, dtype=torch.long, **meta) if stage.is_first else hidden
        y = torch.empty(s, b, a.vocab_size // t, dtype=dtype, requires_grad=True, **meta) if stage.is_last else hidden
        return x, y

    # --- the step ---------------------------------------------------------------------------------

    @property
    def holds_first_stage(self) -> bool:
        return any(m.is_first for m in self.modules)

    @property
    def holds_last_stage(self) -> bool:
        return any(m.is_last for m in self.modules)

    def step(
        self, input_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None, finish_gradients: bool = True
    ) -> torch.Tensor | None:
        """Forward and backward of the batch (``[m * b, s]`` ids and labels) in ``m`` micro-batches;
        gradients accumulate into ``.grad``. Returns the batch's loss (detached) on the ranks of
        the last stage, None elsewhere. ``finish_gradients=False``: leave the tied-embedding
        reduction to a later :meth:`finish_gradients` (gradient accumulation over several steps).
        """
        check_recompute_composes(self.config.schedule, self.modules)
        args: tuple = ()
        if self.holds_first_stage:
            args = (self._checked("input_ids", input_ids),)
        target = None
        if self.holds_last_stage:
            target = self._checked("labels", labels)
            self.loss.start(target)
        losses: list[torch.Tensor] = []
        self.schedule.step(*args, target=target, losses=losses, return_outputs=False)
        if finish_gradients:
            self.finish_gradients()
        return torch.stack([x.detach() for x in losses]).sum() if self.holds_last_stage else None

    def _checked(self, name: str, x: torch.Tensor | None) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or tuple(x.shape) != self.batch_shape:
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(
                f"{name} must be a [{self.batch_shape[0]}, {self.batch_shape[1]}] tensor (micro_batches x "
                f"micro_batch_size, seq_len) on the ranks of stage {list(self.stage_indices)}, got {got}"
            )
        return x.to(self.device)

    def finish_gradients(self) -> int:
        """Sum the tied embedding's gradients over the first and last stage (:mod:`.tied`); call once
        per optimizer step, after the last backward and before any data-parallel reduction."""
        return all_reduce_tied_gradients(self.modules, self.parallel_state)

    # --- parameters and weights ------------------------------------------------------------------

    def named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        """Every local stage's parameters under the full model's names."""
        for module in self.modules:
            yield from module.named_parameters()

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        for _, p in self.named_parameters():
            yield p

    def train(self, mode: bool = True) -> LlamaPipeline:
        for module in self.modules:
            module.train(mode)
        return self

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's stages' parameters (its TP shards) under the full model's names: what a
        sharded training checkpoint stores for this (stage, TP rank)."""
        out: dict[str, torch.Tensor] = {}
        for module in self.modules:
            out.update(module.state_dict())
        return out

    def load_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load what :meth:`state_dict` returned (strict: the same stages and shards)."""
        mine = set(self.state_dict())
        if set(state_dict) != mine:
            missing, unexpected = sorted(mine - set(state_dict)), sorted(set(state_dict) - mine)
            raise ValueError(
                f"LlamaPipeline.load_state_dict: stages {list(self.stage_indices)} miss {missing[:4]} "
                f"and do not hold {unexpected[:4]} (saved with another cut?)"
            )
        for module in self.modules:
            module.load_state_dict({k: state_dict[k] for k in module.state_dict()})

    def rng_state_dict(self) -> list[dict[str, Any]]:
        """Each local stage's dropout streams (:class:`~.rng.StageRNG`), for a resumed run to
        continue them; every rank saves its own (``TrainState`` does)."""
        return [{"default": m.rng.default, "tp": m.rng.tp} for m in self.modules]

    def load_rng_state_dict(self, states: list[dict[str, Any]]) -> None:
        if len(states) != len(self.modules):
            raise ValueError(
                f"LlamaPipeline.load_rng_state_dict: {len(states)} stages' streams, this rank holds "
                f"{len(self.modules)} stages"
            )
        for module, state in zip(self.modules, states):
            module.rng.default, module.rng.tp = state["default"], state["tp"]

    def load_hf_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load this rank's stages' shards out of a full ``transformers`` state dict."""
        for module in self.modules:
            load_stage_hf_state_dict(module, state_dict)

    def hf_state_dict(self, grads: bool = False) -> dict[str, torch.Tensor]:
        """This rank's stages' full tensors (or gradients), named as in ``transformers``."""
        out: dict[str, torch.Tensor] = {}
        for module in self.modules:
            out.update(stage_hf_state_dict(module, grads))
        return out
