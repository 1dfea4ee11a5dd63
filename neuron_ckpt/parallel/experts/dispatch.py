"""What a dispatch gives the experts, and which form of dispatch a model uses."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ...distributed import runtime

FORMS = ("auto", "all_to_all", "all_gather")


class Routed(NamedTuple):
    """The rows this rank's experts compute: ``rows[i]`` through local expert ``experts[i]``,
    its output scaled by ``weights[i]`` (ones in the all-to-all form, whose sender scales)."""

    rows: torch.Tensor  # [R, h]
    experts: torch.Tensor  # [R] int64, in [0, E/ep)
    weights: torch.Tensor  # [R]


@dataclass(frozen=True)
class ExpertDispatch:
    """How tokens reach their experts under expert parallelism (package docstring).

    ``form``: ``"all_to_all"`` (dropless, uneven splits: eager backends), ``"all_gather"``
    (static shapes, a capacity per expert: XLA), or ``"auto"``: all-gather on XLA, all-to-all
    elsewhere. ``capacity_factor`` (all-gather only): each local expert takes at most
    ``ceil(N k / E * capacity_factor)`` of the ``N`` gathered tokens' routes (``k`` per token,
    ``E`` experts), in token order; the rest are dropped and counted. None: every token fits
    (dropless; the experts then run ``E / k`` times the routed rows).
    """

    form: str = "auto"
    capacity_factor: float | None = None

    def __post_init__(self) -> None:
        if self.form not in FORMS:
            raise ValueError(f"ExpertDispatch.form must be one of {FORMS}, got {self.form!r}")
        cf = self.capacity_factor
        if cf is not None and (isinstance(cf, bool) or not isinstance(cf, (int, float)) or not cf > 0):
            raise ValueError(f"ExpertDispatch.capacity_factor must be None (dropless) or a number > 0, got {cf!r}")
        if cf is not None and self.form == "all_to_all":
            raise ValueError("ExpertDispatch.capacity_factor applies to form='all_gather'; 'all_to_all' is dropless")

    def resolved_form(self) -> str:
        """The form this process runs: ``"auto"`` decided by the backend."""
        if self.form != "auto":
            return self.form
        return "all_gather" if runtime.is_xla() else "all_to_all"

    def capacity(self, tokens: int, top_k: int, num_experts: int) -> int:
        """Routes each local expert takes of ``tokens`` gathered tokens (at most ``tokens``: a
        token picks an expert once)."""
        if self.capacity_factor is None:
            return tokens
        return max(1, min(tokens, math.ceil(tokens * top_k / num_experts * self.capacity_factor)))
