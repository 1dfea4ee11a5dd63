"""Tensor- and sequence-parallel layers (Megatron shapes, ``[s, b, h]`` activations)."""

from .attention import CoreAttention
from .cross_entropy import vocab_parallel_cross_entropy
from .embedding import VocabParallelEmbedding
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
    "vocab_parallel_cross_entropy",
]
