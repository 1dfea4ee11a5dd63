"""Context parallelism (CP): the sequence split over ``c`` ranks for attention too.

Every per-token activation is ``1/c`` as large: each CP rank runs the whole model on its ``s/c``
tokens, with the weights replicated over CP (their gradients are averaged over DP x CP, and
ZeRO-1 shards over DP x CP: ``ParallelState.dp_cp``). Attention is the one place tokens meet:
:mod:`.attention` all-gathers keys and values over CP. Rooms: :mod:`.split` (which tokens a rank
holds: causal load balance over ``2c`` chunks), :mod:`.attention` (attention over the gathered
context), :mod:`.regather` (backward gathers K and V again rather than keeping them).
docs/context_parallel.md says what runs where.
"""

from .attention import chunk_mask, context_parallel_attention
from .regather import regathered
from .split import check_sequence, chunks_of, positions, sequence_order, shard, unshard

__all__ = [
    "check_sequence",
    "chunk_mask",
    "chunks_of",
    "context_parallel_attention",
    "positions",
    "regathered",
    "sequence_order",
    "shard",
    "unshard",
]
