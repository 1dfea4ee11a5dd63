"""neuron_ckpt: tensor/sequence-parallel layers, activation recomputation and activation-memory
tools for training large transformers on AWS Trainium (torch-xla) and any torch.distributed
backend."""

from .distributed import (
    destroy_distributed,
    destroy_model_parallel,
    get_parallel_state,
    get_rng_tracker,
    init_distributed,
    initialize_model_parallel,
    model_parallel_manual_seed,
)
from .parallel.hf import apply_tensor_parallel

__version__ = "0.1.0"

__all__ = [
    "apply_tensor_parallel",
    "destroy_distributed",
    "destroy_model_parallel",
    "get_parallel_state",
    "get_rng_tracker",
    "init_distributed",
    "initialize_model_parallel",
    "model_parallel_manual_seed",
]
