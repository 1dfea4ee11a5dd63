"""Vocabulary-parallel embedding: each rank holds ``vocab/t`` rows of the table.

A rank looks up the ids that fall in its row range and writes zeros for the others; summing over
the TP group completes every lookup. With ``sequence_parallel`` the sum is a reduce-scatter
along the sequence, so the output is already the ``[s/t, b, h]`` layout the first norm wants:
pass ids sequence-first, ``[s, b]``.

Out-of-range ids (negative or >= ``num_embeddings``) are not checked here: checking would force
a device-to-host sync every step on XLA. At t > 1 they embed to zeros; validate ids in the data
pipeline.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..distributed.mappings import reduce_from_tensor_parallel_region, reduce_scatter_to_sequence_parallel_region
from ..distributed.parallel_state import ParallelState
from .init import InitMethod, check_divisible, normal_init, shard_of_full
from .linear import _check_features, _state, check_sequence_divisible
from .params import set_tensor_parallel_attributes


class VocabParallelEmbedding(torch.nn.Module):
    """``[s, b]`` ids -> ``[s, b, h]`` (or ``[s/t, b, h]`` with ``sequence_parallel``)."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        sequence_parallel: bool = False,
        init_method: InitMethod = normal_init(1.0),
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        parallel_state: ParallelState | None = None,
    ):
        super().__init__()
        _check_features(num_embeddings=num_embeddings, embedding_dim=embedding_dim)
        self.state = _state(parallel_state)
        t, r = self.state.tp_size, self.state.tp_rank
        check_divisible(num_embeddings, "num_embeddings", t)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.sequence_parallel = sequence_parallel
        per_rank = num_embeddings // t
        self.vocab_start, self.vocab_end = r * per_rank, (r + 1) * per_rank
        self.weight = torch.nn.Parameter(
            shard_of_full((num_embeddings, embedding_dim), 0, r, t, init_method, dtype, device)
        )
        set_tensor_parallel_attributes(self.weight, partition_dim=0)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        tp = self.state.tp
        if tp.size == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local = torch.where(outside, torch.zeros_like(ids), ids - self.vocab_start)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            check_sequence_divisible(out, tp.size, "VocabParallelEmbedding")
            return reduce_scatter_to_sequence_parallel_region(out, tp)
        return reduce_from_tensor_parallel_region(out, tp)

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}, {self.embedding_dim}, rows [{self.vocab_start}, {self.vocab_end}), "
            f"sequence_parallel={self.sequence_parallel}"
        )
