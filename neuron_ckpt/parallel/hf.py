"""Tensor parallelism for a ``transformers`` model, from the plan the model carries.

Every transformers causal LM names how its modules split over a tensor-parallel group
(``model.tp_plan``: ``config.base_model_tp_plan`` under the base model's prefix, plus the LM head
and the input embedding). :func:`apply_tensor_parallel` reads that plan and swaps each planned
module for our layer of the same shape, sliced from the weights the model already holds:

===============================  =============================================================
plan style                        becomes
===============================  =============================================================
``colwise``                       :class:`ColumnParallelLinear` (output stays split)
``colwise_gather_output``         :class:`ColumnParallelLinear` with ``gather_output``
``rowwise``                       :class:`RowParallelLinear` (input already split)
``rowwise_split_input``           :class:`RowParallelLinear` splitting its replicated input
``embedding_rowwise``             :class:`VocabParallelEmbedding` (vocabulary rows split)
``replicated_with_grad_allreduce``  kept; each parameter's gradient is summed over the group
``replicate``                     kept as it is
===============================  =============================================================

``loss_parallel`` (default on): the LM head planned ``colwise_gather_output`` keeps its logits
split over the vocabulary and the model's loss becomes :func:`vocab_parallel_cross_entropy`, so
the ``[b, s, v]`` logits are never gathered; ``outputs.logits`` is then this rank's vocabulary
slice. Parameter names stay as they are; a state dict holds this rank's slices, and
``load_state_dict`` accepts either those or the full tensors (sliced on the way in), so a
checkpoint loads before or after the swap. Everything is checked before anything changes: a
style we do not map, a module that is not the kind its style needs, or heads that do not split
evenly is a one-line ``ValueError`` naming the module and the style.

Attention modules whose heads are split and that drop out run inside
``get_rng_tracker().fork()`` (forward hooks), so each rank draws its own dropout mask for its own
heads, as our ``CoreAttention`` does; that needs ``model_parallel_manual_seed`` first.

Not covered: sequence parallelism (transformers' activations are ``[b, s, h]`` and its norms are
its own), and key/value heads fewer than the group (replicating them, as
:class:`QKVParallelLinear` does, would need the attention module's own head counts changed).
"""

from __future__ import annotations

import re
from typing import Any, Callable

import torch
import torch.nn.functional as F

from ..distributed import collectives as C
from ..distributed.parallel_state import ParallelState
from ..distributed.random import MODEL_PARALLEL_RNG, get_rng_tracker
from .cross_entropy import vocab_parallel_cross_entropy
from .embedding import VocabParallelEmbedding
from .layer_args import resolve_parallel_state
from .linear import ColumnParallelLinear, RowParallelLinear
from .params import set_tensor_parallel_attributes

LINEAR_STYLES = {  # style -> (column?, gather_output / input_is_parallel)
    "colwise": (True, False),
    "colwise_gather_output": (True, True),
    "colwise_rep": (True, True),
    "rowwise": (False, True),
    "rowwise_split_input": (False, False),
    "rowwise_rep": (False, False),
}
STYLES = (*LINEAR_STYLES, "embedding_rowwise", "replicated_with_grad_allreduce", "replicate")


