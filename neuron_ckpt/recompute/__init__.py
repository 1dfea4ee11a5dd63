"""Activation recomputation: selective and full, exact RNG replay, distributed saved inputs, XLA-safe.

Applied to a model after it is built, with one entry point::

    from neuron_ckpt.recompute import RecomputeConfig, apply_recompute, run_layers

    model = LlamaForCausalLM(config, sequence_parallel=True)
    apply_recompute(model, RecomputeConfig(granularity="selective"))         # validates first
    apply_recompute(model, RecomputeConfig.preset("full"))                   # replaces it
    apply_recompute(model, [None, RecomputeConfig.preset("selective"), ...]) # one entry per layer
    # what a model's forward does (ours always do):
    hidden = run_layers(self.layers, hidden, *extra_args)

The contract for models is in :mod:`.apply`; the activation checkpoint function itself in
:mod:`.activation_checkpoint`. See docs/recompute.md.
"""

from .activation_checkpoint import checkpoint
from .apply import apply_recompute, remove_recompute
from .config import DENSE_MODULES, GRANULARITIES, METHODS, MODULES, PRESETS, RecomputeConfig
from .discard import checkpoint_without_output, discard_outputs
from .module import Recompute, run_layers, unwrapped
from .module_map import DEFAULT_MODULE_MAP

__all__ = [
    "DEFAULT_MODULE_MAP",
    "DENSE_MODULES",
    "GRANULARITIES",
    "METHODS",
    "MODULES",
    "PRESETS",
    "Recompute",
    "RecomputeConfig",
    "apply_recompute",
    "checkpoint",
    "checkpoint_without_output",
    "discard_outputs",
    "remove_recompute",
    "run_layers",
    "unwrapped",
]
