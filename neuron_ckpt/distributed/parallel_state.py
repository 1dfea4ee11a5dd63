"""Parallel state: the tensor-parallel and data-parallel groups of this rank, as one object.

Rank layout: tensor-parallel ranks are contiguous (a TP group sits inside a node), data-parallel
groups stride across them. With world size 8 and ``tensor_parallel_size=2``::

    TP groups: [0,1] [2,3] [4,5] [6,7]      DP groups: [0,2,4,6] [1,3,5,7]
"""

from __future__ import annotations

import datetime

import weakref
from dataclasses import FrozenInstanceError, dataclass

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

    def __copy__(self) -> "Group":
        return self

    def __deepcopy__(self, memo) -> "Group":
        return self  # immutable, and a copied model talks over the same communicator

    def __repr__(self) -> str:
        pg = "<released>" if self.released else repr(self._process_group)
        return (
            f"Group(process_group={pg}, ranks={self.ranks}, replica_groups={self.replica_groups}, "
            f"rank={self.rank})"
        )


class _Released:
    def __repr__(self) -> str:
        return "<released>"


_RELEASED = _Released()

# Every live Group that holds a process group, by id (weak: a Group dies with its last user).
_HOLDING: "weakref.WeakValueDictionary[int, Group]" = weakref.WeakValueDictionary()


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
    """This rank's place in the tensor-parallel x data-parallel grid."""

    tp: Group
    dp: Group

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


def _new_groups(all_groups: list[list[int]], rank: int) -> Group:
    mine = None
    for ranks in all_groups:
        # new_group is collective: every rank creates every group, in the same order.
        # The same timeout as the default group (dist.new_group would use torch's own default).
        seconds = runtime.collective_timeout_s()
        timeout = datetime.timedelta(seconds=seconds) if seconds is not None else None
        pg = dist.new_group(ranks, timeout=timeout) if len(all_groups) > 1 else dist.group.WORLD
        if rank in ranks:
            mine = Group(pg, tuple(ranks), tuple(tuple(g) for g in all_groups), ranks.index(rank))
    assert mine is not None
    return mine


def initialize_model_parallel(tensor_parallel_size: int = 1) -> ParallelState:
    """Split the world into tensor-parallel groups of ``tensor_parallel_size`` contiguous ranks.

    The remaining factor of the world size is data parallel. Initialises torch.distributed
    with :func:`neuron_ckpt.init_distributed` if that has not happened yet.
    """
    global _STATE
    if not isinstance(tensor_parallel_size, int) or tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size must be a positive int, got {tensor_parallel_size!r}")
    rt = runtime.init_distributed() if not dist.is_initialized() else runtime.get_runtime()
    world = rt.world_size
    if world % tensor_parallel_size:
        raise ValueError(
            f"tensor_parallel_size={tensor_parallel_size} does not divide the world size {world}; "
            f"allowed: {[d for d in range(1, world + 1) if world % d == 0]}"
        )
    if _STATE is not None:
        if _STATE.tp_size != tensor_parallel_size:
            raise ValueError(
                f"model parallel already initialised with tensor_parallel_size={_STATE.tp_size}; "
                "call destroy_model_parallel() before changing it"
            )
        return _STATE
    t = tensor_parallel_size
    dp_size = world // t
    tp_groups = [list(range(i * t, (i + 1) * t)) for i in range(dp_size)]
    dp_groups = [list(range(j, world, t)) for j in range(t)]
    _STATE = ParallelState(tp=_new_groups(tp_groups, rt.rank), dp=_new_groups(dp_groups, rt.rank))
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