def apply_tensor_parallel(
    model: torch.nn.Module,
    plan: dict[str, str] | None = None,
    *,
    loss_parallel: bool = True,
    parallel_state: ParallelState | None = None,
) -> torch.nn.Module:
    """Split ``model`` over the tensor-parallel group by ``plan`` (default: ``model.tp_plan``).

    ``plan`` maps module names (``*`` matches one name part, e.g. a layer index) to styles; see
    the module docstring. Returns ``model``, changed in place.
    """
    state = resolve_parallel_state(parallel_state)
    if plan is None:
        plan = getattr(model, "tp_plan", None)
        if not plan:
            raise ValueError(
                f"apply_tensor_parallel: {type(model).__name__} has no tensor-parallel plan (model.tp_plan); "
                "pass plan={module name pattern: style}"
            )
    targets = _resolve(model, plan)
    head = _loss_parallel_head(model, targets) if loss_parallel else None
    tied = _tied_pairs(model, targets)
    for name, module, style in targets:
        _check(model, name, module, style, state.tp_size)
    split_attention = _split_attention_with_dropout(model, targets) if state.tp_size > 1 else []
    if split_attention and MODEL_PARALLEL_RNG not in get_rng_tracker().states:
        raise ValueError(
            f"apply_tensor_parallel: {split_attention[0]} has attention dropout and its heads are split: each rank "
            "draws its own mask from the tensor-parallel RNG stream; call nc.model_parallel_manual_seed(seed) first"
        )
    for name, module, style in targets:
        if style == "replicated_with_grad_allreduce":
            for p in module.parameters(recurse=False):
                p.register_hook(_sum_over(state))
        elif style != "replicate":
            _swap(model, name, _parallel(module, style, state, head == name))
    for name in split_attention:
        _draw_from_the_tp_stream(model.get_submodule(name))
    for lm_head, embedding in tied:
        model.get_submodule(lm_head).weight = model.get_submodule(embedding).weight
    if head is not None:
        model.loss_function = _vocab_parallel_loss(state)
    return model


def _resolve(model: torch.nn.Module, plan: dict[str, str]) -> list[tuple[str, torch.nn.Module, str]]:
    """Every (name, module, style) the plan matches, in module order; unknown styles refused."""
    patterns = []
    for key, style in plan.items():
        if style not in STYLES:
            raise ValueError(
                f"apply_tensor_parallel: plan entry {key!r} has style {style!r}, which neuron_ckpt does not map "
                f"(supported: {', '.join(STYLES)})"
            )
        parts = (re.escape(p) if p != "*" else r"[^.]+" for p in key.split("."))
        patterns.append((re.compile(r"\.".join(parts) + r"\Z"), style))
    targets = []
    for name, module in model.named_modules():
        styles = {style for pattern, style in patterns if pattern.match(name)}
        if len(styles) > 1:
            raise ValueError(f"apply_tensor_parallel: {name} matches plan entries with styles {sorted(styles)}")
        if styles:
            targets.append((name, module, styles.pop()))
    return targets


def _loss_parallel_head(model: torch.nn.Module, targets: list[tuple[str, torch.nn.Module, str]]) -> str | None:
    """The LM head's name when its logits can stay split: the model's output embedding, planned
    ``colwise_gather_output``, on a model that computes its loss through ``loss_function``."""
    get_output = getattr(model, "get_output_embeddings", None)
    out = get_output() if callable(get_output) else None
    if out is None or not hasattr(type(model), "loss_function"):
        return None
    for name, module, style in targets:
        if module is out and style == "colwise_gather_output":
            return name
    return None


def _tied_pairs(model: torch.nn.Module, targets: list[tuple[str, torch.nn.Module, str]]) -> list[tuple[str, str]]:
    """(LM head, embedding) names sharing one weight: both planned, both split by vocabulary rows."""
    planned = {name: style for name, _, style in targets}
    holders: dict[int, list[str]] = {}  # id(weight) -> the modules holding it, one pass over the model
    for other, m in model.named_modules():
        if isinstance(getattr(m, "weight", None), torch.Tensor):
            holders.setdefault(id(m.weight), []).append(other)
    pairs = []
    for name, module, style in targets:
        weight = getattr(module, "weight", None)
        for other in holders.get(id(weight), []) if isinstance(weight, torch.Tensor) else []:
            if other == name:
                continue
            if other not in planned:
                raise ValueError(
                    f"apply_tensor_parallel: {name} ({style}) shares its weight with {other}, which the plan "
                    f"leaves whole; plan both or neither"
                )
            if style == "embedding_rowwise":
                if not planned[other].startswith("colwise"):
                    raise ValueError(
                        f"apply_tensor_parallel: {other} ({planned[other]}) shares its weight with {name} "
                        f"(embedding_rowwise); a tied weight must be split by vocabulary rows in both (colwise)"
                    )
                pairs.append((other, name))
    return pairs


