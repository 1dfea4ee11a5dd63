"""Tensor- and sequence-parallel layers (Megatron shapes, ``[s, b, h]`` activations).

``dropout`` is the XLA-correct dropout our layers use, for the dropouts of custom blocks (see its
docstring). Importing it here shadows the ``neuron_ckpt.parallel.dropout`` submodule as an
attribute; ``from neuron_ckpt.parallel.dropout import dropout`` still works.
"""

from .attention import CoreAttention
from .cross_entropy import vocab_parallel_cross_entropy
from .dropout import dropout
from .embedding import VocabParallelEmbedding
from .fused_ops import masked_softmax, rms_norm, swiglu
from .linear import ColumnParallelLinear, RowParallelLinear
from .norms import LayerNorm, RMSNorm
from .qkv import QKVParallelLinear

__all__ = [
    "CoreAttention",
    "ColumnParallelLinear",
    "LayerNorm",
    "QKVParallelLinear",
    "RMSNorm",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "dropout",
    "masked_softmax",
    "rms_norm",
    "swiglu",
    "vocab_parallel_cross_entropy",
]
