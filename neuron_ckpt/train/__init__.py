"""Training utilities shared by the tutorials: LR schedule, metrics/MFU, sharded checkpoints, train state, loop."""

from .checkpoint import CheckpointManager, SaveReport
from .faults import CollectiveTimeoutError, Interrupted, NonFiniteError
from .loop import FitOptions, SavePolicy, fit, train_step
from .metrics import (
    PEAK_TFLOPS,
    MetricsWriter,
    StepRecord,
    detect_device_kind,
    device_peak_bytes,
    peak_tflops,
    read_metrics,
)
from .recipes import RECIPES, Recipe, param_groups
from .schedule import LRSchedule
from .state import TrainState

__all__ = [
    "PEAK_TFLOPS",
    "RECIPES",
    "CheckpointManager",
    "CollectiveTimeoutError",
    "FitOptions",
    "Interrupted",
    "LRSchedule",
    "MetricsWriter",
    "NonFiniteError",
    "Recipe",
    "SavePolicy",
    "SaveReport",
    "StepRecord",
    "TrainState",
    "detect_device_kind",
    "device_peak_bytes",
    "fit",
    "param_groups",
    "peak_tflops",
    "read_metrics",
    "train_step",
]
