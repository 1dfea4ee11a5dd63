"""One layer's recompute options, priced: bytes kept, bytes alive again in backward, FLOPs rerun.

Each option is a recompute preset (:data:`~neuron_ckpt.recompute.PRESETS`) the model supports
(:func:`~.analytic.supported_presets`) and the attention makes worth running
(:func:`offered_presets`: with flash attention, not the selective ones). Its bytes come from the analytic model; its FLOPs count
the forward work that backward reruns, against the step's model FLOPs (:func:`step_flops`, the
MFU convention of :meth:`~.shape.ModelShape.flops_per_token`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..recompute import PRESETS, RecomputeConfig
from .analytic import layer_activation_bytes, supported_presets
from .shape import ModelShape, TrainingSetup

# Elementwise FLOPs per element, for the recompute cost: softmax (scale, mask, max, exp, sum,
# divide, roughly 5), SiLU times up (x * sigmoid(x) * up, 5), GeLU (tanh form, 8).
SOFTMAX_FLOPS, SWIGLU_FLOPS, GELU_FLOPS = 5, 5, 8


@dataclass(frozen=True)
class LayerOption:
    """One way to run one layer.

    name: a preset: "none", "selective" (core attention), "selective+mlp_act" (also SwiGLU's
        activation; Llama only) or "full".
    recompute: the per-layer :class:`RecomputeConfig` (``RecomputeConfig.preset(name)``).
    saved_bytes: activations the layer keeps for backward, per micro-batch, on one device.
    rematerialized_bytes: recomputed activations alive again while the layer's backward runs.
    recompute_flops: forward FLOPs rerun in backward, per micro-batch, on one device.
    """

    name: str
    recompute: RecomputeConfig
    saved_bytes: int
    rematerialized_bytes: int
    recompute_flops: float


def _flops(model: ModelShape, setup: TrainingSetup) -> dict[str, float]:
    """Forward FLOPs of one layer's parts on one rank, per micro-batch."""
    s, b, t, h = setup.seq_len, setup.micro_batch, setup.tp, model.hidden
    a_loc, g_loc = model.local_heads(t), model.local_kv_heads(t)
    d = model.head_dim
    scores = a_loc * s * s * b
    # QK^T and probs @ V over the whole s x s square (explicit attention computes all of it).
    core = 4.0 * scores * d + SOFTMAX_FLOPS * scores
    if model.kind == "llama":
        act = SWIGLU_FLOPS * s * b * model.ffn / t
        matmuls = 2.0 * s * b * h * ((2 * a_loc + 2 * g_loc) * d + 3 * model.ffn / t)
    else:
        act = GELU_FLOPS * s * b * model.ffn / t
        matmuls = 2.0 * s * b * 12 * h * h / t
    return {"core": core, "act": act, "layer": matmuls + core + act}


def offered_presets(model: ModelShape, setup: TrainingSetup) -> tuple[str, ...]:
    """The presets worth planning with: with flash attention, none that recomputes the core
    attention. The kernel keeps no ``s^2`` tensor, so recomputing it would rerun the attention
    forward to drop only its fp32 logsumexp (:func:`selective_saving_with_flash`); NeMo
    hard-enables it for the same reason, and NxD's selective checkpoint skips the flash path."""
    names = supported_presets(model)
    if setup.attention == "flash":
        names = tuple(n for n in names if RecomputeConfig.preset(n).granularity != "selective")
    return names


def selective_saving_with_flash(model: ModelShape, setup: TrainingSetup) -> int:
    """Bytes per layer that selective recompute would save with flash attention (the logsumexp)."""
    flash = replace(setup, attention="flash")
    return layer_activation_bytes(model, flash, "none") - layer_activation_bytes(model, flash, "selective")


def layer_options(model: ModelShape, setup: TrainingSetup) -> dict[str, LayerOption]:
    """The recompute options for one layer of ``model`` run as ``setup`` says, by preset name
    (those :func:`offered_presets` lists)."""
    if (why := model.valid_tp(setup.tp, setup.seq_len if setup.sequence_parallel else None)) is not None:
        raise ValueError(why)
    flops = _flops(model, setup)
    costs = {"none": 0.0, "selective": flops["core"], "selective+mlp_act": flops["core"] + flops["act"],
             "full": flops["layer"]}
    names = offered_presets(model, setup)
    kept = {name: layer_activation_bytes(model, setup, name) for name in names}
    options = {}
    for name in names:
        # Full recompute reruns the whole layer: everything "none" keeps is alive again in backward.
        again = kept["none"] if name == "full" else kept["none"] - kept[name]
        options[name] = LayerOption(name, RecomputeConfig.preset(name), kept[name], again, costs[name])
    return options


def canonical_order(counts: dict[str, int]) -> tuple[str, ...]:
    """Layer order that keeps the backward peak lowest for these counts: the layers with the most
    to rematerialize first (full, selective+mlp_act, selective), no recompute last."""
    return tuple(name for name in reversed(PRESETS) for _ in range(counts.get(name, 0)))


def step_flops(model: ModelShape, setup: TrainingSetup) -> float:
    """Model FLOPs of one micro-batch's forward + backward on one device: ``flops_per_token``
    (``6N + 12LHQT``) over the ``s*b/t`` tokens per rank."""
    s = setup.seq_len
    return model.flops_per_token(s) * s * setup.micro_batch / setup.tp


__all__ = ["LayerOption", "canonical_order", "layer_options", "offered_presets", "selective_saving_with_flash",
           "step_flops"]
