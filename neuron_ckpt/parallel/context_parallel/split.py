"""How context parallelism splits a sequence: causal load balance over ``2c`` chunks.

The sequence of ``s`` tokens is cut into ``2c`` chunks of ``L = s / (2c)`` tokens, and CP rank
``r`` holds chunks ``r`` and ``2c - 1 - r``, in that order (Megatron's and TransformerEngine's
"DualChunkSwap", torch's head-tail). At ``c = 2`` and ``s = 8``: rank 0 holds positions
``0 1 6 7``, rank 1 ``2 3 4 5``. Under causal attention a query at position ``i`` reads ``i + 1``
keys, so a contiguous split would give the last rank ``2c - 1`` times the work of the first; with
one early and one late chunk every rank reads the same number of keys,
``L (2c + 1) L`` per head.

The same index applies to everything laid along the sequence: the token ids, the labels (shifted
to next-token targets *before* the split, so a chunk's last token keeps its real target), the
positions that RoPE rotates by (global positions, never local ones) and the causal mask (built
from global positions). :func:`shard` takes a rank's rows, :func:`unshard` puts the rows of
every rank, gathered in rank order, back in sequence order.
"""

from __future__ import annotations

import torch

from ...distributed.parallel_state import Group


def check_sequence(
    seq_len: int, context_parallel_size: int, tensor_parallel_size: int = 1, sequence_parallel: bool = False
) -> None:
    """One-line ValueError unless ``seq_len`` splits into ``2c`` equal chunks (and, under sequence
    parallelism, ``2c t``: each rank's ``s / c`` tokens are then split over TP too). Nothing to
    check at ``c = 1``."""
    c, t = context_parallel_size, tensor_parallel_size
    if c == 1:
        return
    need = 2 * c * t if sequence_parallel else 2 * c
    if seq_len % need:
        why = (
            f"2 x context_parallel_size x tensor_parallel_size = 2 x {c} x {t} = {need} (sequence parallel)"
            if sequence_parallel
            else f"2 x context_parallel_size = 2 x {c} = {need}"
        )
        raise ValueError(
            f"sequence length {seq_len} must be a multiple of {why}: causal load balance cuts it into "
            f"2c chunks; nearest allowed: {seq_len // need * need or need}, {(seq_len // need + 1) * need}"
        )


def chunks_of(rank: int, context_parallel_size: int) -> tuple[int, int]:
    """The two chunks (of ``2c``) that CP rank ``rank`` holds, in the order it holds them."""
    return rank, 2 * context_parallel_size - 1 - rank


def positions(seq_len: int, context_parallel_size: int, rank: int, device=None) -> torch.Tensor:
    """The global positions of CP rank ``rank``'s ``s / c`` tokens (int64, in the order it holds them)."""
    check_sequence(seq_len, context_parallel_size)
    n = seq_len // (2 * context_parallel_size)
    first, second = chunks_of(rank, context_parallel_size)
    return torch.cat([torch.arange(k * n, (k + 1) * n, device=device) for k in (first, second)])


def shard(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """This CP rank's rows of ``x`` along ``dim`` (the whole sequence): its two chunks, a new tensor."""
    if group.size == 1:
        return x
    index = positions(x.shape[dim], group.size, group.rank, x.device)
    return x.index_select(dim, index)


def sequence_order(context_parallel_size: int) -> list[int]:
    """For each chunk of the sequence, where it sits among the ``2c`` chunks of a rank-order
    gather (rank 0's two, then rank 1's, ...)."""
    c = context_parallel_size
    return [2 * m if m < c else 2 * (2 * c - 1 - m) + 1 for m in range(2 * c)]


def unshard(x: torch.Tensor, dim: int, context_parallel_size: int) -> torch.Tensor:
    """Every CP rank's rows, concatenated along ``dim`` in rank order, back in sequence order."""
    c = context_parallel_size
    if c == 1:
        return x
    dim = dim % x.dim()
    s = x.shape[dim]
    chunks = x.unflatten(dim, (2 * c, s // (2 * c)))
    index = torch.tensor(sequence_order(c), device=x.device)
    return chunks.index_select(dim, index).flatten(dim, dim + 1)


__all__ = ["check_sequence", "chunks_of", "positions", "sequence_order", "shard", "unshard"]
