"""The ops of a transformers layer's core attention, with their FLOPs (:meth:`~.rules.LayerTensors.op`),
for :mod:`.attention` and :mod:`.mla`.

A fused kernel (sdpa's flash kernel on CPU, with or without a mask; CUDA's) is one op, ``attn.core``:
``QK^T`` and ``probs @ V`` over the whole square, as ``FlopCounterMode`` counts the kernel (the
mask and the causal half change nothing), its softmax elementwise. Eager attention (and sdpa's
math path) is three or four: ``attn.core.scores`` (``QK^T``), Gemma2's ``attn.core.softcap``
(divide, ``tanh``, multiply), ``attn.core.softmax`` (GPT-OSS's over ``s + 1`` columns: the
sink), ``attn.core.pv`` (``probs @ V``). The second matmul keeps its inputs, so a checkpoint of
the attention function reruns the scores and the softmax, not ``probs @ V``.
"""

from __future__ import annotations

from ..rerun import SOFTMAX
from .rules import LayerTensors
from .shape import MoESetup

SOFTCAP = 3  # elementwise FLOPs per score: divide, tanh, multiply


def kernel(layer: LayerTensors, setup: MoESetup, heads: int, dqk: int, dv: int) -> None:
    """A fused attention kernel over ``heads`` heads on this rank, one op."""
    square = setup.micro_batch * heads * setup.seq_len**2
    layer.op("attn.core", matmul=2 * square * (dqk + dv), elementwise=SOFTMAX * square)


def unfused(
    layer: LayerTensors, setup: MoESetup, heads: int, dqk: int, dv: int, softcap: bool = False, sinks: bool = False
) -> None:
    """Eager attention (or sdpa's math path): the score matmul, Gemma2's soft-capping, the
    softmax (with GPT-OSS's sink column), the matmul with V."""
    b, s = setup.micro_batch, setup.seq_len
    square = b * heads * s * s
    layer.op("attn.core.scores", matmul=2 * square * dqk)
    if softcap:
        layer.op("attn.core.softcap", elementwise=SOFTCAP * square)
    layer.op("attn.core.softmax", elementwise=SOFTMAX * b * heads * s * (s + sinks))
    layer.op("attn.core.pv", matmul=2 * square * dv)


__all__ = ["SOFTCAP", "kernel", "unfused"]
