"""Training utilities shared by the tutorials: LR schedule, metrics/MFU, sharded checkpoints, loop."""

from .checkpoint import CheckpointManager
from .loop import FitOptions, fit, train_step
from .metrics import PEAK_TFLOPS, MetricsWriter, StepRecord, detect_device_kind, peak_tflops
from .schedule import LRSchedule

__all__ = [
    "PEAK_TFLOPS",
    "CheckpointManager",
    "FitOptions",
    "LRSchedule",
    "MetricsWriter",
    "StepRecord",
    "detect_device_kind",
    "fit",
    "peak_tflops",
    "train_step",
]
