"""Activation memory of transformers' mixture-of-experts and latent-attention layers (Mixtral,
Qwen3-MoE, Qwen2-MoE, DeepSeek-V3 as transformers 5.24 runs them), storage by storage, under
every recompute module; measured to the byte by :mod:`.measure`.

::

    from neuron_ckpt.memory.moe import MoESetup, layer_memory, load_moe_config

    shape = load_moe_config("deepseek-v3")                          # a preset, or a config.json
    setup = MoESetup(seq_len=4096, micro_batch=1, tp=8)             # bf16, sdpa, grouped_mm
    layer_memory(shape, setup, "moe_act", kind="moe").nbytes        # one MoE layer, one rank
    sp = MoESetup(seq_len=4096, tp=8, sequence_parallel=True)       # the norms at s/t tokens

:mod:`.shape` holds the sizes and the job, :mod:`.attention` and :mod:`.experts` the storages of
each part, :mod:`.rules` the one rule that turns them into what a recompute choice keeps,
:mod:`.layer` a whole layer and the recompute choices, :mod:`.sequence` what sequence parallel
changes, :mod:`.config` the strict reading of a
config.json, :mod:`.measure` the real transformers layers counted by ``SavedTensorRecorder``,
:mod:`.report` the ``neuron-ckpt memory --config`` output.
"""

from .config import PRESET_NAMES, load_moe_config, moe_shape_from_dict
from .layer import CHOICES, MODULES, LayerMemory, layer_memory, model_bytes, module_table
from .shape import MLA, MoESetup, MoEShape

__all__ = [
    "CHOICES", "MLA", "MODULES", "PRESET_NAMES", "LayerMemory", "MoESetup", "MoEShape", "layer_memory",
    "load_moe_config", "model_bytes", "module_table", "moe_shape_from_dict",
]  # fmt: skip
