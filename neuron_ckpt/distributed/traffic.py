"""Count the collectives a block of code runs, and the bytes each rank sends in them.

``with count_collectives() as calls: ...`` records every collective of
:mod:`neuron_ckpt.distributed.collectives` called inside the block (autograd backwards included)
as a :class:`Collective`: its name, its group's ranks, the input's shape and dtype, and the bytes
this rank sends under the usual ring algorithms, the figures every cost model of the field uses
(Megatron's, TransformerEngine's, the CP facts in docs/context_parallel.md):

========================  ==========================================
collective over n ranks   bytes this rank sends, for an input of B
========================  ==========================================
all-gather                ``(n - 1) B`` (its own rows to every other)
reduce-scatter            ``(n - 1) / n B``
all-reduce                ``2 (n - 1) / n B`` (a reduce-scatter, then an all-gather)
========================  ==========================================

A group of one sends nothing and is not recorded. The count is of what the library asks for, not
of what a backend does underneath (gloo builds a reduce-scatter from an all-to-all here, XLA
lowers each call to one HLO op). For tests and benchmarks: the functions of ``collectives`` are
replaced inside the block (every caller reaches them as module attributes) and put back after it.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from . import collectives as C

_SENT = {
    "all_gather": lambda n, b: (n - 1) * b,
    "all_gather_start": lambda n, b: (n - 1) * b,
    "reduce_scatter": lambda n, b: (n - 1) * b // n,
    "reduce_scatter_start": lambda n, b: (n - 1) * b // n,
    "all_reduce": lambda n, b: 2 * (n - 1) * b // n,
}
_KIND = {"all_gather_start": "all_gather", "reduce_scatter_start": "reduce_scatter"}


@dataclass(frozen=True)
class Collective:
    """One collective call: ``kind`` (``all_gather``, ``reduce_scatter``, ``all_reduce``), the
    group's ``ranks``, the input's ``shape`` and ``dtype``, and ``sent``: bytes this rank sends."""

    kind: str
    ranks: tuple[int, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype
    sent: int


@contextlib.contextmanager
def count_collectives() -> Iterator[list[Collective]]:
    """Yields the list the block's collectives are appended to, in call order (module docstring)."""
    calls: list[Collective] = []
    depth = [0]  # a collective built from another (all_gather -> all_gather_start) counts once
    originals = {name: getattr(C, name) for name in _SENT}

    def counting(name: str):
        original = originals[name]
        signature = inspect.signature(original)

        def call(tensor: torch.Tensor, *args, **kwargs):
            group = signature.bind(tensor, *args, **kwargs).arguments["group"]
            if depth[0] == 0 and group.size > 1:
                sent = _SENT[name](group.size, tensor.numel() * tensor.element_size())
                calls.append(Collective(_KIND.get(name, name), group.ranks, tuple(tensor.shape), tensor.dtype, sent))
            depth[0] += 1
            try:
                return original(tensor, *args, **kwargs)
            finally:
                depth[0] -= 1

        return call

    for name in _SENT:
        setattr(C, name, counting(name))
    try:
        yield calls
    finally:
        for name, fn in originals.items():
            setattr(C, name, fn)


__all__ = ["Collective", "count_collectives"]
