"""The routed experts of a transformers MoE block, storage by storage (transformers 5.24, torch
2.13 on CPU). T tokens, each sent to k experts: S = T k routed rows, dropless, so every count
below is fixed by T, k and the sizes, never by how the tokens spread over experts.

**grouped_mm** (``integrations/moe.py``): the tokens are sorted by expert; the gathers keep
their int64 indices (``perm // k`` and ``perm``), the two grouped matmuls their inputs (the
gathered ``[S, h]`` rows, the ``[S, F]`` product) and the int32 offsets ``[E]``, the SwiGLU its
``[S, 2F]`` gate/up output (silu and the multiply read views of it) and ``silu(gate)``, the
weighting by the routing weights both of its inputs (``[S, h]``, ``[S]``), and the un-sort its
int64 inverse permutation.

**eager loop** (each expert class's own ``forward``): per expert, ``torch.where`` on the one-hot
mask gives both index vectors in one int64 ``[n, 2]`` storage, kept by the three indexings and
``index_add_``; the gathered rows, gate/up, ``act_fn(gate)``, the product, the gathered routing
weights, the down projection's output (kept by the weighting) and the weighted rows
(``index_add_``'s source) are kept per expert, n rows each, S rows in all. Under ``moe_act`` the
loop runs its SwiGLU through ``_apply_gate`` (:mod:`neuron_ckpt.recompute.experts_loop`: the same
ops), so ``moe_act`` frees ``act(gate)`` and the product on both implementations, as Megatron's.

**GPT-OSS** (``clamped``): the same two paths with biases (grouped_mm's bias gathers keep the
sorted expert ids, int64 ``[S]``) and its ``_apply_gate``: both clamps keep the interleaved
``[S, 2F]`` gate/up, then the clamped gate, ``sigmoid(alpha gate)`` (kept twice), the GLU and
``up + 1`` are kept by the multiplies and the product by the down projection: five ``F`` terms.

**Llama 4** (``all``): every token goes through every expert: the block repeats the input E
times and scales each copy by its sigmoid score (both kept), and its experts' ``bmm`` keep the
scaled ``[E T, h]`` rows, ``[E T, 2F]`` gate/up, ``act(gate)`` and the product; the outputs are
summed (nothing kept). It scales with E, not k.

Under TP the experts' intermediate size F is split (GPT-OSS's plan leaves its experts whole);
the router, the dispatch, the gathered rows and the experts' outputs are whole on every rank.
Under expert parallelism (``setup.ep`` > 1: :func:`_dispatched_experts`) the rank's ``E/e``
experts run whole on the rows the all-to-all brought (:func:`received_rows`), and the sender
keeps what the combine needs. With the all-gather dispatch (``setup.ep_dispatch``) they run as a
top-1 call on ``E/e x capacity`` slots (:func:`routed_experts` at those rows, whole) between what
the form's dispatch and combine keep (:mod:`.all_gather`).

**Ops and FLOPs** (:meth:`~.rules.LayerTensors.op`), summed over the experts: the eager loop runs
them one after another, but its last ``index_add_`` comes after every expert's down projection,
so a rerun up to the combine runs them all. ``dispatch`` (gathers: none), ``up`` (``2 S h 2F``
matmul FLOPs), ``silu`` (GPT-OSS: its clamped GLU), ``mul``, ``down`` (``2 S F h``), ``combine``
(the weighting and the sum). Llama 4: ``scale`` (the repeated input times its scores), then the
same over ``E T`` rows, and the sum over the experts.
"""

from __future__ import annotations

from . import all_gather
from .families import FAMILY
from .mlp import SILU, dense_mlp, mlp_ops, shared_experts, shared_gate, swiglu
from .routers import INT64, replay_indices, router, routing_weight_bytes
from .rules import LayerTensors
from .shape import MoESetup, MoEShape

_INT32 = 4
CLAMPED_GLU = 7  # elementwise FLOPs per element of GPT-OSS's _apply_gate: two clamps, sigmoid, *, +1, *


