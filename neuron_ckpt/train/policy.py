"""When the training loop saves a checkpoint: :class:`SavePolicy`."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SavePolicy:
    """Answers "save now?" after each optimizer step (torchtitan's ``interval`` / ``last_step``).

    The last step of a run is always saved, and so is the step a SIGTERM / SIGINT stopped after:
    a run never ends with its work unsaved when it has somewhere to save it.
    """

    every: int = 0
    """Also save every ``every`` steps (0: only at the end and on a stop)."""

    def __post_init__(self) -> None:
        if not (isinstance(self.every, int) and not isinstance(self.every, bool) and self.every >= 0):
            raise ValueError(f"SavePolicy.every must be an int >= 0 (0: only at the end), got {self.every!r}")

    def save_now(self, step: int, last: bool, stopping: bool) -> bool:
        """``step``: optimizer steps done; ``last``: the run's final step; ``stopping``: every rank
        agreed to stop after this step (a signal)."""
        return last or stopping or (self.every > 0 and step % self.every == 0)
