"""The dropless dispatch: routes sorted by expert, sent with an uneven all-to-all, and back.

For ``T`` tokens of this rank, each routed to ``k`` of ``E`` experts over an EP group of ``e``
ranks (``E/e`` local experts each):

1. the ``T k`` routes are sorted by expert (stable: token order within an expert); since EP rank
   ``j`` holds the contiguous experts ``[j E/e, (j+1) E/e)``, that is also sorted by destination;
2. the per-expert counts ``[E]`` go by an equal-split all-to-all, so every rank learns how many
   rows each source sends to each of its experts; the send and receive splits are read on the
   host (the one host sync per layer the uneven all-to-all needs);
3. the rows (``hidden[token]`` for each route) go by ``all_to_all_single`` with those splits:
   rank ``j`` receives source 0's rows for its experts (expert by expert), then source 1's, ...
   Every route is sent once: nothing is computed twice;
4. the experts run on what they received (each row through one local expert, weight 1);
5. the outputs go back by the same all-to-all with the splits swapped, are put back in route
   order and the sender adds them up weighted by its routing weights, in fp32 when the weights
   are (transformers' grouped_mm sums the same way). The weights never travel: the router's
   gradient is computed where the router ran, exactly.

A rank that receives no rows runs its experts on one zero row of weight 0 (dropped before the
return trip), so its expert weights get a zero gradient rather than none, and both all-to-alls'
backwards run on every rank (an autograd node missing on one rank would leave the others waiting).

Recompute: rerunning a dispatch reruns both exchanges; with routing replayed
(:mod:`neuron_ckpt.recompute.routing`) the counts, and so the splits, are the forward's. The
combine multiplies the returned rows by the weights, an op that saves its input after the last
exchange, so a non-reentrant rerun that stops early stops past both exchanges on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...distributed import collectives as C
from ...distributed.mappings import all_to_all_in_expert_parallel_region
from ...distributed.parallel_state import Group
from .dispatch import Routed


@dataclass
class Trip:
    """What the combine needs from its dispatch."""

    group: Group
    order: torch.Tensor  # [T k]: the routes sorted by expert (indices into the flat routes)
    send: list[int]  # rows sent to each EP rank
    receive: list[int]  # rows received from each EP rank
    shape: tuple[int, int]  # (T, k)


def dispatch(hidden: torch.Tensor, top_k_index: torch.Tensor, num_experts: int, group: Group) -> tuple[Routed, Trip]:
    """Send each route of ``hidden [T, h]`` (experts ``top_k_index [T, k]``, global ids) to the
    EP rank holding its expert; what this rank's experts compute, and the trip back."""
    tokens, k = top_k_index.shape
    e, local = group.size, num_experts // group.size
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    received = C.all_to_all(counts, group)  # from each source, its count for each of my experts
    splits = torch.cat([counts.view(e, local).sum(1), received.view(e, local).sum(1), received]).tolist()
    send, receive, per_expert = splits[:e], splits[e : 2 * e], splits[2 * e :]
    rows = all_to_all_in_expert_parallel_region(hidden[order // k], group, receive, send)
    experts = torch.arange(local, device=flat.device).repeat(e)
    experts = torch.repeat_interleave(experts, torch.tensor(per_expert, device=flat.device), output_size=rows.shape[0])
    weights = rows.new_ones(rows.shape[0])
    if rows.shape[0] == 0:  # one zero row of weight 0: the experts stay in the graph
        rows = torch.cat([rows, rows.new_zeros(1, rows.shape[1])])
        experts, weights = experts.new_zeros(1), weights.new_zeros(1)
    return Routed(rows, experts, weights), Trip(group, order, send, receive, (tokens, k))


def combine(out: torch.Tensor, trip: Trip, top_k_weights: torch.Tensor) -> torch.Tensor:
    """The experts' rows ``out`` back to their senders, weighted and summed per token: ``[T, h]``
    in ``out``'s dtype."""
    tokens, k = trip.shape
    out = out[: sum(trip.receive)]  # without the zero row of an empty receive
    back = all_to_all_in_expert_parallel_region(out, trip.group, trip.send, trip.receive)
    inverse = torch.empty_like(trip.order)
    inverse[trip.order] = torch.arange(trip.order.numel(), device=trip.order.device)
    routes = back[inverse].view(tokens, k, -1)
    return (routes * top_k_weights.unsqueeze(-1)).sum(1).to(out.dtype)
