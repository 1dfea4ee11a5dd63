"""Training utilities shared by the tutorials: LR schedule, metrics/MFU, sharded checkpoints, train state, loop."""

from .checkpoint import CheckpointManager, SaveReport
from .faults import CollectiveTimeoutError, Interrupted, NonFiniteError
from .loop import FitOptions, fit, train_step
from .metrics import PEAK_TFLOPS, MetricsWriter, StepRecord, detect_device_kind, peak_tflops
from .schedule import LRSchedule
from .state import TrainState

__all__ = [
    "PEAK_TFLOPS",
    "CheckpointManager",
    "CollectiveTimeoutError",
    "FitOptions",
    "Interrupted",
    "LRSchedule",
    "MetricsWriter",
    "NonFiniteError",
    "SaveReport",
    "StepRecord",
    "TrainState",
    "detect_device_kind",
    "fit",
    "peak_tflops",
    "train_step",
]
