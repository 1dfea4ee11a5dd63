"""ZeRO-1's buckets: a flat cut into ranges that bound every collective, each with its fp32 master.

A flat (:class:`~.flat.FlatLayout`) is cut into buckets of exactly ``bucket_cap_mb`` worth of
elements of the dtype the gradients are reduced in, rounded down to a multiple of DP (the last
bucket is shorter), so every bucket divides by DP and only the last one of a flat carries padding.
A parameter that straddles a cut is split between two buckets, and one larger than the cap spans
several: the cap bounds every collective, whatever the parameter sizes (Neuron produces NaN within
a few steps for collectives above ~140 MB, and an embedding at TP 1 is 262 MB in bf16).
Each bucket has its own fp32 master slice (this rank's ``1/dp`` of it), which is one parameter of
the inner optimizer. An expert flat (:attr:`~.flat.FlatLayout.expert`) is cut the same way over
the expert data-parallel group (:func:`shard_group`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..distributed import collectives
from ..distributed.parallel_state import Group, ParallelState
from ..parallel.params import tensor_parallel_duplicates
from .flat import FlatLayout, Piece

_MB = 2**20


class NormSegment(NamedTuple):
    """Elements ``[start, end)`` of this rank's slice of a bucket, whose squares count ``weight``
    (1 / the TP ranks and pipeline stages holding the same values) in the global gradient norm."""

    start: int
    end: int
    weight: float


@dataclass
class Bucket:
    """Elements ``[start, end)`` of a flat; ``end - start`` divides by DP.

    ``master`` is this rank's fp32 slice of it; ``pieces`` are the runs of the parameters it holds
    (offsets from ``start``); ``norm_segments`` cover this rank's slice with the weight of the
    parameter under each, so the norm needs no per-element weights.
    """

    start: int
    end: int
    master: torch.Tensor
    pieces: list[Piece]
    norm_segments: list[NormSegment]


def bucket_numel(cap_mb: float | None, dtype: torch.dtype, dp: int, padded: int) -> int:
    """Elements per bucket: the cap in ``dtype``, rounded down to a multiple of DP."""
    if cap_mb is None:
        return padded
    itemsize = torch.empty((), dtype=dtype).element_size()
    n = int(cap_mb * _MB) // itemsize // dp * dp
    if n == 0:
        raise ValueError(
            f"bucket_cap_mb={cap_mb} holds {int(cap_mb * _MB) // itemsize} {dtype} elements, fewer than "
            f"dp={dp}: allowed is None or at least {dp * itemsize / _MB:.3g}"
        )
    return n


def shard_group(ps: ParallelState, flat: FlatLayout) -> Group:
    """The group that shards ``flat`` (its gradients reduced, its state split): DP x CP (the
    weights are replicated over CP too), or for the experts the expert data-parallel group (the
    ranks holding the same experts)."""
    return ps.edp if flat.expert else ps.dp_cp


@torch.no_grad()
def cut_buckets(flat: FlatLayout, ps: ParallelState, cap_mb: float | None, reduce_dtype: torch.dtype) -> list[Bucket]:
    """``flat`` cut at ``cap_mb`` (counted in ``reduce_dtype``), masters read from the parameters."""
    group = shard_group(ps, flat)
    dp, r = group.size, group.rank
    step = bucket_numel(cap_mb, reduce_dtype, dp, flat.padded)
    values: list[torch.Tensor | None] = [p.detach() for p in flat.params]
    buckets = []
    for start in range(0, flat.padded, step):
        end = min(start + step, flat.padded)
        shard = (end - start) // dp
        lo = start + r * shard
        master = flat.gather(lo, lo + shard, values, torch.float32)
        norm = _norm_segments(flat, lo, lo + shard, ps.etp.size if flat.expert else ps.tp_size)
        buckets.append(Bucket(start, end, master, flat.pieces(start, end), norm))
    return buckets


def stage_replicas(param: torch.Tensor) -> int:
    """How many pipeline stages hold this parameter's values: 2 for a tied embedding table and LM
    head split over the first and last stage (``LlamaStage`` sets ``param.pipeline_replicas``),
    whose gradients are summed over both ends before the optimizer step; else 1."""
    return int(getattr(param, "pipeline_replicas", 1))


def _norm_segments(flat: FlatLayout, lo: int, hi: int, tp_size: int) -> list[NormSegment]:
    """Where each parameter falls inside this rank's slice ``[lo, hi)`` of the flat (neighbours of
    the same weight merged)."""
    segments: list[NormSegment] = []
    for piece in flat.pieces(lo, hi):
        p = flat.params[piece.index]
        weight = 1.0 / (tensor_parallel_duplicates(p, tp_size) * stage_replicas(p))
        end = piece.offset + piece.last - piece.first
        if segments and segments[-1].end == piece.offset and segments[-1].weight == weight:
            segments[-1] = segments[-1]._replace(end=end)
        else:
            segments.append(NormSegment(piece.offset, end, weight))
    return segments


def copy_into_params(flat: FlatLayout, b: Bucket, gathered: collectives.Pending) -> None:
    """Wait for bucket ``b``'s all-gather and copy it into the parameters it holds."""
    full = gathered.wait()
    for piece in b.pieces:
        p, src = flat.params[piece.index], full[piece.offset : piece.offset + piece.last - piece.first]
        if piece.last - piece.first == p.numel():
            p.copy_(src.view_as(p))
        else:  # the part of a parameter split between buckets that lies in this one
            p.view(-1)[piece.first : piece.last].copy_(src)
