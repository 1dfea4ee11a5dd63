"""Everything a resumed run needs, behind one ``state_dict()`` / ``load_state_dict()``.

:class:`TrainState` gathers the model, the optimizer (``Zero1Optimizer``: this rank's slices),
the batch order (``DataParallelBatches``) and every RNG stream: the default stream (the CPU
generator and the device's, CUDA or XLA, through :func:`neuron_ckpt.distributed.random.get_rng_state`)
and the tensor-parallel tracker's named streams, and under pipeline parallelism each stage's own
streams (:class:`~neuron_ckpt.pipeline.StageRNG`, saved by every rank for its stages). Restoring
all of them is what makes a resumed run continue bit-identically
(``tests/test_train.py::test_resume_continues_exactly``, ``tests/test_pipeline_train.py``).

With a :class:`~neuron_ckpt.train.CheckpointManager` the ``"model"`` entry is written once per
(pipeline stage and) TP rank (by DP rank 0) and the rest per rank; :meth:`TrainState.resume` reads it back in the
manager's writer rounds. Under expert parallelism the model's experts (parameters tagged
``expert_parallel``, different on every EP rank) leave ``"model"`` for an ``"experts"`` entry,
written once per EP rank (by expert-DP rank 0).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..distributed import runtime
from ..distributed.random import RNGStatesTracker, get_rng_state, get_rng_tracker, set_rng_state
from ..parallel.params import is_expert_parallel
from .checkpoint import CheckpointManager

KEYS = ("model", "optimizer", "data", "rng")


class TrainState:
    """``model``, ``optimizer``, ``batches`` (anything with ``state_dict``/``load_state_dict``;
    ``batches`` may be None) and the RNG streams of this process, saved and restored together;
    ``step`` is the number of optimizer steps done (0, or the resumed checkpoint's)."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        batches: Any = None,
        rng_tracker: RNGStatesTracker | None = None,
    ):
        self.model, self.optimizer, self.batches = model, optimizer, batches
        self.rng_tracker = rng_tracker if rng_tracker is not None else get_rng_tracker()
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        """``{"model", "optimizer", "data", "rng": {"default", "tracker"}}``; tensors are
        references (device tensors included): save them before the next step. A model with
        streams of its own (``rng_state_dict()``: a ``LlamaPipeline``'s per-stage dropout
        streams) adds them as ``rng["model"]``."""
        rng = {"default": get_rng_state(), "tracker": self.rng_tracker.get_states()}
        if hasattr(self.model, "rng_state_dict"):
            rng["model"] = self.model.rng_state_dict()  # type: ignore[operator]  # torch types a module's attributes as Tensor | Module
        model = self.model.state_dict()
        experts = {k: model.pop(k) for k in _expert_names(self.model)}
        return {
            "model": model,
            **({"experts": experts} if experts else {}),
            "optimizer": self.optimizer.state_dict(),
            "data": self.batches.state_dict() if self.batches is not None else None,
            "rng": rng,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (tensors on the CPU are fine).

        On XLA the copies into the device tensors run here, as one graph, so the host copies can
        be freed at once; the step graphs that follow are the same as without a resume.
        """
        missing = [k for k in KEYS if k not in state]
        if missing:
            raise ValueError(f"TrainState.load_state_dict: no {missing} in the state (keys: {sorted(state)})")
        if (state["data"] is None) != (self.batches is None):
            raise ValueError(
                "TrainState.load_state_dict: the state and this TrainState disagree on having a batch order"
            )
        if bool(_expert_names(self.model)) != ("experts" in state):
            raise ValueError(
                "TrainState.load_state_dict: the state and this model disagree on having experts spread over an "
                "expert-parallel group (an 'experts' entry): resume at the expert_model_parallel_size it was saved at"
            )
        self.model.load_state_dict({**state["model"], **state.get("experts", {})})
        self.optimizer.load_state_dict(state["optimizer"])
        if self.batches is not None:
            self.batches.load_state_dict(state["data"])
        set_rng_state(state["rng"]["default"])
        self.rng_tracker.set_states(state["rng"]["tracker"])
        if hasattr(self.model, "load_rng_state_dict"):
            self.model.load_rng_state_dict(state["rng"]["model"])  # type: ignore[operator]  # torch types a module's attributes as Tensor | Module
        runtime.step_boundary(wait=True)

    def save(self, manager: CheckpointManager, meta: dict[str, Any]) -> Path:
        """A collective: checkpoint this state as step ``self.step`` (``meta`` goes to meta.json)."""
        return manager.save(self.step, self.state_dict(), meta)

    def resume(
        self, manager: CheckpointManager, which: str, expect: dict[str, Any]
    ) -> tuple[Path, dict[str, Any]] | None:
        """A collective: load checkpoint ``which`` (``"latest"`` or a path) into this state.

        Returns ``(path, meta)`` and sets ``step`` to ``meta["step"]`` (the steps done), or None
        when ``"latest"`` finds no checkpoint yet. ``expect``: meta fields that must match (the layout).
        """
        path = manager.resolve(which)
        if path is None:
            return None
        # XLA: run what is pending (building the model and optimizer, which may hold collectives)
        # on every rank now, so that each reader round's graph holds only its own local copies.
        runtime.step_boundary(wait=True)
        meta = manager.restore(path, expect, self.load_state_dict)
        self.step = meta["step"]
        return path, meta


def _expert_names(model: torch.nn.Module) -> list[str]:
    """The state-dict names of ``model``'s expert-parallel parameters (this EP rank's experts)."""
    return [n for n, p in model.named_parameters() if is_expert_parallel(p)]
