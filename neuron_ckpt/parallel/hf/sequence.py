"""Sequence parallelism for a transformers model: ``apply_tensor_parallel(model, sequence_parallel=True)``.

Under tensor parallelism alone every rank keeps the whole ``[b, s, h]`` activation wherever the
layer is not split: the norms' inputs and outputs, the residual stream, the inputs of the
projections (the paper's ``10sbh`` term). Sequence parallelism splits those along transformers'
sequence dimension (dim 1), so each rank holds ``s/t`` tokens of them:

* The embedding still returns the whole sequence (the model derives its position ids and causal
  mask from that length); the first decoder layer keeps this rank's chunk of it.
* Each child of a decoder layer is either a **region** or **token-wise**. A region sees the whole
  sequence: attention (it mixes tokens), an MoE block (its router and load-balancing loss see every
  token, as without sequence parallel) and any module the plan splits (the MLP). Its input
  is all-gathered on entry (a forward pre-hook) and its output returns to ``s/t`` tokens on exit.
  Token-wise children (the norms, anything replicated that works token by token) run on this
  rank's tokens; their parameters see a slice of the batch, so their gradients are summed over
  the group (a gradient hook, as ``replicated_with_grad_allreduce``), and their dropout draws from
  the tensor-parallel RNG stream (each rank drops its own tokens, as Megatron's bias-dropout-add).
* The final norm's output is all-gathered: the LM head and ``last_hidden_state`` see the whole
  sequence, as without sequence parallel.

A region's gathered input is not kept for backward: the entry gather runs output-discarding
(:func:`~neuron_ckpt.recompute.checkpoint_without_output`), so the projections that read it keep
a note, and backward all-gathers the kept ``s/t`` chunk again (Megatron's column layer keeps its
local input the same way). Each region has one of two kinds of edge, chosen from the plan:

* **Split projections only** (every parameter in it is in a ``colwise`` / ``rowwise`` /
  ``replicated_with_grad_allreduce`` module: Llama's attention and MLP): the entry's backward
  reduce-scatters the input's gradient once for all the column layers (which then skip their own
  all-reduce), and the one row-parallel child (``o_proj``, ``down_proj``) reduce-scatters its
  output along the sequence instead of all-reducing it. That the region returns exactly that
  child's output is checked at every call.
* **Anything else** (an MoE block with its replicated router, a replicated attention such as
  DeepSeek-V3's MLA): the region runs as under plain tensor parallel, its gathered input's
  gradient is complete on every rank (the backward keeps this rank's chunk), and its output is
  split on exit (the gradient all-gathered back).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from ...distributed.mappings import (
    copy_to_tensor_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tensor_parallel_region,
)
from ...distributed.parallel_state import ParallelState
from ...distributed.random import MODEL_PARALLEL_RNG, get_rng_tracker
from ...recompute.module import BEFORE_CHECKPOINT, SEQUENCE_PARALLEL
from ..linear import ColumnParallelLinear, RowParallelLinear
from .dense import sum_over_tp
from .dropout import draw_from_the_tp_stream
from .style import Target

SEQ = 1  # transformers' activations are [b, s, h]
_DENSE = ("colwise", "colwise_gather_output", "colwise_rep", "rowwise", "rowwise_split_input", "rowwise_rep",
          "replicated_with_grad_allreduce")  # fmt: skip
_ROW = ("rowwise", "rowwise_split_input", "rowwise_rep")


@dataclass
class _Region:
    """One child of a decoder layer that sees the whole sequence."""

    name: str
    reduce_scatter: bool  # split projections only: reduce-scatter edges
    producer: str | None = None  # the row-parallel child whose output the region returns
    produced: list[torch.Tensor] = field(default_factory=list)  # that child's outputs, this call
    blocks: list[Any] = field(default_factory=list)  # open discard_outputs blocks


@dataclass
class SequencePlan:
    """What sequence parallel changes, found (and checked) before anything changes."""

    base: str  # the model holding the layers, the embedding and the final norm ("model")
    layers: list[str]
    final_norm: str
    regions: list[_Region]
    token_wise: list[str]  # children of the layers that run on this rank's tokens


def plan_sequence_parallel(model: torch.nn.Module, targets: list[Target], tp_size: int) -> SequencePlan:
    """Find the layers, their regions and token-wise children, and the final norm; refuse (one
    line, nothing changed) a model this cannot split."""
    from ...recompute.hf import decoder_layers
    from ...recompute.moe import is_moe_block  # an MoE block: its router and aux loss need every token

    where = "apply_tensor_parallel(sequence_parallel=True)"
    try:
        layers = decoder_layers(model)
    except TypeError as e:
        raise ValueError(f"{where}: {e}") from None
    names = {id(m): n for n, m in model.named_modules()}
    layer_names = [names[id(layer)] for layer in layers]
    stack, _, _ = layer_names[0].rpartition(".")  # "model.layers"
    base = stack.rpartition(".")[0]
    final_norm = f"{base}.norm" if base else "norm"
    if not isinstance(getattr(model.get_submodule(base) if base else model, "norm", None), torch.nn.Module):
        raise ValueError(
            f"{where}: {type(model).__name__} has no final norm at {final_norm!r} after its decoder layers; "
            "sequence parallel gathers the sequence there for the LM head"
        )
    planned = {t.name: t.style for t in targets}
    regions, token_wise = [], []
    for layer_name, layer in zip(layer_names, layers):
        for child_name, child in layer.named_children():
            full = f"{layer_name}.{child_name}"
            inside = {n: s for n, s in planned.items() if n.startswith(full + ".")}
            if not inside and not _mixes_tokens(child) and not is_moe_block(child):
                token_wise.append(full)
                continue
            regions.append(_region(full, child, inside))
    dropping = [n for n in token_wise if any(isinstance(m, torch.nn.Dropout) and m.p > 0
                                            for m in model.get_submodule(n).modules())]  # fmt: skip
    if dropping and tp_size > 1 and MODEL_PARALLEL_RNG not in get_rng_tracker().states:
        raise ValueError(
            f"{where}: {dropping[0]} drops out on this rank's tokens, drawing from the tensor-parallel RNG stream; "
            "call nc.model_parallel_manual_seed(seed) first"
        )
    return SequencePlan(base, layer_names, final_norm, regions, token_wise)


def _mixes_tokens(module: torch.nn.Module) -> bool:
    """Attention: a module with a head size, or named so."""
    return "Attention" in type(module).__name__ or any(
        isinstance(getattr(module, a, None), int) for a in ("head_dim", "qk_head_dim")
    )


def _region(name: str, module: torch.nn.Module, inside: dict[str, str]) -> _Region:
    owners = {f"{name}.{n}" if n else name for n, m in module.named_modules()
              if next(m.parameters(recurse=False), None) is not None}  # fmt: skip
    split_only = bool(inside) and all(inside.get(o) in _DENSE for o in owners)
    rows = [n for n, s in inside.items() if s in _ROW and n.count(".") == name.count(".") + 1]
    return _Region(name, split_only, rows[0] if split_only and len(rows) == 1 else None)


def apply_sequence_parallel(model: torch.nn.Module, plan: SequencePlan, state: ParallelState) -> None:
    """Install the hooks and column/row modes of ``plan`` (after the plan's styles are applied)."""
    tp = state.tp
    entry = _SplitEntry(tp)
    (model.get_submodule(plan.base) if plan.base else model).register_forward_pre_hook(entry.record, with_kwargs=True)
    first = model.get_submodule(plan.layers[0])
    first.register_forward_pre_hook(entry, with_kwargs=True)
    first.__dict__[BEFORE_CHECKPOINT] = entry.before_checkpoint  # full recompute keeps the split input
    for name in plan.layers:
        model.get_submodule(name).__dict__[SEQUENCE_PARALLEL] = True  # apply_recompute refuses distributing inputs
    norm = model.get_submodule(plan.final_norm)
    norm.register_forward_hook(lambda m, a, out: gather_from_sequence_parallel_region(
        out, tp, tensor_parallel_output_grad=False, dim=SEQ))  # fmt: skip
    for name in plan.token_wise + [plan.final_norm]:
        module = model.get_submodule(name)
        for p in module.parameters():
            if p.requires_grad:
                p.register_hook(sum_over_tp(state))
        if any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in module.modules()):
            draw_from_the_tp_stream(module)
    for region in plan.regions:
        module = model.get_submodule(region.name)
        if region.reduce_scatter:
            for sub in module.modules():
                if type(sub) is ColumnParallelLinear:
                    sub.__class__ = _ColumnInRegion
        if region.producer is not None:
            producer = model.get_submodule(region.producer)
            producer.__class__ = _RowLeavingRegion
            producer.register_forward_hook(lambda m, a, out, r=region: r.produced.append(out))
        module.register_forward_pre_hook(_RegionEntry(region, tp), with_kwargs=True)
        module.register_forward_hook(_RegionExit(region, tp), with_kwargs=True, always_call=True)


