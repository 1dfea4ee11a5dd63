"""The routers of transformers' MoE blocks, storage by storage, and what the routing replay of a
recomputed block holds (transformers 5.24, torch 2.13 on CPU). T tokens, E experts, k chosen.

Every router's linear keeps its input, the norm's output (DeepSeek's an fp32 copy of it: its
weight is fp32), and ``torch.topk`` its int64 ``[T, k]`` indices. Then, by :attr:`Family.router`:

* ``softmax`` (Mixtral, Qwen2/3-MoE, OLMoE): the fp32 softmax keeps its ``[T, E]`` output; the
  in-place renormalisation (Mixtral always, the others with ``norm_topk_prob``) the fp32 sum and
  a copy of the top-k values.
* ``softmax_fp32`` (DeepSeek-V2): the same softmax, never renormalised; ``group_limited_greedy``
  masks the scores of the groups not kept (``masked_fill`` keeps its ``[T, E]`` boolean mask).
* ``sigmoid_group`` (DeepSeek-V3): the sigmoid keeps its output, the gather of the chosen
  unbiased scores its indices, the renormalisation as above; the group top-k on the biased
  scores feeds only indices, so autograd frees that branch.
* ``topk_softmax`` (GPT-OSS, Aria): top-k on the logits, then a softmax over the k in the
  activation dtype, which keeps its ``[T, k]`` output.
* ``sigmoid_all`` (Llama 4): the top-k logits are scattered into a ``[T, E]`` of ``-inf`` (the
  scatter keeps the same indices), the fp32 sigmoid keeps its output, and the block multiplies
  every token's copy for every expert by its ``[E T]`` scores (a transposed copy it keeps).

The routing weights go on in fp32 (Mixtral, DeepSeek) or the activation dtype (the others).
"""

from __future__ import annotations

from ..terms import ActivationTerm
from .families import FAMILY
from .norms import FP32
from .rules import LayerTensors
from .shape import MoESetup, MoEShape

INT64 = 8


def routing_weight_bytes(shape: MoEShape, setup: MoESetup) -> int:
    """Bytes of one routing weight: fp32 where the family keeps them so, else the activation dtype."""
    return FP32 if FAMILY[shape.family].routing_fp32 else setup.width


def topk_calls(shape: MoEShape) -> tuple[tuple[str, int], ...]:
    """Each ``torch.topk`` the router calls, in order: its name and how many indices per token."""
    if shape.family == "deepseek_v3":
        return (("group_top2", shape.n_group * 2), ("top_groups", shape.topk_group), ("topk", shape.top_k))
    if shape.family == "deepseek_v2" and shape.topk_method == "group_limited_greedy":
        return (("top_groups", shape.topk_group), ("topk", shape.top_k))
    return (("topk", shape.top_k),)


def replay_indices(shape: MoEShape, setup: MoESetup) -> tuple[ActivationTerm, ...]:
    """What the routing replay of a recomputed MoE block holds outside autograd until the block's
    backward: the int64 indices of each top-k call."""
    return tuple(
        ActivationTerm(f"replay.{name}_indices", INT64 * setup.tokens * n, False) for name, n in topk_calls(shape)
    )


def router(layer: LayerTensors, shape: MoEShape, setup: MoESetup, x: str) -> None:
    kind = FAMILY[shape.family].router
    T, E, k, w = setup.tokens, shape.experts, shape.top_k, setup.width
    if kind in ("softmax_fp32", "sigmoid_group") and w != FP32:
        layer.save("router.input_fp32", FP32 * T * shape.hidden, False, "mlp.router")
    else:
        layer.keep(x, "mlp.router")
    if kind == "sigmoid_group":
        layer.save("router.sigmoid_fp32", FP32 * T * E, False, "mlp.router")
    elif kind in ("softmax", "softmax_fp32"):
        layer.save("router.softmax_fp32", FP32 * T * E, False, "mlp.router")
    if kind == "softmax_fp32" and shape.topk_method == "group_limited_greedy":
        layer.save("router.group_mask", T * E, False, "mlp.router")  # bool
    layer.save("router.topk_indices", INT64 * T * k, False, "mlp.router")
    if kind == "topk_softmax":
        layer.save("router.topk_softmax", w * T * k, False, "mlp.router")
    elif kind == "sigmoid_all":
        layer.save("router.sigmoid_fp32", FP32 * T * E, False, "mlp.router")
        layer.save("router.scores", w * E * T, False, "mlp.experts.scale")
    elif kind != "softmax_fp32" and (shape.family == "mixtral" or shape.norm_topk_prob):
        layer.save("router.topk_sum_fp32", FP32 * T, False, "mlp.router")
        layer.save("router.topk_values_fp32", FP32 * T * k, False, "mlp.router")


__all__ = ["replay_indices", "router", "routing_weight_bytes", "topk_calls"]
