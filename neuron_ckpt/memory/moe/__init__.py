"""Activation memory of transformers' decoder layers, storage by storage, under every recompute
module, for every family ``apply_tensor_parallel`` splits (:mod:`.families`: Llama, Mistral,
Qwen2/3, Gemma2, Phi-3 and the mixture-of-experts / latent-attention ones, Mixtral, Qwen2/3-MoE,
OLMoE, DeepSeek-V2/V3, GPT-OSS, Aria, Llama 4, as transformers 5.24 runs them); measured to the
byte by :mod:`.measure`. (The package's name is its first families'.)

::

    from neuron_ckpt.memory.moe import MoESetup, layer_memory, load_moe_config

    shape = load_moe_config("deepseek-v3")                          # a preset, or any config.json
    setup = MoESetup(seq_len=4096, micro_batch=1, tp=8)             # bf16, sdpa, grouped_mm
    layer_memory(shape, setup, "moe_act", kind="moe").nbytes        # one MoE layer, one rank
    sp = MoESetup(seq_len=4096, tp=8, sequence_parallel=True)       # the norms at s/t tokens

:mod:`.families` says what sets each family apart and how its plan splits it, :mod:`.shape` holds
the sizes and the job, :mod:`.norms`, :mod:`.attention`, :mod:`.mla`, :mod:`.routers`,
:mod:`.experts` and :mod:`.mlp` the storages of each part, :mod:`.rules` the one rule that turns
them into what a recompute choice keeps, :mod:`.layer` a whole layer and the recompute choices,
:mod:`.sequence` what sequence parallel changes, :mod:`.config` the reading of a config.json
(through :mod:`.from_config`; :mod:`.hf_config` writes one back), :mod:`.measure` the real
transformers layers counted by ``SavedTensorRecorder`` (:mod:`.compare` every choice, on any
number of ranks), :mod:`.report` the ``neuron-ckpt memory --config`` output.

The whole job (``neuron-ckpt plan --config``, :mod:`.plan_cli`): :class:`~.model.TransformersModel`
is what :func:`~neuron_ckpt.memory.plan_recompute` and :func:`~neuron_ckpt.memory.memory_budget`
take for a transformers model, from :mod:`.params` (the parameters a rank holds), :mod:`.outside`
(the embedding, rotary tables, final norm, head and loss) and :mod:`.choices` (each layer kind's
recompute options); :mod:`.stages` plans pipeline stages.
"""

from .config import PRESET_NAMES, load_moe_config, moe_shape_from_dict
from .families import FAMILIES, FAMILY, Family
from .layer import CHOICES, MODULES, LayerMemory, layer_memory, model_bytes, module_table
from .model import Stage, TransformersModel
from .shape import MLA, MoESetup, MoEShape

__all__ = [
    "CHOICES", "FAMILIES", "FAMILY", "MLA", "MODULES", "PRESET_NAMES", "Family", "LayerMemory", "MoESetup", "MoEShape",
    "Stage", "TransformersModel", "layer_memory", "load_moe_config", "model_bytes", "module_table",
    "moe_shape_from_dict",
]  # fmt: skip
