"""Learning-rate schedule: linear warmup, then cosine or linear decay to a floor.

With ``warmup_from_zero``, ``decay="linear"`` and ``min_lr_ratio=0`` it is transformers'
``get_linear_schedule_with_warmup`` (NxD's Llama tutorial), float for float: ``lr(k)`` is the
rate that schedule gives the (k+1)-th ``optimizer.step()``, 0 for the first.

A pure function of the step, so a resumed run needs no scheduler state: the checkpoint's step
is enough. ``apply`` writes the rate into every param group of any torch optimizer (including
``Zero1Optimizer``, whose ``param_groups`` are its inner optimizer's).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DECAYS = ("cosine", "linear", "constant")


@dataclass(frozen=True)
class LRSchedule:
    """``lr(step)`` for ``step = 0, 1, ...`` (the step about to be taken)."""

    peak_lr: float
    """Rate reached at the end of warmup."""
    warmup_steps: int
    """Steps of linear increase from ``peak_lr / warmup_steps`` (step 0) to ``peak_lr``
    (from 0 with ``warmup_from_zero``)."""
    total_steps: int
    """Step at which decay reaches ``min_lr`` (the run's length)."""
    decay: str = "cosine"
    """``"cosine"``, ``"linear"`` or ``"constant"`` after warmup."""
    min_lr_ratio: float = 0.1
    """Floor as a fraction of ``peak_lr`` (Llama-2 used 0.1)."""
    warmup_from_zero: bool = False
    """``lr(k) = peak_lr * k / warmup_steps``: 0 at step 0, as transformers' schedules (and so NxD)
    do. False: ``peak_lr * (k + 1) / warmup_steps``, so no step is spent at rate 0."""

    def __post_init__(self) -> None:
        if not self.peak_lr > 0:
            raise ValueError(f"peak_lr must be > 0, got {self.peak_lr}")
        if self.warmup_steps < 0 or self.total_steps < 1:
            raise ValueError(
                f"need warmup_steps >= 0 and total_steps >= 1, got {self.warmup_steps}, {self.total_steps}"
            )
        if self.decay not in DECAYS:
            raise ValueError(f"decay must be one of {DECAYS}, got {self.decay!r}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")

    def lr(self, step: int) -> float:
        if step < self.warmup_steps:
            if self.warmup_from_zero:
                return self.peak_lr * (step / self.warmup_steps)  # transformers' float order
            return self.peak_lr * (step + 1) / self.warmup_steps
        if self.decay == "constant":
            return self.peak_lr
        span = max(self.total_steps - self.warmup_steps, 1)
        done = min(max(step - self.warmup_steps, 0), span)
        if self.decay == "cosine":
            shape = 0.5 * (1.0 + math.cos(math.pi * (done / span)))
        else:
            shape = (span - done) / span  # = (total - step) / span: exact, as transformers computes it
        floor = self.min_lr_ratio * self.peak_lr
        return floor + (self.peak_lr - floor) * shape

    def apply(self, optimizer, step: int) -> float:
        """Set the rate for ``step`` on every param group; returns it."""
        lr = self.lr(step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        return lr
