"""Hyperparameter recipes: named sets of training options, and the weight-decay rule each uses.

``default`` follows the Llama-2 paper (cosine to 10 %, AdamW beta2 0.95, weight decay 0.1) with a
shuffled, resumable data order. ``nxd`` is AWS NeuronX Distributed's Llama TP + ZeRO-1 tutorial
(``tp_zero1_llama_hf_pretrain.py``), so a loss curve can be laid over NxD's:
``get_linear_schedule_with_warmup`` (rate 0 on the first step, linear to 0 at the last), AdamW
(0.9, 0.999), eps 1e-6, weight decay 0.01 but none on parameters named ``*bias*`` / ``*norm*``,
seed 12349, and the blocks in file order (``DistributedSampler(shuffle=False)``).

``settings`` are option values (the tutorial's ``TrainConfig`` field names); an option given
explicitly wins over them. ``warmup_from_zero`` and ``no_decay`` have no option of their own:
they are what the recipe's name means. docs/recipes.md has the table and the reasons.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

NO_DECAY_RULES = ("1d", "bias_norm_names")


@dataclass(frozen=True)
class Recipe:
    name: str
    settings: dict[str, Any] = field(default_factory=dict)
    """Option values used where the command line gives none."""
    warmup_from_zero: bool = False
    """The schedule's first step runs at rate 0 (:class:`~.schedule.LRSchedule`)."""
    no_decay: str = "1d"
    """Parameters without weight decay: ``"1d"`` (norm weights, biases: every parameter of
    one dimension, as Llama and Megatron) or ``"bias_norm_names"`` (names containing "bias" or
    "norm", as NxD; for Llama the same set)."""

    def __post_init__(self) -> None:
        if self.no_decay not in NO_DECAY_RULES:
            raise ValueError(f"no_decay must be one of {NO_DECAY_RULES}, got {self.no_decay!r}")


RECIPES: dict[str, Recipe] = {
    "default": Recipe(
        "default",
        {"decay": "cosine", "min_lr_ratio": 0.1, "weight_decay": 0.1, "beta2": 0.95, "adam_eps": 1e-8,
         "seed": 1234, "data_order": "shuffled"},
    ),
    "nxd": Recipe(
        "nxd",
        {"decay": "linear", "min_lr_ratio": 0.0, "weight_decay": 0.01, "beta2": 0.999, "adam_eps": 1e-6,
         "seed": 12349, "data_order": "sequential"},
        warmup_from_zero=True,
        no_decay="bias_norm_names",
    ),
}  # fmt: skip


def decays(name: str, param: torch.Tensor, rule: str) -> bool:
    """Whether weight decay applies to the parameter ``name`` under ``rule`` (NO_DECAY_RULES)."""
    if rule == "bias_norm_names":
        return "bias" not in name and "norm" not in name
    if rule == "1d":
        return param.dim() > 1
    raise ValueError(f"rule must be one of {NO_DECAY_RULES}, got {rule!r}")


def param_groups(model: torch.nn.Module, weight_decay: float, rule: str = "1d") -> list[dict]:
    """Two AdamW groups: decayed parameters with ``weight_decay``, the others with 0."""
    named = list(model.named_parameters())
    decay = [p for n, p in named if decays(n, p, rule)]
    no_decay = [p for n, p in named if not decays(n, p, rule)]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