def _check(model: torch.nn.Module, name: str, module: torch.nn.Module, style: str, t: int) -> None:
    where = f"apply_tensor_parallel: {name} ({style})"
    if style in LINEAR_STYLES:
        if type(module) is not torch.nn.Linear:
            raise ValueError(f"{where}: needs a torch.nn.Linear, got {type(module).__name__}")
        column, _ = LINEAR_STYLES[style]
        size, what = (module.out_features, "out_features") if column else (module.in_features, "in_features")
        if size % t:
            raise ValueError(f"{where}: {what}={size} is not divisible by the tensor-parallel size {t}")
        head_dim = getattr(model.get_submodule(name.rpartition(".")[0]) if "." in name else model, "head_dim", None)
        split_heads = (column and style == "colwise") or (not column and style == "rowwise")
        if split_heads and isinstance(head_dim, int) and (size // t) % head_dim:
            raise ValueError(
                f"{where}: {size // head_dim} heads of {head_dim} do not split over the tensor-parallel size {t}; "
                f"each rank needs whole heads (key/value heads are not replicated on transformers models): "
                f"choose a size that divides the number of heads"
            )
    elif style == "embedding_rowwise":
        if not isinstance(module, torch.nn.Embedding) or not _plain_embedding(module):
            raise ValueError(
                f"{where}: needs a torch.nn.Embedding (or one that only scales by embed_scale), got {type(module).__name__}"
            )
        if module.num_embeddings % t:
            raise ValueError(f"{where}: num_embeddings={module.num_embeddings} is not divisible by the tensor-parallel size {t}")
        if module.max_norm is not None or module.scale_grad_by_freq or module.sparse:
            raise ValueError(f"{where}: max_norm, scale_grad_by_freq and sparse are not supported")


def _plain_embedding(module: torch.nn.Embedding) -> bool:
    """``nn.Embedding`` itself, or transformers' ``*ScaledWordEmbedding`` (lookup times ``embed_scale``)."""
    return type(module) is torch.nn.Embedding or (
        type(module).__name__.endswith("ScaledWordEmbedding") and isinstance(getattr(module, "embed_scale", None), torch.Tensor)
    )


def _parallel(module: torch.nn.Module, style: str, state: ParallelState, keeps_split: bool) -> torch.nn.Module:
    """Our layer for ``module``, holding this rank's slice of its weights."""
    t, r = state.tp_size, state.tp_rank
    w = module.weight
    if style == "embedding_rowwise":
        new = HFVocabParallelEmbedding(module, state)
        _take(new, "weight", w, 0, t, r)
        return new
    column, flag = LINEAR_STYLES[style]
    kwargs = dict(bias=module.bias is not None, dtype=w.dtype, device="meta", parallel_state=state, init_method=_no_init)
    if column:
        new = ColumnParallelLinear(module.in_features, module.out_features, gather_output=flag and not keeps_split, **kwargs)
        _take(new, "weight", w, 0, t, r)
        if module.bias is not None:
            _take(new, "bias", module.bias, 0, t, r)
    else:
        new = RowParallelLinear(module.in_features, module.out_features, input_is_parallel=flag, **kwargs)
        _take(new, "weight", w, 1, t, r)
        if module.bias is not None:
            new.bias = torch.nn.Parameter(module.bias.detach(), requires_grad=module.bias.requires_grad)
    return new


def _no_init(weight: torch.Tensor) -> None:
    """The weights come from the model: nothing to draw."""


def _take(module: torch.nn.Module, name: str, full: torch.Tensor, dim: int, t: int, r: int) -> None:
    """Set ``module.<name>`` to slice ``r`` of ``t`` of ``full`` along ``dim``; tag it; let
    ``load_state_dict`` slice a full tensor the same way."""
    shard = full.detach().chunk(t, dim)[r].clone()
    param = torch.nn.Parameter(shard, requires_grad=full.requires_grad)
    set_tensor_parallel_attributes(param, partition_dim=dim)
    setattr(module, name, param)
    shapes = module.__dict__.setdefault("_full_shapes", {})
    shapes[name] = (tuple(full.shape), dim, t, r)
    if len(shapes) == 1:
        module.register_load_state_dict_pre_hook(_slice_full_tensors)


def _slice_full_tensors(module, state_dict, prefix, *args) -> None:
    for name, (shape, dim, t, r) in module._full_shapes.items():
        value = state_dict.get(prefix + name)
        if value is not None and tuple(value.shape) == shape and t > 1:
            state_dict[prefix + name] = value.chunk(t, dim)[r]


class HFVocabParallelEmbedding(VocabParallelEmbedding):
    """A transformers input embedding split over the vocabulary, keeping its ``padding_idx`` and a
    ``*ScaledWordEmbedding``'s ``embed_scale`` (the lookup times the scale, in the weight's dtype)."""

    def __init__(self, dense: torch.nn.Embedding, state: ParallelState):
        super().__init__(dense.num_embeddings, dense.embedding_dim, init_method=_no_init, dtype=dense.weight.dtype,
                         device="meta", parallel_state=state, padding_idx=dense.padding_idx)  # fmt: skip
        scale = getattr(dense, "embed_scale", None)
        if scale is not None:
            persistent = "embed_scale" not in dense._non_persistent_buffers_set
            self.register_buffer("embed_scale", scale.detach().clone(), persistent=persistent)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = super().forward(ids)
        scale = getattr(self, "embed_scale", None)
        return out * scale.to(self.weight.dtype) if scale is not None else out


def _swap(model: torch.nn.Module, name: str, new: torch.nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)


def _split_attention_with_dropout(model: torch.nn.Module, targets: list[tuple[str, torch.nn.Module, str]]) -> list[str]:
    """Attention modules whose heads the plan splits (a ``colwise`` child) and that drop out."""
    names = {name.rpartition(".")[0] for name, _, style in targets if style == "colwise" and "." in name}
    return sorted(n for n in names if isinstance(getattr(model.get_submodule(n), "head_dim", None), int)
                  and getattr(model.get_submodule(n), "attention_dropout", 0) > 0)  # fmt: skip


def _draw_from_the_tp_stream(attention: torch.nn.Module) -> None:
    """Run ``attention``'s forward inside ``get_rng_tracker().fork()``: its dropout, on this rank's
    heads only, then draws a mask of its own on each rank (as our ``CoreAttention`` does) instead
    of the same pattern on every rank from the default generator. The projections draw nothing."""
    forks: list[Any] = []

    def enter(module, args):
        forks.append(get_rng_tracker().fork())
        forks[-1].__enter__()

    def leave(module, args, output):
        forks.pop().__exit__(None, None, None)

    attention.register_forward_pre_hook(enter)
    attention.register_forward_hook(leave, always_call=True)


def _sum_over(state: ParallelState) -> Callable[[torch.Tensor], torch.Tensor]:
    """A gradient hook summing over the TP group: the parameter saw only this rank's heads."""
    return lambda grad: C.all_reduce(grad, state.tp)


def _vocab_parallel_loss(state: ParallelState) -> Callable[..., torch.Tensor]:
    """transformers' causal-LM loss (labels shifted inside, ``-100`` ignored, ``mean`` or ``sum``
    over ``num_items_in_batch``) on logits split over the vocabulary."""

    def loss(logits, labels, vocab_size: int, num_items_in_batch: Any = None, ignore_index: int = -100,
             shift_labels: torch.Tensor | None = None, **kwargs) -> torch.Tensor:  # fmt: skip
        if shift_labels is None:
            shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        reduction = "sum" if num_items_in_batch is not None else "mean"
        out = vocab_parallel_cross_entropy(logits.float(), shift_labels.to(logits.device), ignore_index, reduction, state.tp)
        if num_items_in_batch is not None:
            out = out / (num_items_in_batch.to(out.device) if torch.is_tensor(num_items_in_batch) else num_items_in_batch)
        return out

    return loss
