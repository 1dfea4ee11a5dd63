"""Activation recomputation: selective and full, exact RNG replay, distributed saved inputs, XLA-safe.

::

    from neuron_ckpt.recompute import RecomputeConfig, apply_recompute, run_layers

    config = RecomputeConfig(granularity="selective")                  # core attention
    config = RecomputeConfig(granularity="full", method="uniform", num_layers=2)
    apply_recompute(model.layers, config, sequence_parallel=sp)        # validates first
    # in the model's forward:
    hidden = run_layers(self.layers, hidden, *extra_args)

The contract for models is in :mod:`.apply`; the checkpoint function itself in :mod:`.checkpoint`.
See docs/recompute.md.
"""

from .apply import DEFAULT_MODULE_MAP, apply_recompute, layer_runner, remove_recompute, run_layers
from .function import checkpoint
from .config import GRANULARITIES, METHODS, MODULES, PRESETS, RecomputeConfig

__all__ = [
    "DEFAULT_MODULE_MAP",
    "GRANULARITIES",
    "METHODS",
    "MODULES",
    "PRESETS",
    "RecomputeConfig",
    "apply_recompute",
    "checkpoint",
    "layer_runner",
    "remove_recompute",
    "run_layers",
]
