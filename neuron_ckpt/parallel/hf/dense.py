"""The dense styles: linear layers, the input embedding, and replicated modules.

``colwise`` / ``rowwise`` (and their gathering and splitting variants) swap an ``nn.Linear`` for
our :class:`ColumnParallelLinear` / :class:`RowParallelLinear`; ``embedding_rowwise`` swaps the
input embedding for :class:`VocabParallelEmbedding`; ``replicated_with_grad_allreduce`` keeps
the module and sums its parameters' gradients over the group; ``replicate`` keeps it as it is.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch

from ...distributed import collectives as C
from ...distributed.parallel_state import ParallelState
from ..embedding import VocabParallelEmbedding
from ..linear import ColumnParallelLinear, RowParallelLinear
from .shards import no_init, swap, take
from .style import Split, Style, Target, no_check

LINEAR_STYLES = {  # style -> (column?, gather_output / input_is_parallel)
    "colwise": (True, False),
    "colwise_gather_output": (True, True),
    "colwise_rep": (True, True),
    "rowwise": (False, True),
    "rowwise_split_input": (False, False),
    "rowwise_rep": (False, False),
}


def _check_linear(model: torch.nn.Module, target: Target, t: int) -> None:
    name, module, style, where = target.name, target.module, target.style, target.where
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


def _apply_linear(target: Target, split: Split) -> None:
    """Swap the ``nn.Linear`` for our layer holding this rank's slice of its weights."""
    module, state = cast(torch.nn.Linear, target.module), split.state  # the plan targets an nn.Linear here
    t, r = state.tp_size, state.tp_rank
    w = module.weight
    column, flag = LINEAR_STYLES[target.style]
    new: torch.nn.Module
    kwargs: dict[str, Any] = dict(
        bias=module.bias is not None, dtype=w.dtype, device="meta", parallel_state=state, init_method=no_init
    )
    if column:
        keeps_split = split.loss_head == target.name
        new = ColumnParallelLinear(
            module.in_features,
            module.out_features,
            gather_output=flag and not keeps_split,
            **kwargs,
        )
        take(new, "weight", w, 0, t, r)
        if module.bias is not None:
            take(new, "bias", module.bias, 0, t, r)
    else:
        new = RowParallelLinear(module.in_features, module.out_features, input_is_parallel=flag, **kwargs)
        take(new, "weight", w, 1, t, r)
        if module.bias is not None:
            new.bias = torch.nn.Parameter(module.bias.detach(), requires_grad=module.bias.requires_grad)
    swap(split.model, target.name, new)


def _check_embedding(model: torch.nn.Module, target: Target, t: int) -> None:
    module, where = target.module, target.where
    if not isinstance(module, torch.nn.Embedding) or not _plain_embedding(module):
        raise ValueError(
            f"{where}: needs a torch.nn.Embedding (or one that only scales by embed_scale), got {type(module).__name__}"
        )
    if module.num_embeddings % t:
        raise ValueError(
            f"{where}: num_embeddings={module.num_embeddings} is not divisible by the tensor-parallel size {t}"
        )
    if module.max_norm is not None or module.scale_grad_by_freq or module.sparse:
        raise ValueError(f"{where}: max_norm, scale_grad_by_freq and sparse are not supported")


def _plain_embedding(module: torch.nn.Embedding) -> bool:
    """``nn.Embedding`` itself, or transformers' ``*ScaledWordEmbedding`` (lookup times ``embed_scale``)."""
    return type(module) is torch.nn.Embedding or (
        type(module).__name__.endswith("ScaledWordEmbedding")
        and isinstance(getattr(module, "embed_scale", None), torch.Tensor)
    )


def _apply_embedding(target: Target, split: Split) -> None:
    module = cast(torch.nn.Embedding, target.module)  # the plan targets an nn.Embedding here
    new = HFVocabParallelEmbedding(module, split.state)
    take(new, "weight", module.weight, 0, split.state.tp_size, split.state.tp_rank)
    swap(split.model, target.name, new)


class HFVocabParallelEmbedding(VocabParallelEmbedding):
    """A transformers input embedding split over the vocabulary, keeping its ``padding_idx`` and a
    ``*ScaledWordEmbedding``'s ``embed_scale`` (the lookup times the scale, in the weight's dtype)."""

    def __init__(self, dense: torch.nn.Embedding, state: ParallelState):
        super().__init__(dense.num_embeddings, dense.embedding_dim, init_method=no_init, dtype=dense.weight.dtype,
                         device="meta", parallel_state=state, padding_idx=dense.padding_idx)  # fmt: skip
        scale = getattr(dense, "embed_scale", None)
        if scale is not None:
            persistent = "embed_scale" not in dense._non_persistent_buffers_set
            self.register_buffer("embed_scale", scale.detach().clone(), persistent=persistent)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = super().forward(ids)
        scale = getattr(self, "embed_scale", None)
        return out * scale.to(self.weight.dtype) if scale is not None else out


def _apply_grad_allreduce(target: Target, split: Split) -> None:
    for p in target.module.parameters(recurse=False):
        p.register_hook(sum_over_tp(split.state))


def sum_over_tp(state: ParallelState) -> Callable[[torch.Tensor], torch.Tensor]:
    """A gradient hook summing over the TP group: the parameter saw only this rank's heads (or,
    under sequence parallel, only this rank's tokens)."""
    return lambda grad: C.all_reduce(grad, state.tp)


def _keep(target: Target, split: Split) -> None:
    """Every rank keeps the whole module."""


DENSE_STYLES: dict[str, Style] = {
    **{style: Style(_check_linear, _apply_linear) for style in LINEAR_STYLES},
    "embedding_rowwise": Style(_check_embedding, _apply_embedding),
    "replicated_with_grad_allreduce": Style(no_check, _apply_grad_allreduce),
    "replicate": Style(no_check, _keep),
}
