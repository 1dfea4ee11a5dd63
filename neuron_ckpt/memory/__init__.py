"""Activation memory: see it, measure it, budget a whole job, plan recompute to fit.

::

    from neuron_ckpt.memory import ModelShape, TrainingSetup, layer_activation_bytes, plan_recompute
    from neuron_ckpt.models.config_file import load_llama_config

    model = ModelShape.from_llama(load_llama_config("llama2-7b"))   # or ModelShape.gpt(h, a, L)
    setup = TrainingSetup(seq_len=4096, micro_batch=1, tp=8, dp=4)  # bf16, SP, ZeRO-1, explicit attention
    # TrainingSetup(..., attention="flash"): a fused kernel, no s x s tensor (what the reference runs)
    layer_activation_bytes(model, setup, "selective")               # one layer, one rank
    # any RecomputeConfig: RecomputeConfig("selective", modules=["mlp", "norm"]), grouped full ...
    plan = plan_recompute(model, setup, "trn1")                      # per-layer presets that fit

:mod:`.shape` describes the model and the job; :mod:`.analytic` counts one layer's activations
tensor by tensor (Korthikanti et al. 2022 for GPT, its Llama equivalent; :mod:`.terms`) and the
peak of a stack; :mod:`.measure` counts what autograd really keeps (:mod:`.live`: its peak over
forward and backward); :mod:`.budget` adds up a device's memory, :mod:`.rerun` prices what a
recompute reruns in FLOPs (equal to torch's count: :mod:`.flop_count`) and :mod:`.planner` picks
the recompute. ``neuron-ckpt memory`` / ``plan`` are :mod:`.report` and
:mod:`.plan_cli`; ``neuron-ckpt compare`` (:mod:`.compare_cli`) puts the model next to what a device
or a compiler reports (:mod:`.readers`, by difference: :mod:`.compare`). :mod:`.pipeline` does the
budget and the plan per pipeline stage, over a schedule's order. See docs/memory.md and
docs/planner.md.
"""

from .analytic import (
    ActivationTerm,
    layer_activation_bytes,
    layer_activation_terms,
    model_activation_bytes,
    model_activation_peak_bytes,
)  # fmt: skip
from .budget import MemoryBudget, memory_budget
from .live import LiveSavedTensors
from .measure import SavedTensorRecorder
from .offload_time import HostLink
from .options import LayerOption, layer_options
from .planner import Choices, NothingFits, Plan, plan_activations, plan_recompute
from .shape import ModelShape, TrainingSetup

__all__ = [
    "ActivationTerm",
    "Choices",
    "HostLink",
    "LayerOption",
    "LiveSavedTensors",
    "MemoryBudget",
    "ModelShape",
    "NothingFits",
    "Plan",
    "SavedTensorRecorder",
    "TrainingSetup",
    "layer_activation_bytes",
    "layer_activation_terms",
    "layer_options",
    "memory_budget",
    "model_activation_bytes",
    "model_activation_peak_bytes",
    "plan_activations",
    "plan_recompute",
]
