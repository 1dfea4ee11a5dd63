"""``loss_parallel``: the LM head keeps its logits split over the vocabulary, and the model's loss
is computed on the split logits (never gathering ``[b, s, v]``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from ...distributed.parallel_state import ParallelState
from ..cross_entropy import vocab_parallel_cross_entropy
from .style import Target


def loss_parallel_head(model: torch.nn.Module, targets: list[Target]) -> str | None:
    """The LM head's name when its logits can stay split: the model's output embedding, planned
    ``colwise_gather_output``, on a model that computes its loss through ``loss_function``."""
    get_output = getattr(model, "get_output_embeddings", None)
    out = get_output() if callable(get_output) else None
    if out is None or not hasattr(type(model), "loss_function"):
        return None
    for target in targets:
        if target.param is None and target.module is out and target.style == "colwise_gather_output":
            return target.name
    return None


def vocab_parallel_loss(state: ParallelState) -> Callable[..., torch.Tensor]:
    """transformers' causal-LM loss (labels shifted inside, ``-100`` ignored, ``mean`` or ``sum``
    over ``num_items_in_batch``) on logits split over the vocabulary."""

    def loss(logits, labels, vocab_size: int, num_items_in_batch: Any = None, ignore_index: int = -100,
             shift_labels: torch.Tensor | None = None, **kwargs) -> torch.Tensor:  # fmt: skip
        if shift_labels is None:
            shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        reduction = "sum" if num_items_in_batch is not None else "mean"
        out = vocab_parallel_cross_entropy(
            logits.float(), shift_labels.to(logits.device), ignore_index, reduction, state.tp
        )
        if num_items_in_batch is not None:
            out = out / (
                num_items_in_batch.to(out.device) if torch.is_tensor(num_items_in_batch) else num_items_in_batch
            )
        return out

    return loss
