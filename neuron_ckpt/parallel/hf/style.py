"""What a plan style is to :func:`apply_tensor_parallel`: a check and an apply, looked up by name.

Each style of a transformers ``tp_plan`` maps to one :class:`Style`. ``check`` runs for every
planned target before anything changes and raises a one-line ``ValueError``; ``apply`` then
makes the change. A new style is one entry in a table (``dense.DENSE_STYLES``,
``experts.EXPERT_STYLES``) that ``plan.STYLES`` joins.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ...distributed.parallel_state import ParallelState
from ..experts.dispatch import ExpertDispatch


@dataclass(frozen=True)
class Target:
    """One plan entry matched in the model."""

    name: str
    """The module's name, or the parameter's full name when the entry names a parameter."""
    module: torch.nn.Module
    """The module, or the parameter's owner."""
    style: str
    param: str | None = None
    """The parameter's attribute name on ``module`` when the entry names a parameter."""

    @property
    def where(self) -> str:
        """How an error names it: ``apply_tensor_parallel: <name> (<style>)``."""
        return f"apply_tensor_parallel: {self.name} ({self.style})"


@dataclass(frozen=True)
class Split:
    """What ``apply`` needs besides its target."""

    model: torch.nn.Module
    state: ParallelState
    loss_head: str | None
    """The LM head whose logits stay split over the vocabulary (``loss_parallel``), if any."""
    expert_dispatch: ExpertDispatch = ExpertDispatch()
    """How tokens reach experts spread over the EP group (``ep_dispatch_experts``)."""


@dataclass(frozen=True)
class Style:
    check: Callable[[torch.nn.Module, Target, int], None]
    """``(model, target, tp_size)``: raise ``ValueError`` if the target cannot take the style."""
    apply: Callable[[Target, Split], None]
    """Change the model in place."""


def no_check(model: torch.nn.Module, target: Target, t: int) -> None:
    """Any module takes the style."""
