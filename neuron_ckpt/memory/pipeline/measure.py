"""What one pipeline rank really holds over a step: the counterpart of :mod:`.stage_budget`.

:func:`measure_rank` runs a rank's step (any callable: torch's ``schedule.step(...)`` on that
rank, or a replay of its order) under :class:`~..live.LiveSavedTensors` and marks the live
saved bytes after each forward of the rank's stage modules. Its two figures are the analytic
model's (with ``PipelineSetup(buffers="none")``: saved tensors only, no runtime buffers):

* ``most_after_forward`` = ``StageBudget.activation_bytes``: the most kept once a forward is done;
* ``peak_bytes`` = ``StageBudget.budget.activation_peak_bytes``: the most at any moment, a
  recompute in a backward included (the reentrant checkpoint's rerun is seen; torch's
  non-reentrant one is not: measure with ``use_reentrant=True``).

A stage module whose forward ends before the loss (torch's ``loss_fn``, applied by the schedule)
is marked before the loss keeps its softmax: pass torch's stages too, marked when each backward
starts (``tests/test_memory_pipeline.py`` measures :class:`neuron_ckpt.pipeline.LlamaPipeline`'s
steps so, over gloo). Parameters (``exclude_modules``) and shared tensors such as a causal mask (``exclude_tensors``)
are left out, as in every measurement of this package.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

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
    stage_modules: Iterable[torch.nn.Module] = (),
    pipeline_stages: Iterable[Any] = (),
    exclude_modules: Iterable[torch.nn.Module] = (),
    exclude_tensors: Iterable[torch.Tensor] = (),
) -> MeasuredRank:
    """Run ``step`` (one rank's whole schedule) and measure it (module docstring). The marks:
    after each forward of ``stage_modules``, and before each ``backward_one_chunk`` of
    ``pipeline_stages`` (torch's ``PipelineStage`` objects: the live bytes when a backward starts
    are the most since the forward before it, its loss included)."""
    most = 0
    with LiveSavedTensors(exclude_modules=exclude_modules, exclude_tensors=exclude_tensors) as live:

        def mark(*_: object) -> None:
            nonlocal most
            most = max(most, live.live_bytes)

        def marking(backward: Callable[..., Any]) -> Callable[..., Any]:
            def run(*args: Any, **kwargs: Any) -> Any:
                mark()
                return backward(*args, **kwargs)

            return run

        handles = [m.register_forward_hook(mark) for m in stage_modules]
        # torch's stages have no hook before a backward: their method is wrapped on the instance
        # for the step, and the class's restored after.
        stages = list(pipeline_stages)
        for stage in stages:
            stage.backward_one_chunk = marking(stage.backward_one_chunk)
        try:
            step()
        finally:
            for handle in handles:
                handle.remove()
            for stage in stages:
                del stage.backward_one_chunk
    return MeasuredRank(live.peak_bytes, most, live.live_bytes)


__all__ = ["MeasuredRank", "measure_rank"]
