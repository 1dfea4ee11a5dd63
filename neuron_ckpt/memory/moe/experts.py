"""The MLP half of a transformers MoE layer, storage by storage: the router, the routed experts
(transformers' ``grouped_mm`` or its eager per-expert loop), the shared experts, and the dense
MLP of the dense layers. T tokens, each sent to k experts: S = T k routed rows, dropless, so
every count below is fixed by T, k and the sizes, never by how the tokens spread over experts.

**Router.** Its linear keeps the norm's output (DeepSeek's an fp32 copy of it: its weight is
fp32). Mixtral and Qwen: the fp32 softmax keeps its output ``[T, E]``, top-k its int64 indices,
the in-place renormalisation (Mixtral always, Qwen with ``norm_topk_prob``) the fp32 sum and a
copy of the top-k values. DeepSeek: the sigmoid keeps its output, the gather of the chosen
unbiased scores its indices, the renormalisation the same two; the group top-k on the biased
scores feeds only indices, so autograd frees that branch. The routing weights go on in fp32
(Mixtral, DeepSeek) or the activation dtype (Qwen casts them).

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
(``index_add_``'s source) are kept per expert, n rows each, S rows in all.

**Shared experts** (DeepSeek's ``shared_experts``, Qwen2's ``shared_expert``) and the **dense
MLP**: ``down(act(gate(x)) * up(x))`` keeps gate's output (silu), ``act(gate)`` and up's output
(the multiply) and the product (down); x is the norm's output. Qwen2's gate
``sigmoid(Linear(h, 1)(x)) * shared(x)`` keeps x, the sigmoid's output and the shared output.

Under TP the experts' and the dense MLP's intermediate size F is split; the router, the
dispatch, the gathered rows and the experts' outputs are whole on every rank.
"""

from __future__ import annotations

from ..rerun import SOFTMAX
from ..terms import ActivationTerm
from .rules import LayerTensors
from .shape import MoESetup, MoEShape

_FP32, _INT64, _INT32 = 4, 8, 4
SILU = 4  # elementwise FLOPs per element: x * sigmoid(x); the product with up is 1 more


def routing_weight_bytes(shape: MoEShape, setup: MoESetup) -> int:
    """Bytes of one routing weight: fp32 for Mixtral and DeepSeek, the activation dtype for Qwen."""
    return setup.width if shape.family in ("qwen3_moe", "qwen2_moe") else _FP32


def replay_indices(shape: MoEShape, setup: MoESetup) -> tuple[ActivationTerm, ...]:
    """What the routing replay of a recomputed MoE block holds outside autograd until the block's
    backward: the int64 indices of each top-k call (DeepSeek: the groups' top-2, the top
    groups, the top experts)."""
    T, k = setup.tokens, shape.top_k
    if shape.family != "deepseek_v3":
        return (ActivationTerm("replay.topk_indices", _INT64 * T * k, False),)
    return (
        ActivationTerm("replay.group_top2_indices", _INT64 * T * shape.n_group * 2, False),
        ActivationTerm("replay.top_groups_indices", _INT64 * T * shape.topk_group, False),
        ActivationTerm("replay.topk_indices", _INT64 * T * k, False),
    )


def router(layer: LayerTensors, shape: MoEShape, setup: MoESetup, x: str) -> None:
    T, E, k, w = setup.tokens, shape.experts, shape.top_k, setup.width
    # One op: the linear (keeps its input), the softmax or sigmoid, top-k and the renormalisation
    # (which keep their outputs as they run).
    layer.op("mlp.router", matmul=2 * T * shape.hidden * E, elementwise=SOFTMAX * T * E)
    if shape.family == "deepseek_v3":
        if w == _FP32:
            layer.keep(x, "mlp.router")
        else:
            layer.save("router.input_fp32", _FP32 * T * shape.hidden, False, "mlp.router")
        layer.save("router.sigmoid_fp32", _FP32 * T * E, False, "mlp.router+")
    else:
        layer.keep(x, "mlp.router")
        layer.save("router.softmax_fp32", _FP32 * T * E, False, "mlp.router+")
    layer.save("router.topk_indices", _INT64 * T * k, False, "mlp.router+")
    if shape.family == "mixtral" or shape.norm_topk_prob:
        layer.save("router.topk_sum_fp32", _FP32 * T, False, "mlp.router+")
        layer.save("router.topk_values_fp32", _FP32 * T * k, False, "mlp.router+")


