"""What one pipeline rank really holds over a step: the counterpart of :mod:`.stage_budget`.

:func:`measure_rank` runs a rank's step (any callable: torch's ``schedule.step(...)`` on that
rank, or a replay of its order) under :class:`~..live.LiveSavedTensors` and marks the live
saved bytes after each forward of the rank's stage modules. Its two figures are the analytic
model's (with ``PipelineSetup(buffers="none")``: saved tensors only, no runtime buffers):

* ``most_after_forward`` = ``StageBudget.activation_bytes``: the most kept once a forward is done;
* ``peak_bytes`` = ``StageBudget.budget.activation_peak_bytes``: the most at any moment, a
  recompute in a backward included (the reentrant checkpoint's rerun is seen; torch's
  non-reentrant one is not: measure with ``use_reentrant=True``).

A stage module whose forward ends before the loss (torch's ``loss_fn`` applied by the schedule)
is marked before the loss keeps its softmax: give the last stage a module that returns the loss.
Parameters (``exclude_modules``) and shared tensors such as a causal mask (``exclude_tensors``)
are left out, as in every measurement of this package.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from ..live import LiveSavedTensors


@dataclass(frozen=True)
class MeasuredRank:
    """``peak_bytes``: the most saved bytes alive over the step; ``most_after_forward``: the most
    alive right after a stage module's forward; ``after_step``: still alive once the step is done
    (0 unless something outlives its backward)."""

    peak_bytes: int
    most_after_forward: int
    after_step: int


def measure_rank(
    step: Callable[[], None],
    stage_modules: Iterable[torch.nn.Module],
    exclude_modules: Iterable[torch.nn.Module] = (),
    exclude_tensors: Iterable[torch.Tensor] = (),
) -> MeasuredRank:
    """Run ``step`` (one rank's whole schedule) and measure it (module docstring)."""
    most = 0
    with LiveSavedTensors(exclude_modules=exclude_modules, exclude_tensors=exclude_tensors) as live:

        def mark(module: torch.nn.Module, args: object, output: object) -> None:
            nonlocal most
            most = max(most, live.live_bytes)

        handles = [m.register_forward_hook(mark) for m in stage_modules]
        try:
            step()
        finally:
            for handle in handles:
                handle.remove()
    return MeasuredRank(live.peak_bytes, most, live.live_bytes)


__all__ = ["MeasuredRank", "measure_rank"]
