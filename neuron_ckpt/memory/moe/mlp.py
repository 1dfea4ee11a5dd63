"""The dense MLP of a transformers layer and the shared experts of an MoE block, storage by
storage (transformers 5.24, torch 2.13 on CPU).

``down(act(gate(x)) * up(x))`` keeps gate's output (the activation: silu, or Gemma2's tanh GeLU,
keeps its input), ``act(gate)`` and up's output (the multiply) and the product (down); x is the
norm's output. Phi-3's fused ``gate_up_proj`` keeps one ``[T, 2F]`` output that the activation
and the multiply read through views. Qwen2-MoE's shared expert is gated:
``sigmoid(Linear(h, 1)(x)) * shared(x)`` keeps x, the sigmoid's output and the shared output.

Under TP a splitting plan gives each rank ``F/t`` of all of it; Phi-3's gathering plan runs the
MLP whole on every rank and ``down_proj`` keeps a ``1/t`` slice of the product instead.
"""

from __future__ import annotations

from .families import FAMILY
from .rules import LayerTensors
from .shape import MoESetup, MoEShape


def swiglu(layer: LayerTensors, place: str, x: str, ffn: int, setup: MoESetup, split: bool) -> None:
    """transformers' MLP ``down(act(gate(x)) * up(x))`` at ``place``, ``ffn`` wide on this rank."""
    T, w = setup.tokens, setup.width
    layer.keep(x, f"{place}.up")
    layer.save(f"{place}.gate_proj.out", w * T * ffn, split, f"{place}.silu")
    layer.save(f"{place}.act", w * T * ffn, split, f"{place}.mul")
    layer.save(f"{place}.up_proj.out", w * T * ffn, split, f"{place}.mul")
    layer.save(f"{place}.product", w * T * ffn, split, f"{place}.down")


def dense_mlp(layer: LayerTensors, shape: MoEShape, setup: MoESetup, x: str) -> None:
    """The dense layers' MLP, and its ``mlp`` and ``mlp_act`` (the activation's output) units."""
    family, T, w, tp = FAMILY[shape.family], setup.tokens, setup.width, setup.tp
    t = shape.split("mlp", tp)
    if family.mlp == "separate":
        swiglu(layer, "mlp", x, shape.dense_ffn // t, setup, t > 1)
        gate = "mlp.gate_proj.out"
    else:  # Phi-3: gate_up_proj's output, read by the activation and the multiply through views
        F = shape.dense_ffn
        layer.keep(x, "mlp.up")
        gate = layer.save("mlp.gate_up_proj.out", w * T * 2 * F, False, "mlp.silu", "mlp.mul")
        layer.save("mlp.act", w * T * F, False, "mlp.mul")
        if family.split["mlp"] == "gathered" and tp > 1:  # down_proj keeps its 1/t slice of the product
            layer.save("mlp.product", w * T * F, False)
            layer.save("mlp.down.input_slice", w * T * F // tp, True, "mlp.down")
        else:
            layer.save("mlp.product", w * T * F, False, "mlp.down")
    layer.unit("mlp", ["mlp"], [x])
    layer.unit("mlp_act", ["mlp.silu"], [gate], discards=["mlp.act"])


def shared_experts(layer: LayerTensors, shape: MoEShape, setup: MoESetup, x: str) -> None:
    """The shared experts (Qwen2's gated shared expert) and the ``shared_experts`` unit."""
    t = shape.split("shared", setup.tp)
    swiglu(layer, "mlp.shared", x, shape.shared_ffn // t, setup, t > 1)
    layer.unit("shared_experts", ["mlp.shared"], [x])
    if FAMILY[shape.family].shared == "gated":
        T, w = setup.tokens, setup.width
        layer.keep(x, "mlp.shared_gate")
        layer.save("shared_gate.sigmoid", w * T, False, "mlp.shared_gate")
        layer.save("shared_expert.out", w * T * shape.hidden, False, "mlp.shared_gate")


__all__ = ["dense_mlp", "shared_experts", "swiglu"]