# --------------------------------------------------------------------------------------------
# The hooks.


def _hidden(args: tuple, kwargs: dict, where: str) -> tuple[torch.Tensor, Any]:
    """The hidden states a layer or region is called with, and how to put a replacement back."""
    if args and torch.is_tensor(args[0]):
        return args[0], lambda x: ((x, *args[1:]), kwargs)
    if torch.is_tensor(kwargs.get("hidden_states")):
        return kwargs["hidden_states"], lambda x: (args, {**kwargs, "hidden_states": x})
    raise TypeError(f"sequence parallel: {where} was called without hidden states (first argument or hidden_states=)")


class _SplitEntry:
    """The first decoder layer keeps this rank's ``s/t`` tokens of the embedding's output.

    A forward pre-hook of the layer, and the layer's :data:`BEFORE_CHECKPOINT` when full
    recompute wraps it (then it splits before the checkpoint and the hook, inside it, finds the
    input split already: it knows the whole length from the model's own pre-hook, :meth:`record`)."""

    def __init__(self, tp):
        self.tp = tp
        self.length: int | None = None  # the sequence length of the model's current call

    def record(self, base, args, kwargs) -> None:
        for x in (kwargs.get("input_ids"), kwargs.get("inputs_embeds"), args[0] if args else None):
            if torch.is_tensor(x) and x.dim() >= 2:
                self.length = x.shape[SEQ]
                return

    def before_checkpoint(self, layer, args, kwargs) -> tuple[tuple, dict]:
        x, _ = _hidden(args, kwargs, type(layer).__name__)
        self.length = x.shape[SEQ]  # the whole length, also when the layer is called on its own
        return self(layer, args, kwargs) or (args, kwargs)

    def __call__(self, layer, args, kwargs):
        x, put = _hidden(args, kwargs, type(layer).__name__)
        if self.length is not None and x.shape[SEQ] * self.tp.size == self.length:
            return None  # this rank's chunk already (split before a full-recompute checkpoint)
        if x.shape[SEQ] % self.tp.size:
            raise ValueError(
                f"sequence parallel: sequence length {x.shape[SEQ]} (dim 1 of [b, s, h]) is not divisible by the "
                f"tensor-parallel size {self.tp.size}"
            )
        # A copy of this rank's chunk: as a view it would hold the whole sequence's storage for as
        # long as anything keeps it (a full-recompute checkpoint of this layer does)
        return put(scatter_to_sequence_parallel_region(x, self.tp, dim=SEQ).clone())


