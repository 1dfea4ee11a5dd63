"""Parallel state: the tensor-, data- and pipeline-parallel groups of this rank, as one object.

Rank layout, as NxD and Megatron lay it out: tensor-parallel ranks are contiguous (a TP group sits
inside a node), then data parallel, then pipeline parallel outermost::

    rank = pp_rank * (dp * tp) + dp_rank * tp + tp_rank

With world size 8, ``tensor_parallel_size=2`` (and ``pipeline_parallel_size=1``, the default)::

    TP groups: [0,1] [2,3] [4,5] [6,7]      DP groups: [0,2,4,6] [1,3,5,7]

With world size 8, ``tensor_parallel_size=2, pipeline_parallel_size=2``::

    TP groups: [0,1] [2,3] [4,5] [6,7]      DP groups: [0,2] [1,3] [4,6] [5,7]
    PP groups: [0,4] [1,5] [2,6] [3,7]      embedding groups: the same (first and last stage)

A PP group is one (dp, tp) column: the ranks that hold the same TP shard of the same replica, one
per stage, so a stage's activation chunk (its TP rank's piece under sequence parallel) goes to the
same TP rank of the next stage. The embedding group is the first and last rank of each PP group:
the stages that hold the input embedding and the LM head, whose gradients a tied model sums
(:mod:`neuron_ckpt.pipeline.tied`). :func:`parallel_layout` gives every group as rank lists
without creating any.
"""

from __future__ import annotations

import datetime
import weakref
from dataclasses import FrozenInstanceError, dataclass
from typing import Any

import torch.distributed as dist

from . import runtime


class Group:
    """One communicator as both APIs want it.

    ``process_group`` is what eager torch.distributed collectives take; ``replica_groups`` (every
    group of this kind, as rank lists) is what XLA collectives take. Immutable: assigning a field
    raises ``FrozenInstanceError``; copies are the group itself.

    A group holding a process group lets go of it in :func:`neuron_ckpt.destroy_distributed`
    (:func:`release_process_groups`): layers, a ``ParallelState`` or autograd nodes that outlive
    the teardown then keep no process group alive, and reading ``process_group`` raises. A gloo
    process group that outlives ``destroy_process_group()`` can abort the interpreter at exit
    ("terminate called without an active exception").
    """

    __slots__ = ("_process_group", "ranks", "replica_groups", "rank", "__weakref__")
    _process_group: Any  # a ProcessGroup, None, or _RELEASED
    ranks: tuple[int, ...]
    replica_groups: tuple[tuple[int, ...], ...]
    rank: int

    def __init__(
        self,
        process_group: dist.ProcessGroup | None,
        ranks: tuple[int, ...],
        replica_groups: tuple[tuple[int, ...], ...],
        rank: int,
    ):
        init = object.__setattr__
        init(self, "_process_group", process_group)
        init(self, "ranks", tuple(ranks))
        init(self, "replica_groups", tuple(tuple(g) for g in replica_groups))
        init(self, "rank", rank)
        if process_group is not None:
            _HOLDING[id(self)] = self

    @property
    def process_group(self) -> dist.ProcessGroup | None:
        pg = self._process_group
        if pg is _RELEASED:
            raise RuntimeError(
                f"the process group of this Group (ranks {self.ranks}) was released by "
                "neuron_ckpt.destroy_distributed(); build the layers again after "
                "init_distributed() / initialize_model_parallel()"
            )
        return pg

    @property
    def released(self) -> bool:
        """True once :func:`release_process_groups` dropped this group's process group."""
        return self._process_group is _RELEASED

    @property
    def size(self) -> int:
        return len(self.ranks)

    def __setattr__(self, name: str, value) -> None:
        raise FrozenInstanceError(f"cannot assign to field {name!r}")

    def __delattr__(self, name: str) -> None:
        raise FrozenInstanceError(f"cannot delete field {name!r}")

    def _key(self) -> tuple:
        return (id(self._process_group), self.ranks, self.replica_groups, self.rank)

    def __eq__(self, other) -> bool:
        return isinstance(other, Group) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __reduce__(self):  # pickling needs process_group None (a ProcessGroup does not pickle)
        return (Group, (self.process_group, self.ranks, self.replica_groups, self.rank))

    def __copy__(self) -> Group:
        return self

    def __deepcopy__(self, memo) -> Group:
        return self  # immutable, and a copied model talks over the same communicator

    def __repr__(self) -> str:
        pg = "<released>" if self.released else repr(self._process_group)
        return f"Group(process_group={pg}, ranks={self.ranks}, replica_groups={self.replica_groups}, rank={self.rank})"


