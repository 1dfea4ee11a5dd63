"""The dense MLP of a transformers layer and the shared experts of an MoE block, storage by
storage (transformers 5.24, torch 2.13 on CPU).

``down(act(gate(x)) * up(x))`` keeps gate's output (the activation: silu, or Gemma2's tanh GeLU,
keeps its input), ``act(gate)`` and up's output (the multiply) and the product (down); x is the
norm's output. Phi-3's fused ``gate_up_proj`` keeps one ``[T, 2F]`` output that the activation
and the multiply read through views. Qwen2-MoE's shared expert is gated:
``sigmoid(Linear(h, 1)(x)) * shared(x)`` keeps x, the sigmoid's output and the shared output.

Under TP a splitting plan gives each rank ``F/t`` of all of it; Phi-3's gathering plan runs the
MLP whole on every rank and ``down_proj`` keeps a ``1/t`` slice of the product instead.

**Ops and FLOPs** (:meth:`~.rules.LayerTensors.op`, in forward order): ``up`` (the gate and up
projections: ``2 T h 2F`` matmul FLOPs), ``silu`` (the activation), ``mul``, ``down`` (``2 T F
h``); a gathering plan computes ``1/t`` of the projections on each rank. Qwen2's gate is
``shared_gate`` (its ``Linear(h, 1)`` and sigmoid) and ``shared_gate.mul``, after the routed
experts (:func:`shared_gate`; the shared expert itself runs first).
"""

from __future__ import annotations

from ..rerun import GELU
from .families import FAMILY
from .rules import LayerTensors
from .shape import MoESetup, MoEShape

SILU = 4  # elementwise FLOPs per element: x * sigmoid(x)


def mlp_ops(layer: LayerTensors, place: str, rows: int, hidden: int, ffn: int, act: int = SILU) -> None:
    """The ops of ``down(act(gate(x)) * up(x))`` at ``place`` over ``rows`` tokens, ``ffn`` wide
    (``act``: the activation's FLOPs per element)."""
    layer.op(f"{place}.up", matmul=2 * rows * hidden * 2 * ffn)  # gate_proj and up_proj
    layer.op(f"{place}.silu", elementwise=act * rows * ffn)
    layer.op(f"{place}.mul", elementwise=rows * ffn)
    layer.op(f"{place}.down", matmul=2 * rows * ffn * hidden)


def _act(shape: MoEShape) -> int:
    return GELU if shape.family == "gemma2" else SILU  # Gemma2: tanh GeLU


def swiglu(layer: LayerTensors, place: str, x: str, ffn: int, setup: MoESetup, split: bool, shape: MoEShape) -> None:
    """transformers' MLP ``down(act(gate(x)) * up(x))`` at ``place``, ``ffn`` wide on this rank."""
    T, w = setup.tokens, setup.width
    mlp_ops(layer, place, T, shape.hidden, ffn, _act(shape))
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
        swiglu(layer, "mlp", x, shape.dense_ffn // t, setup, t > 1, shape)
        gate = "mlp.gate_proj.out"
    else:  # Phi-3: gate_up_proj's output, read by the activation and the multiply through views
        F, gathered = shape.dense_ffn, family.split["mlp"] == "gathered" and tp > 1
        layer.op("mlp.up", matmul=2 * T * shape.hidden * 2 * F // (tp if gathered else 1))  # 1/t of the columns
        layer.op("mlp.silu", elementwise=SILU * T * F)
        layer.op("mlp.mul", elementwise=T * F)
        layer.op("mlp.down", matmul=2 * T * F * shape.hidden // (tp if gathered else 1))  # 1/t of the rows
        layer.keep(x, "mlp.up")
        gate = layer.save("mlp.gate_up_proj.out", w * T * 2 * F, False, "mlp.silu", "mlp.mul")
        layer.save("mlp.act", w * T * F, False, "mlp.mul")
        if gathered:  # down_proj keeps its 1/t slice of the product
            layer.save("mlp.product", w * T * F, False)
            layer.save("mlp.down.input_slice", w * T * F // tp, True, "mlp.down")
        else:
            layer.save("mlp.product", w * T * F, False, "mlp.down")
    layer.unit("mlp", ["mlp"], [x])
    layer.unit("mlp_act", ["mlp.silu"], [gate], discards=["mlp.act"])


def shared_experts(layer: LayerTensors, shape: MoEShape, setup: MoESetup, x: str) -> None:
    """The shared experts (Qwen2's shared expert, whose gate is :func:`shared_gate`) and the
    ``shared_experts`` unit."""
    t = shape.split("shared", setup.tp)
    swiglu(layer, "mlp.shared", x, shape.shared_ffn // t, setup, t > 1, shape)
    layer.unit("shared_experts", ["mlp.shared"], [x])


def shared_gate(layer: LayerTensors, shape: MoEShape, setup: MoESetup, x: str) -> None:
    """Qwen2's gate on its shared expert, after the routed experts: ``sigmoid(Linear(h, 1)(x)) *
    shared(x)``; the product keeps both factors."""
    T, w = setup.tokens, setup.width
    layer.op("mlp.shared_gate", matmul=2 * T * shape.hidden, elementwise=SILU * T)  # the linear and the sigmoid
    layer.op("mlp.shared_gate.mul", elementwise=T * shape.hidden)
    layer.keep(x, "mlp.shared_gate")
    layer.save("shared_gate.sigmoid", w * T, False, "mlp.shared_gate.mul")
    layer.save("shared_expert.out", w * T * shape.hidden, False, "mlp.shared_gate.mul")


__all__ = ["SILU", "dense_mlp", "mlp_ops", "shared_experts", "shared_gate", "swiglu"]
