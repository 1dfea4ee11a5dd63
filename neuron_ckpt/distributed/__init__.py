"""Runtime, parallel state, collectives, autograd mappings and RNG streams."""

from .parallel_state import (
    Group,
    ParallelState,
    destroy_model_parallel,
    get_parallel_state,
    initialize_model_parallel,
    model_parallel_is_initialized,
)
from .random import get_rng_tracker, model_parallel_manual_seed
from .runtime import Runtime, detect_backend, get_runtime, init_distributed, is_xla
from .teardown import destroy_distributed

__all__ = [
    "Group",
    "ParallelState",
    "Runtime",
    "destroy_distributed",
    "destroy_model_parallel",
    "detect_backend",
    "get_parallel_state",
    "get_rng_tracker",
    "get_runtime",
    "init_distributed",
    "initialize_model_parallel",
    "is_xla",
    "model_parallel_is_initialized",
    "model_parallel_manual_seed",
]
