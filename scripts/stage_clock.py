"""A time budget for a run of stages (``device_report.py``): start a stage only while the time it
is expected to need is left, record what was skipped and what failed, and go on with the rest.

A device is lent for minutes; a stage that fails (out of memory, a compiler error) or would
overrun the budget must not cost the figures the other stages measure. A stage that started
runs to its end (a compile cannot be cut short safely), so each stage's expected seconds are
what keeps the whole run inside the budget; loops inside a stage ask :meth:`StageClock.passed`.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable


class StageClock:
    """budget_s: seconds from construction after which nothing new starts. need_scale: multiplies
    every stage's expected seconds (0: start every stage while any time is left)."""

    def __init__(self, budget_s: float, need_scale: float = 1.0):
        if not budget_s >= 0 or not need_scale >= 0:
            raise ValueError(f"budget_s and need_scale must be >= 0, got {budget_s!r}, {need_scale!r}")
        self.budget_s, self.need_scale = budget_s, need_scale
        self.start = time.monotonic()
        self.skipped: list[str] = []
        self.errors: list[str] = []

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def left(self) -> float:
        return self.budget_s - self.elapsed()

    def passed(self) -> bool:
        return self.left() <= 0

    def skip(self, what: str) -> None:
        self.skipped.append(what)
        print(f"[{self.elapsed():5.0f} s] skipped: {what}", flush=True)

    def run(self, name: str, need_s: float, stage: Callable[[], object]) -> None:
        """Run ``stage`` if ``need_s`` (scaled) is left, else record it as skipped; an exception
        it raises is recorded (type and first line) with its traceback printed, not raised."""
        left = self.left()
        if left <= 0 or left < need_s * self.need_scale:
            need = f", it needs about {need_s * self.need_scale:.0f} s" if need_s * self.need_scale else ""
            self.skip(f"{name} ({max(left, 0):.0f} s of the {self.budget_s:.0f} s budget left{need})")
            return
        print(f"[{self.elapsed():5.0f} s] {name}", flush=True)
        try:
            stage()
        except Exception as exc:  # noqa: BLE001  any failure of one stage: the others' figures still count
            traceback.print_exc()
            first = (str(exc).strip().splitlines() or [""])[0][:300]
            self.errors.append(f"{name}: {type(exc).__name__}: {first}")


__all__ = ["StageClock"]
