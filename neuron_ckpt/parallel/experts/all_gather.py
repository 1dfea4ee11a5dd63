"""The static-shape dispatch for XLA: all-gather the EP group's tokens, a fixed buffer per expert,
reduce-scatter the outputs back.

Why this form on XLA: an XLA graph needs shapes known when it is traced, so the number of rows an
expert receives cannot depend on the routing; torch-xla's all-to-all takes no split sizes (its
process group ignores them, and the subgroup too); and trn1's collectives are all-reduce,
all-gather, reduce-scatter and send/recv (Neuron's all-to-all is documented for trn2/trn3 only).
This form uses only the all-gather and the reduce-scatter, with static shapes throughout:

1. the ``T`` tokens of every EP rank are all-gathered with their routing (``N = e T`` tokens;
   backward reduce-scatters each rank's partial gradient, as Megatron's all-gather dispatcher);
2. each local expert gets a buffer of ``capacity`` slots; the routes to it, in gathered-token
   order, fill its slots; routes beyond the capacity are dropped (they add nothing, as an expert
   dropping a token does in Switch and neuronx-distributed) and counted in :attr:`Trip.dropped`
   (a device tensor: reading it syncs the host, so log it in a step closure on XLA); empty slots
   hold a zero row of weight 0;
3. the experts run on the ``E/e x capacity`` slots, each row scaled by its routing weight by the
   experts themselves (transformers' experts multiply by ``top_k_weights``);
4. each slot's output is added at its token's row of an ``[N, h]`` buffer (in fp32: a token's
   ``k`` outputs are added once, as the all-to-all form's sender does), which is reduce-scattered
   over the group in the experts' dtype: every rank gets its own ``T`` tokens' sum over all experts.

Cost per rank and MoE layer against the all-to-all form: the all-gather and the reduce-scatter
move ``(e-1) T h`` elements each way (the all-to-all moves about ``(e-1)/e T k h``: ``e/k`` times
less), and the experts run ``E/e x capacity`` rows (``T k cf`` at a balanced capacity
``capacity_factor`` cf; ``E T`` when dropless, ``E/k`` times the routed rows).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...distributed import collectives as C
from ...distributed.mappings import gather_from_sequence_parallel_region, reduce_scatter_to_sequence_parallel_region
from ...distributed.parallel_state import Group
from .dispatch import Routed


@dataclass
class Trip:
    """What the combine needs from its dispatch, and what was dropped."""

    group: Group
    slot_token: torch.Tensor  # [E/e x capacity]: the gathered token in each slot (N: the zero row)
    tokens: int  # N, the gathered tokens
    dropped: torch.Tensor  # routes to this rank's experts beyond their capacity (int64 scalar)


def dispatch(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    num_experts: int,
    group: Group,
    capacity: int,
) -> tuple[Routed, Trip]:
    """Gather the EP group's ``hidden [T, h]`` and routing (``[T, k]``, global expert ids) and fill
    ``capacity`` slots of each of this rank's experts (module docstring)."""
    local = num_experts // group.size
    x = gather_from_sequence_parallel_region(hidden, group, dim=0)  # [N, h]; backward reduce-scatters
    w = gather_from_sequence_parallel_region(top_k_weights, group, dim=0)  # [N, k]
    ids = C.all_gather(top_k_index, 0, group) - group.rank * local  # [N, k], local ids where mine
    n, k = ids.shape
    mine = (ids >= 0) & (ids < local)
    hits = (ids.unsqueeze(-1) == torch.arange(local, device=ids.device)) & mine.unsqueeze(-1)  # [N, k, E/e]
    hits = hits.reshape(n * k, local).long()
    position = ((hits.cumsum(0) - 1) * hits).sum(-1)  # each route's place in its expert's queue
    kept = mine.reshape(-1) & (position < capacity)
    slot = torch.where(kept, ids.reshape(-1).clamp(0, local - 1) * capacity + position, local * capacity)
    routes_token = torch.arange(n, device=ids.device).repeat_interleave(k)
    slot_token = torch.full((local * capacity + 1,), n, device=ids.device).scatter(0, slot, routes_token)[:-1]
    slot_weight = w.new_zeros(local * capacity + 1).scatter(0, slot, w.reshape(-1))[:-1]
    rows = torch.cat([x, x.new_zeros(1, x.shape[1])])[slot_token]
    experts = torch.arange(local, device=ids.device).repeat_interleave(capacity)
    dropped = mine.sum() - kept.sum()
    return Routed(rows, experts, slot_weight), Trip(group, slot_token, n, dropped)


def combine(out: torch.Tensor, trip: Trip) -> torch.Tensor:
    """Each slot's (already weighted) output added at its token (in at least fp32), reduce-scattered
    in ``out``'s dtype: ``[T, h]``."""
    wide = torch.promote_types(out.dtype, torch.float32)
    summed = torch.zeros(trip.tokens + 1, out.shape[1], dtype=wide, device=out.device)
    summed = summed.index_add(0, trip.slot_token, out.to(wide))[: trip.tokens].to(out.dtype)
    return reduce_scatter_to_sequence_parallel_region(summed, trip.group, dim=0)