def experts(layer: LayerTensors, shape: MoEShape, setup: MoESetup) -> None:
    """The routed experts and their ``moe_act`` unit (``_apply_gate``'s output discarded; Llama 4: ``act_fn``'s)."""
    kind = FAMILY[shape.family].experts
    if kind == "all":
        return _all_experts(layer, shape, setup)
    if setup.ep > 1 and setup.ep_dispatch == "all_gather":  # a top-1 call on E/e x capacity slots
        all_gather.dispatch(layer, shape, setup)
        routed_experts(layer, shape, setup, all_gather.slots(shape, setup), 1, shape.experts // setup.ep)
        return all_gather.combine(layer, shape, setup)
    if setup.ep > 1:
        return _dispatched_experts(layer, shape, setup)
    S, t = setup.tokens * shape.top_k, shape.split("experts", setup.tp)
    routed_experts(layer, shape, setup, S, t, shape.experts)


def routed_experts(layer: LayerTensors, shape: MoEShape, setup: MoESetup, S: int, t: int, local: int) -> None:
    """``S`` routes through ``local`` experts split ``1/t`` (module docstring), each output scaled
    by its routing weight, which needs a gradient; and their ``moe_act`` unit."""
    kind = FAMILY[shape.family].experts
    h, w, F, r, split = shape.hidden, setup.width, shape.moe_ffn // t, routing_weight_bytes(shape, setup), t > 1
    grouped = setup.experts == "grouped_mm"
    layer.op("mlp.experts.dispatch")
    mlp_ops(layer, "mlp.experts", S, h, F, CLAMPED_GLU if kind == "clamped" else SILU)
    layer.op("mlp.experts.combine", elementwise=2 * S * h)  # the weighting and the sum over the top-k
    if grouped:
        layer.save("dispatch.token_index", INT64 * S, False, "mlp.experts.dispatch")
        layer.save("dispatch.perm", INT64 * S, False, "mlp.experts.dispatch")
        if kind == "clamped":
            layer.save("experts.bias_index", INT64 * S, False, "mlp.experts.up", "mlp.experts.down")
        layer.save("grouped_mm.offsets", _INT32 * local, False, "mlp.experts.up", "mlp.experts.down")
    else:
        layer.save("dispatch.indices", 2 * INT64 * S, False, "mlp.experts.dispatch", "mlp.experts.combine")
    layer.save("experts.input", w * S * h, False, "mlp.experts.up")
    gate_up = layer.save("experts.gate_up", w * S * 2 * F, split, "mlp.experts.silu", "mlp.experts.mul")
    if kind == "clamped":  # _apply_gate: clamp, sigmoid(alpha gate), gate * sigmoid, (up + 1) * glu
        for name in ("gate_clamped", "sigmoid", "glu", "up_plus_one"):
            layer.save(f"experts.{name}", w * S * F, split, "mlp.experts.mul")
    else:
        layer.save("experts.act", w * S * F, split, "mlp.experts.mul")
    product = layer.save("experts.product", w * S * F, split, "mlp.experts.down")
    layer.save("experts.routing_weights", r * S, False, "mlp.experts.combine")
    layer.save("experts.output", w * S * h, False, "mlp.experts.combine")
    if grouped:
        layer.save("combine.inverse_perm", INT64 * S, False, "mlp.experts.combine")
    else:
        layer.save("combine.weighted", w * S * h, False, "mlp.experts.combine")
    # _apply_gate (chunk, act(gate) * up) is discarded: its product, which down keeps, and act(gate)
    # (grouped_mm and GPT-OSS call it; under moe_act the eager loop does too: recompute.experts_loop)
    layer.unit("moe_act", ["mlp.experts.silu", "mlp.experts.mul"], [gate_up], discards=[product])


def received_rows(shape: MoEShape, setup: MoESetup) -> int:
    """The rows this rank's experts receive at ``setup.ep`` = e > 1 (:attr:`MoESetup.ep_rows`):
    balanced ``T' k`` (the e ranks' ``e T' k`` routes spread evenly), the dropless worst case
    ``e T' min(k, E/e)`` (a token picks distinct experts, at most ``E/e`` of them here, and every
    rank of the group sends all such routes here), or the count given; with the all-gather
    dispatch, its ``E/e x capacity`` slots (:func:`.all_gather.slots`), whatever the routing."""
    T, k, e = setup.dispatched_tokens, shape.top_k, setup.ep
    if setup.ep_dispatch == "all_gather":
        return all_gather.slots(shape, setup)
    if setup.ep_rows == "balanced":
        return T * k
    if setup.ep_rows == "worst":
        return e * T * min(k, shape.experts // e)
    return int(setup.ep_rows)


def expert_weight_bytes(shape: MoEShape, setup: MoESetup) -> int:
    """The routed experts' weights (and GPT-OSS's biases) of one MoE layer on one rank: ``E/e``
    experts at EP e (whole: expert tensor parallel size 1), all ``E`` split ``1/t`` where the
    family's plan splits them without EP; in the model's dtype."""
    e = setup.ep
    t = 1 if e > 1 else shape.split("experts", setup.tp)
    h, F = shape.hidden, shape.moe_ffn
    per_expert = 3 * h * F // t + ((2 * F // t + h) if FAMILY[shape.family].experts == "clamped" else 0)
    return shape.experts // e * per_expert * setup.width


def _dispatched_experts(layer: LayerTensors, shape: MoEShape, setup: MoESetup) -> None:
    """The experts under expert parallelism (:mod:`neuron_ckpt.parallel.experts.all_to_all`): this
    rank's ``T'`` tokens' ``T' k`` routes go out (the gather keeps its int64 index), its ``E/e``
    whole experts run on the ``R`` rows received as a top-1 call of weight 1 (an empty receive:
    one zero row), and the rows come back (the un-sort keeps its index) to be weighted and summed
    by the sender (which keeps the returned ``[T' k, h]`` rows and its ``[T', k]`` weights). On
    the experts' side the weights need no gradient: nothing keeps the down projection's output
    nor (grouped_mm) the sort's permutation."""
    clamped = FAMILY[shape.family].experts == "clamped"
    T, k, R = setup.dispatched_tokens, shape.top_k, max(received_rows(shape, setup), 1)
    h, w, F, r = shape.hidden, setup.width, shape.moe_ffn, routing_weight_bytes(shape, setup)
    grouped = setup.experts == "grouped_mm"
    layer.op("mlp.experts.dispatch")
    mlp_ops(layer, "mlp.experts", R, h, F, CLAMPED_GLU if clamped else SILU)
    layer.op("mlp.experts.weight", elementwise=R * h)  # the experts' own weighting, by ones
    layer.op("mlp.experts.combine", elementwise=2 * T * k * h)  # the sender's weighting and sum
    layer.save("ep.send_index", INT64 * T * k, False, "mlp.experts.dispatch")
    if grouped:
        layer.save("dispatch.token_index", INT64 * R, False, "mlp.experts.dispatch")
        if clamped:
            layer.save("experts.bias_index", INT64 * R, False, "mlp.experts.up", "mlp.experts.down")
        layer.save("grouped_mm.offsets", _INT32 * (shape.experts // setup.ep), False, "mlp.experts.up")
    else:
        layer.save("dispatch.indices", 2 * INT64 * R, False, "mlp.experts.dispatch", "mlp.experts.weight")
    layer.save("experts.input", w * R * h, False, "mlp.experts.up")
    gate_up = layer.save("experts.gate_up", w * R * 2 * F, False, "mlp.experts.silu", "mlp.experts.mul")
    if clamped:
        for name in ("gate_clamped", "sigmoid", "glu", "up_plus_one"):
            layer.save(f"experts.{name}", w * R * F, False, "mlp.experts.mul")
    else:
        layer.save("experts.act", w * R * F, False, "mlp.experts.mul")
    product = layer.save("experts.product", w * R * F, False, "mlp.experts.down")
    layer.save("experts.routing_weights", r * R, False, "mlp.experts.weight")
    if grouped:
        layer.save("combine.inverse_perm", INT64 * R, False, "mlp.experts.weight")
    else:
        layer.save("combine.weighted", w * R * h, False, "mlp.experts.weight")
    layer.save("ep.combine_index", INT64 * T * k, False, "mlp.experts.combine")
    layer.save("ep.returned", w * T * k * h, False, "mlp.experts.combine")
    layer.save("ep.routing_weights", r * T * k, False, "mlp.experts.combine")
    layer.unit("moe_act", ["mlp.experts.silu", "mlp.experts.mul"], [gate_up], discards=[product])


def _all_experts(layer: LayerTensors, shape: MoEShape, setup: MoESetup) -> None:
    rows, h, w, t = shape.experts * setup.tokens, shape.hidden, setup.width, shape.split("experts", setup.tp)
    F, split = shape.moe_ffn // t, t > 1
    layer.op("mlp.experts.scale", elementwise=rows * h)
    mlp_ops(layer, "mlp.experts", rows, h, F)
    layer.op("mlp.experts.sum", elementwise=rows * h)
    layer.save("experts.repeated_input", w * rows * h, False, "mlp.experts.scale")
    layer.save("experts.input", w * rows * h, False, "mlp.experts.up")
    gate_up = layer.save("experts.gate_up", w * rows * 2 * F, split, "mlp.experts.silu", "mlp.experts.mul")
    act = layer.save("experts.act", w * rows * F, split, "mlp.experts.mul")
    layer.save("experts.product", w * rows * F, split, "mlp.experts.down")
    layer.unit("moe_act", ["mlp.experts.silu"], [gate_up], discards=[act])  # act_fn's output


__all__ = [
    "dense_mlp", "expert_weight_bytes", "experts", "received_rows", "replay_indices", "router", "routing_weight_bytes",
    "shared_experts", "shared_gate", "swiglu",
]  # fmt: skip