class _RegionEntry:
    """All-gather the region's input; its consumers keep a note of the gathered copy (a discard
    block open until the region's exit) and backward gathers it again."""

    def __init__(self, region: _Region, tp):
        self.region, self.tp = region, tp

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        return gather_from_sequence_parallel_region(x, self.tp, self.region.reduce_scatter, dim=SEQ)

    def __call__(self, module, args, kwargs):
        from ...recompute.discard import checkpoint_without_output, discard_outputs

        x, put = _hidden(args, kwargs, self.region.name)
        block = discard_outputs()
        block.__enter__()
        self.region.blocks.append(block)
        self.region.produced.clear()
        return put(checkpoint_without_output(self.gather, x))


class _RegionExit:
    """Close the discard block; return to ``s/t`` tokens: the row-parallel child reduce-scattered
    already (checked), or split the whole output here."""

    def __init__(self, region: _Region, tp):
        self.region, self.tp = region, tp

    def __call__(self, module, args, kwargs, output):
        self.region.blocks.pop().__exit__(*sys.exc_info())
        if sys.exc_info()[0] is not None:  # always_call: the forward raised; let it through
            return None
        first = output[0] if isinstance(output, tuple) else output
        if self.region.producer is not None:
            produced = self.region.produced
            if len(produced) != 1 or first is not produced[0]:
                raise RuntimeError(
                    f"sequence parallel: {self.region.name} ({type(module).__name__}) returned something other than "
                    f"the output of {self.region.producer}, whose output was reduce-scattered along the sequence; "
                    "this region cannot run sequence parallel"
                )
            produced.clear()
            return None
        local = scatter_to_sequence_parallel_region(first, self.tp, dim=SEQ)
        return (local, *output[1:]) if isinstance(output, tuple) else local


# --------------------------------------------------------------------------------------------
# The column and row layers at a region's edges.


class _ColumnInRegion(ColumnParallelLinear):
    """A column layer whose input the region's entry gathered: the entry reduce-scatters the input's
    gradient once for all the region's column layers, so the layer adds no all-reduce of its own."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        return gather_from_tensor_parallel_region(y, self.parallel_state.tp) if self.gather_output else y


class _RowLeavingRegion(RowParallelLinear):
    """The row layer whose output leaves the region: partial sums reduce-scattered along the
    sequence (``[b, s, h] -> [b, s/t, h]``) instead of all-reduced; its bias, replicated, is added
    to this rank's tokens (its gradient summed over the group)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tp = self.parallel_state.tp
        if not self.input_is_parallel:
            x = scatter_to_tensor_parallel_region(x, tp)
        y = reduce_scatter_to_sequence_parallel_region(F.linear(x, self.weight), tp, dim=SEQ)
        return y + copy_to_tensor_parallel_region(self.bias, tp) if self.bias is not None else y
