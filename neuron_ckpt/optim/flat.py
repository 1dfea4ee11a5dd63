"""Parameters laid end to end: the layout ZeRO-1's buckets and its fp32 gradient buffer share.

The parameters of one (param group, dtype) sit one after another in a *flat* sequence of elements
(each parameter's elements in its own order), padded at its end to a multiple of DP so that every
DP rank's slice of it has the same length. Under expert parallelism the experts (parameters
tagged ``expert_parallel``) get flats of their own, padded to a multiple of the expert
data-parallel size, the group that shards them. A flat is offsets, not a copy: :meth:`FlatLayout.gather`
builds a range of it from tensors laid out like the parameters when one is needed.
:func:`param_groups` says which parameters are laid out (each once, those that require grad) and
:func:`flat_layouts` lays them out, one flat per (param group, dtype).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from ..parallel.params import is_expert_parallel


class Piece(NamedTuple):
    """The run of one parameter inside a range of a flat: its elements ``[first, last)`` sit at
    ``offset`` from the start of the range."""

    index: int  # type: ignore[assignment]  # into the flat's params (shadows tuple.index, unused here)
    first: int
    last: int
    offset: int


@dataclass
class FlatLayout:
    """The parameters of one (param group, dtype) end to end: parameter ``i`` is elements
    ``[offsets[i], offsets[i] + params[i].numel())``; ``numel`` counts them, ``padded`` adds the
    padding to a multiple of DP."""

    group: int
    dtype: torch.dtype
    params: list[torch.Tensor]
    offsets: list[int]
    numel: int
    padded: int
    expert: bool = False
    """Expert-parallel parameters, sharded over the expert data-parallel group rather than DP."""

    @classmethod
    def of(cls, group: int, params: list[torch.Tensor], dp: int, expert: bool = False) -> FlatLayout:
        """``params`` (one dtype) in the order given, padded to a multiple of ``dp``."""
        offsets = [0]
        for p in params[:-1]:
            offsets.append(offsets[-1] + p.numel())
        numel = offsets[-1] + params[-1].numel()
        return cls(group, params[0].dtype, params, offsets, numel, numel + -numel % dp, expert)

    def index(self, param: torch.Tensor) -> int | None:
        """The position of ``param`` (this very tensor) in the flat, or None."""
        return next((i for i, p in enumerate(self.params) if p is param), None)

    def pieces(self, lo: int, hi: int) -> list[Piece]:
        """Runs of parameters inside flat elements ``[lo, hi)``, offsets from ``lo``."""
        out = []
        i = max(bisect.bisect_right(self.offsets, lo) - 1, 0)
        while i < len(self.params) and self.offsets[i] < hi:
            off, n = self.offsets[i], self.params[i].numel()
            a, b = max(lo, off), min(hi, off + n)
            if a < b:
                out.append(Piece(i, a - off, b - off, a - lo))
            i += 1
        return out

    def gather(self, lo: int, hi: int, tensors: list[torch.Tensor | None], dtype: torch.dtype) -> torch.Tensor:
        """Flat elements ``[lo, hi)`` of ``tensors`` (laid out like the params; None reads as
        zeros) as a new 1-D ``dtype`` tensor; padding reads as zeros."""
        device = self.params[0].device
        parts, covered = [], 0
        for piece in self.pieces(lo, hi):
            t, n = tensors[piece.index], piece.last - piece.first
            parts.append(
                torch.zeros(n, dtype=dtype, device=device) if t is None
                else t.reshape(-1)[piece.first : piece.last].to(dtype)
            )  # fmt: skip
            covered += n
        if covered < hi - lo:
            parts.append(torch.zeros(hi - lo - covered, dtype=dtype, device=device))
        return torch.cat(parts)


def param_groups(params: Iterable[torch.Tensor] | Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The param groups, each parameter once (a shared one in the first group that lists it) and
    only those that require grad; ValueError for conflicting or unusable ones."""
    groups: list[Any] = list(params)
    if not groups:
        raise ValueError("Zero1Optimizer got an empty parameter list")
    if not isinstance(groups[0], dict):
        groups = [{"params": groups}]
    seen: dict[int, dict[str, Any]] = {}  # id -> the options of the group that holds it
    out = []
    for g in groups:
        ps = [g["params"]] if isinstance(g["params"], torch.Tensor) else list(g["params"])
        options = {k: v for k, v in g.items() if k != "params"}
        kept = []
        for p in ps:
            if id(p) in seen:  # a shared parameter (a tied embedding / LM head) listed twice: one slot
                if seen[id(p)] != options:
                    raise ValueError(
                        f"Zero1Optimizer: a parameter of shape {tuple(p.shape)} (shared, e.g. a tied embedding) is "
                        f"in two param groups with different options ({seen[id(p)]} and {options}): list it once"
                    )
                continue
            if p.requires_grad and not p.is_contiguous():
                raise ValueError(f"Zero1Optimizer: parameters must be contiguous, got one of shape {tuple(p.shape)}")
            seen[id(p)] = options
            kept.append(p)
        out.append({**g, "params": [p for p in kept if p.requires_grad]})
    if not any(g["params"] for g in out):
        raise ValueError("Zero1Optimizer: no parameter requires grad")
    return out


def flat_layouts(groups: list[dict[str, Any]], dp: int, edp: int | None = None) -> list[FlatLayout]:
    """One flat per (param group, dtype) of ``groups`` (as :func:`param_groups` returns them), in
    group order, then in the order each dtype is first met; parameters in the order listed.
    ``edp`` (under expert parallelism): the experts apart, one flat per (param group, dtype)
    padded to a multiple of ``edp``."""
    out = []
    for i, g in enumerate(groups):
        by_kind: dict[tuple[torch.dtype, bool], list[torch.Tensor]] = {}
        for p in g["params"]:
            by_kind.setdefault((p.dtype, edp is not None and is_expert_parallel(p)), []).append(p)
        out += [FlatLayout.of(i, same, edp if expert else dp, expert) for (_, expert), same in by_kind.items()]  # type: ignore[arg-type]  # edp is set wherever expert is True
    return out
