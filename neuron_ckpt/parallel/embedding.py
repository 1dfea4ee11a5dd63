"""Vocabulary-parallel embedding: each rank holds ``vocab/t`` rows of the table.

A rank looks up the ids that fall in its row range and writes zeros for the others; summing over
the TP group completes every lookup. With ``sequence_parallel`` the sum is a reduce-scatter
along the sequence, so the output is already the ``[s/t, b, h]`` layout the first norm wants:
pass ids sequence-first, ``[s, b]``.

Out-of-range ids (negative or >= ``num_embeddings``) raise a ``ValueError`` naming the id and
the vocabulary size, at every TP size, on eager backends (CPU, CUDA): the check reads the ids'
min and max on the host, one small device-to-host sync per call. Without it an id outside the
vocabulary would, at t > 1, fall outside every rank's row range and silently embed as zeros (at
t = 1 ``F.embedding`` raises an IndexError, or a device-side assert on CUDA). The ids are the
same on every TP rank, so each rank's local check raises on all of them and none is left waiting
in the TP reduction.

On XLA the check is skipped (reading the ids back would cut the step's graph and sync every
step); there the ids come from ``neuron_ckpt.data.PackedDataset``, which range-checks the whole
file on the host when it opens it (and ``write_packed`` refuses bad ids when it writes one). The
check is also skipped for meta tensors and while ``torch.compile`` traces.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..distributed.mappings import reduce_from_tensor_parallel_region, reduce_scatter_to_sequence_parallel_region
from ..distributed.parallel_state import ParallelState
from .init import InitMethod, check_divisible, normal_init, shard_of_full
from .layer_args import check_sizes, resolve_parallel_state
from .linear import check_sequence_divisible
from .params import set_tensor_parallel_attributes


def _compiling() -> bool:
    compiler = getattr(torch, "compiler", None)
    return bool(compiler is not None and hasattr(compiler, "is_compiling") and compiler.is_compiling())


class VocabParallelEmbedding(torch.nn.Module):
    """``[s, b]`` ids -> ``[s, b, h]`` (or ``[s/t, b, h]`` with ``sequence_parallel``)."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        sequence_parallel: bool = False,
        init_method: InitMethod = normal_init(1.0),  # noqa: B008  stateless: one shared default is harmless
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        parallel_state: ParallelState | None = None,
        padding_idx: int | None = None,
    ):
        super().__init__()
        check_sizes(num_embeddings=num_embeddings, embedding_dim=embedding_dim)
        self.parallel_state = resolve_parallel_state(parallel_state)
        t, r = self.parallel_state.tp_size, self.parallel_state.tp_rank
        check_divisible(num_embeddings, "num_embeddings", t)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.sequence_parallel = sequence_parallel
        per_rank = num_embeddings // t
        self.vocab_start, self.vocab_end = r * per_rank, (r + 1) * per_rank
        if padding_idx is not None and not 0 <= padding_idx < num_embeddings:
            raise ValueError(f"padding_idx={padding_idx} must be in [0, num_embeddings={num_embeddings})")
        self.padding_idx = padding_idx  # its row gets no gradient, as in torch.nn.Embedding
        mine = padding_idx is not None and self.vocab_start <= padding_idx < self.vocab_end
        self._local_padding_idx = padding_idx - self.vocab_start if padding_idx is not None and mine else None
        self.weight = torch.nn.Parameter(
            shard_of_full((num_embeddings, embedding_dim), 0, r, t, init_method, dtype, device)
        )
        set_tensor_parallel_attributes(self.weight, partition_dim=0)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        self.check_ids(ids)  # before any collective: every TP rank sees the same ids and raises
        tp = self.parallel_state.tp
        if tp.size == 1:
            return F.embedding(ids, self.weight, self._local_padding_idx)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local = torch.where(outside, torch.zeros_like(ids), ids - self.vocab_start)
        out = F.embedding(local, self.weight, self._local_padding_idx).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            check_sequence_divisible(out, tp.size, "VocabParallelEmbedding")
            return reduce_scatter_to_sequence_parallel_region(out, tp)
        return reduce_from_tensor_parallel_region(out, tp)

    def check_ids(self, ids: torch.Tensor) -> None:
        """Raise ``ValueError`` if an id is outside ``[0, num_embeddings)``; a no-op on XLA.

        Eager only: one host sync (the ids' min and max). See the module docstring.
        """
        if ids.device.type in ("xla", "meta") or ids.numel() == 0 or _compiling():
            return
        if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
            return  # F.embedding refuses these itself, with its own message
        lo, hi = (int(v) for v in torch.aminmax(ids.detach()))
        if lo >= 0 and hi < self.num_embeddings:
            return
        bad = lo if lo < 0 else hi
        count = int(((ids < 0) | (ids >= self.num_embeddings)).sum())
        raise ValueError(
            f"VocabParallelEmbedding: token id {bad} is outside the vocabulary [0, {self.num_embeddings}) "
            f"(vocab size {self.num_embeddings}; {count} of {ids.numel()} ids out of range, "
            f"min {lo}, max {hi}): check the tokenizer and the data against the model's vocab_size"
        )

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}, {self.embedding_dim}, rows [{self.vocab_start}, {self.vocab_end}), "
            f"sequence_parallel={self.sequence_parallel}"
            + (f", padding_idx={self.padding_idx}" if self.padding_idx is not None else "")
        )