def experts(layer: LayerTensors, shape: MoEShape, setup: MoESetup) -> None:
    """The routed experts and their ``moe_act`` unit (SwiGLU's output discarded where it can be)."""
    S, h, w, t = setup.tokens * shape.top_k, shape.hidden, setup.width, setup.tp
    F, r, split = shape.moe_ffn // t, routing_weight_bytes(shape, setup), t > 1
    grouped = setup.experts == "grouped_mm"
    # In forward order, summed over the experts (the eager loop runs them one after another: its
    # last combine is after every down projection).
    layer.op("mlp.experts.dispatch")
    layer.op("mlp.experts.up", matmul=2 * S * h * 2 * F)
    layer.op("mlp.experts.silu", elementwise=SILU * S * F)
    layer.op("mlp.experts.mul", elementwise=S * F)
    layer.op("mlp.experts.down", matmul=2 * S * F * h)
    layer.op("mlp.experts.combine", elementwise=2 * S * h)  # weighting and the sum over top-k
    if grouped:
        layer.save("dispatch.token_index", _INT64 * S, False, "mlp.experts.dispatch")
        layer.save("dispatch.perm", _INT64 * S, False, "mlp.experts.dispatch")
        layer.save("grouped_mm.offsets", _INT32 * shape.experts, False, "mlp.experts.up", "mlp.experts.down")
    else:
        layer.save("dispatch.indices", 2 * _INT64 * S, False, "mlp.experts.dispatch", "mlp.experts.combine")
    layer.save("experts.input", w * S * h, False, "mlp.experts.up")
    gate_up = layer.save("experts.gate_up", w * S * 2 * F, split, "mlp.experts.silu", "mlp.experts.mul")
    act = layer.save("experts.act", w * S * F, split, "mlp.experts.mul")
    product = layer.save("experts.product", w * S * F, split, "mlp.experts.down")
    layer.save("experts.routing_weights", r * S, False, "mlp.experts.combine")
    layer.save("experts.output", w * S * h, False, "mlp.experts.combine")
    if grouped:
        layer.save("combine.inverse_perm", _INT64 * S, False, "mlp.experts.combine")
        # _apply_gate (chunk, act(gate) * up) is discarded: its product, which down keeps
        layer.unit("moe_act", ["mlp.experts.silu", "mlp.experts.mul"], [gate_up], discards=[product])
    else:
        layer.save("combine.weighted", w * S * h, False, "mlp.experts.combine")
        # the loop writes act_fn(gate) * up inline: only act_fn's output can be discarded
        layer.unit("moe_act", ["mlp.experts.silu"], [gate_up], discards=[act])


def swiglu(layer: LayerTensors, place: str, x: str, ffn: int, setup: MoESetup, split: bool, hidden: int) -> None:
    """transformers' MLP ``down(act(gate(x)) * up(x))`` at ``place``, ``ffn`` wide on this rank."""
    T, w, h = setup.tokens, setup.width, hidden
    layer.op(f"{place}.up", matmul=2 * T * h * 2 * ffn)  # gate_proj and up_proj
    layer.op(f"{place}.silu", elementwise=SILU * T * ffn)
    layer.op(f"{place}.mul", elementwise=T * ffn)
    layer.op(f"{place}.down", matmul=2 * T * ffn * h)
    layer.keep(x, f"{place}.up")
    layer.save(f"{place}.gate_proj.out", w * T * ffn, split, f"{place}.silu")
    layer.save(f"{place}.act", w * T * ffn, split, f"{place}.mul")
    layer.save(f"{place}.up_proj.out", w * T * ffn, split, f"{place}.mul")
    layer.save(f"{place}.product", w * T * ffn, split, f"{place}.down")


def shared_experts(layer: LayerTensors, shape: MoEShape, setup: MoESetup, x: str) -> None:
    """DeepSeek's shared experts or Qwen2's shared expert, and the ``shared_experts`` unit."""
    t = shape.split("shared", setup.tp)
    swiglu(layer, "mlp.shared", x, shape.shared_ffn // t, setup, t > 1, shape.hidden)
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


def dense_mlp(layer: LayerTensors, shape: MoEShape, setup: MoESetup, x: str) -> None:
    """The dense layers' MLP, and its ``mlp`` and ``mlp_act`` (``act_fn``'s output) units."""
    swiglu(layer, "mlp", x, shape.dense_ffn // setup.tp, setup, setup.tp > 1, shape.hidden)
    layer.unit("mlp", ["mlp"], [x])
    layer.unit("mlp_act", ["mlp.silu"], ["mlp.gate_proj.out"], discards=["mlp.act"])


__all__ = [
    "dense_mlp", "experts", "replay_indices", "router", "routing_weight_bytes", "shared_experts", "shared_gate",
    "swiglu",
]  # fmt: skip