class _Released:
    def __repr__(self) -> str:
        return "<released>"


_RELEASED = _Released()

# Every live Group that holds a process group, by id (weak: a Group dies with its last user).
_HOLDING: weakref.WeakValueDictionary[int, Group] = weakref.WeakValueDictionary()


def release_process_groups() -> int:
    """Make every :class:`Group` drop its process group; returns how many did.

    :func:`neuron_ckpt.destroy_distributed` calls this before ``destroy_process_group()``, so the
    process groups die there (while torch.distributed is whole) rather than at interpreter exit.
    """
    groups = list(_HOLDING.values())
    _HOLDING.clear()
    for group in groups:
        object.__setattr__(group, "_process_group", _RELEASED)
    return len(groups)


@dataclass(frozen=True)
class ParallelState:
    """This rank's place in the tensor-parallel x data-parallel x pipeline-parallel grid.

    ``pp`` and ``embedding`` are None without pipeline parallelism (a state built by hand with
    ``ParallelState(tp, dp)``): one stage, ``pp_size`` 1. ``embedding`` is also None on a rank of
    a middle stage (it holds neither the embedding nor the head).
    """

    tp: Group
    dp: Group
    pp: Group | None = None
    embedding: Group | None = None

    @property
    def pp_size(self) -> int:
        return self.pp.size if self.pp is not None else 1

    @property
    def pp_rank(self) -> int:
        return self.pp.rank if self.pp is not None else 0

    @property
    def is_first_stage(self) -> bool:
        """This rank holds the first pipeline stage (the embedding)."""
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        """This rank holds the last pipeline stage (the head and the loss)."""
        return self.pp_rank == self.pp_size - 1

    @property
    def tp_size(self) -> int:
        return self.tp.size

    @property
    def tp_rank(self) -> int:
        return self.tp.rank

    @property
    def dp_size(self) -> int:
        return self.dp.size

    @property
    def dp_rank(self) -> int:
        return self.dp.rank


_STATE: ParallelState | None = None


class ModelParallelNotInitializedError(ValueError, RuntimeError):
    """A parallel layer was built with no ``parallel_state=`` and no initialised model parallel.

    A ``ValueError`` (the ``parallel_state`` argument is missing) and a ``RuntimeError`` (the
    process is in the wrong state), so either ``except`` catches it.
    """


def _new_groups(all_groups: list[list[int]], rank: int) -> Group | None:
    """Create every group (a collective: every rank creates every group, in the same order) and
    return this rank's, or None when no group holds it (a middle stage's embedding group)."""
    mine = None
    for ranks in all_groups:
        # The same timeout as the default group (dist.new_group would use torch's own default).
        seconds = runtime.collective_timeout_s()
        timeout = datetime.timedelta(seconds=seconds) if seconds is not None else None
        whole = len(all_groups) == 1 and len(ranks) == dist.get_world_size()
        pg = dist.group.WORLD if whole else dist.new_group(ranks, timeout=timeout)
        if rank in ranks:
            mine = Group(pg, tuple(ranks), tuple(tuple(g) for g in all_groups), ranks.index(rank))
    return mine


@dataclass(frozen=True)
class ParallelLayout:
    """Every group of each kind as rank lists (see the module docstring for the layout)."""

    tp: tuple[tuple[int, ...], ...]
    dp: tuple[tuple[int, ...], ...]
    pp: tuple[tuple[int, ...], ...]
    embedding: tuple[tuple[int, ...], ...]


