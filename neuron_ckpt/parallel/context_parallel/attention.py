"""Causal attention over the whole context when the sequence is split over the CP group.

All-gather form (the Llama 3 paper's, TransformerEngine's ``all_gather`` CP): each rank keeps its
own queries; keys and values are all-gathered over CP in forward, and their gradients
reduce-scattered back in backward (the conjugate pair
:func:`~neuron_ckpt.distributed.mappings.gather_from_context_parallel_region`). trn1 has no
working send/recv and no all-to-all (docs/context_parallel.md), so the ring and Ulysses forms
are not built. One call, per layer and per CP rank, with ``KV = 2 b (s/c) g d`` bytes-per-element
of this rank's keys and values (``g``: its kv heads, never repeated to the query heads):

* forward: one all-gather of K and V together (each rank sends ``(c - 1) KV``);
* backward: one all-gather again (:mod:`.regather`: the gathered K and V are not kept) and one
  reduce-scatter of their gradients (``(c - 1) KV`` each).

The gathered rows arrive in rank order and are put in sequence order once, as ``[2, b, g, s, d]``
(K and V, each contiguous per head, so the ops below keep views of it). Each of this rank's two
query chunks (:mod:`.split`: chunks ``r`` and ``2c - 1 - r`` of ``L`` tokens) then attends to
the keys up to its own end only, ``(j + 1) L`` keys for chunk ``j``, under the lower-right causal
mask of an ``L x (j + 1) L`` block: the work per rank is ``(2c + 1) L^2`` scores per head, the
``1/c`` share of the causal ``s^2 / 2`` (plus ``L^2 / 2``), on every rank alike. ``attend`` is
the kernel (explicit or flash, :class:`~neuron_ckpt.parallel.attention.CoreAttention`'s); it
gets one chunk and its mask.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from ...distributed import collectives as C
from ...distributed.mappings import gather_from_context_parallel_region
from ...distributed.parallel_state import Group
from .regather import regathered
from .split import chunks_of, sequence_order

Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@functools.lru_cache(maxsize=16)
def _lower_right(rows: int, cols: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``[rows, cols]``: nothing masked in the first ``cols - rows`` columns, causal in the last
    ``rows``. bool: True where masked; a float dtype: ``-inf`` there, 0 elsewhere (an additive mask)."""
    masked = torch.zeros(rows, cols, dtype=torch.bool, device=device)
    masked[:, cols - rows :] = torch.ones(rows, rows, dtype=torch.bool, device=device).triu_(1)
    if dtype == torch.bool:
        return masked
    return torch.zeros(rows, cols, dtype=dtype, device=device).masked_fill_(masked, float("-inf"))


def chunk_mask(rows: int, keys: int, seq_len: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The lower-right causal mask of a ``rows x keys`` block (a query chunk against the keys up
    to its end): a view of one ``[rows, seq_len]`` tensor per process, shared by every chunk and
    layer (as :func:`~neuron_ckpt.parallel.attention.causal_mask` is), since the ops that use it
    keep it for backward."""
    if torch.compiler.is_compiling():  # dynamo would trace through the cache and warn
        return _lower_right.__wrapped__(rows, seq_len, dtype, torch.device(device))[:, seq_len - keys :]
    return _lower_right(rows, seq_len, dtype, torch.device(device))[:, seq_len - keys :]


def _sequence_ordered(kv: torch.Tensor, c: int, kv_heads: int, head_dim: int) -> torch.Tensor:
    """``[s, b, 2 g d]`` rows of every rank in rank order ``->`` K and V ``[2, b, g, s, d]`` in
    sequence order (one copy)."""
    s, b = kv.shape[:2]
    chunks = kv.view(2 * c, s // (2 * c), b, 2, kv_heads, head_dim).permute(3, 2, 4, 0, 1, 5)
    index = torch.tensor(sequence_order(c), device=kv.device)
    return chunks.index_select(3, index).reshape(2, b, kv_heads, s, head_dim)


def context_parallel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: Group,
    kv_heads: int,
    head_dim: int,
    attend: Attend,
    mask_dtype: torch.dtype,
) -> torch.Tensor:
    """Causal attention of this rank's queries over the whole context (module docstring).

    ``q [b, a, s/c, d]`` (this rank's tokens, in the order it holds them); ``k, v [s/c, b, g d]``
    (sequence-first, as the projection made them). ``attend(q, k, v, mask)`` computes one chunk:
    ``q [b, a, L, d]`` against ``k, v [b, g, n, d]`` under ``mask [L, n]`` of ``mask_dtype``
    (bool: True where masked; float: additive). Returns ``[b, a, s/c, d]``.
    """
    c, r = group.size, group.rank
    local = q.shape[2]
    n = local // 2
    kv = torch.cat([k, v], dim=-1)  # one collective for both

    def rebuild(rows: torch.Tensor) -> torch.Tensor:
        return _sequence_ordered(C.all_gather(rows, 0, group), c, kv_heads, head_dim)

    gathered = _sequence_ordered(gather_from_context_parallel_region(kv, group), c, kv_heads, head_dim)
    outs = []
    with regathered(gathered, kv, rebuild):
        for i, chunk in enumerate(chunks_of(r, c)):
            keys = (chunk + 1) * n
            mask = chunk_mask(n, keys, local * c, mask_dtype, q.device)
            outs.append(attend(q[:, :, i * n : (i + 1) * n], gathered[0, :, :, :keys], gathered[1, :, :, :keys], mask))
    return torch.cat(outs, dim=2)


__all__ = ["chunk_mask", "context_parallel_attention"]