def _positive(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def parallel_layout(world_size: int, tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1) -> ParallelLayout:
    """The groups of a world of ``world_size`` ranks: TP contiguous, then DP, then PP.

    Pure (creates no process group); raises a one-line ValueError when the sizes do not fit.
    """
    _positive("world_size", world_size)
    _positive("tensor_parallel_size", tensor_parallel_size)
    _positive("pipeline_parallel_size", pipeline_parallel_size)
    t, p = tensor_parallel_size, pipeline_parallel_size
    if world_size % (t * p):
        allowed = [d for d in range(1, world_size + 1) if world_size % d == 0]
        sizes = f"tensor_parallel_size={t}" + (f" x pipeline_parallel_size={p} = {t * p}" if p > 1 else "")
        raise ValueError(f"{sizes} does not divide the world size {world_size}; allowed: {allowed}")
    d = world_size // (t * p)

    def rank(pp: int, dp: int, tp: int) -> int:
        return pp * d * t + dp * t + tp

    tp = tuple(tuple(rank(i, j, k) for k in range(t)) for i in range(p) for j in range(d))
    dp = tuple(tuple(rank(i, j, k) for j in range(d)) for i in range(p) for k in range(t))
    pp = tuple(tuple(rank(i, j, k) for i in range(p)) for j in range(d) for k in range(t))
    embedding = tuple(tuple(sorted({g[0], g[-1]})) for g in pp)
    return ParallelLayout(tp, dp, pp, embedding)


def initialize_model_parallel(tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1) -> ParallelState:
    """Lay the world out as tensor-parallel groups of ``tensor_parallel_size`` contiguous ranks,
    ``pipeline_parallel_size`` pipeline stages outermost, and data parallel in between.

    ``pipeline_parallel_size=1`` (the default) is the layout without pipeline parallelism, group
    for group. Initialises torch.distributed with :func:`neuron_ckpt.init_distributed` if that has
    not happened yet.
    """
    global _STATE
    _positive("tensor_parallel_size", tensor_parallel_size)
    _positive("pipeline_parallel_size", pipeline_parallel_size)
    rt = runtime.init_distributed() if not dist.is_initialized() else runtime.get_runtime()
    layout = parallel_layout(rt.world_size, tensor_parallel_size, pipeline_parallel_size)
    if _STATE is not None:
        if (_STATE.tp_size, _STATE.pp_size) != (tensor_parallel_size, pipeline_parallel_size):
            raise ValueError(
                f"model parallel already initialised with tensor_parallel_size={_STATE.tp_size}, "
                f"pipeline_parallel_size={_STATE.pp_size}; call destroy_model_parallel() before changing it"
            )
        return _STATE
    tp, dp = (_new_groups([list(g) for g in getattr(layout, name)], rt.rank) for name in ("tp", "dp"))
    assert tp is not None and dp is not None  # every rank is in one TP and one DP group
    pp = embedding = None
    if pipeline_parallel_size > 1:  # without PP no new communicator (and no new process group)
        pp = _new_groups([list(g) for g in layout.pp], rt.rank)
        # At p = 2 the embedding groups are the PP groups: the same communicators serve both.
        embedding = pp if layout.embedding == layout.pp else _new_groups([list(g) for g in layout.embedding], rt.rank)
    _STATE = ParallelState(tp, dp, pp, embedding)
    return _STATE


def get_parallel_state() -> ParallelState:
    """The state set by :func:`initialize_model_parallel`; a clear error if it was not called."""
    if _STATE is None:
        raise ModelParallelNotInitializedError(
            "model parallel is not initialised: call "
            "neuron_ckpt.initialize_model_parallel(tensor_parallel_size=...) before building "
            "parallel layers, or pass parallel_state= explicitly"
        )
    return _STATE


def model_parallel_is_initialized() -> bool:
    return _STATE is not None


def destroy_model_parallel() -> None:
    """Forget the parallel state (the groups stay usable until :func:`neuron_ckpt.destroy_distributed`)."""
    global _STATE
    _STATE = None
