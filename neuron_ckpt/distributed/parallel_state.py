"""Parallel state: this rank's groups in every parallel dimension (TP, CP, EP, DP, PP), as one object.

The layout (which ranks form which group) is :func:`~neuron_ckpt.distributed.layout.parallel_layout`'s:
TP contiguous, then CP, then DP, then PP outermost, and the expert grid (expert TP, EP, expert DP)
over each pipeline stage. With world size 8, ``tensor_parallel_size=2``::

    TP groups: [0,1] [2,3] [4,5] [6,7]      DP groups: [0,2,4,6] [1,3,5,7]

With world size 8, ``tensor_parallel_size=2, pipeline_parallel_size=2``::

    TP groups: [0,1] [2,3] [4,5] [6,7]      DP groups: [0,2] [1,3] [4,6] [5,7]
    PP groups: [0,4] [1,5] [2,6] [3,7]      embedding groups: the same (first and last stage)

With world size 8, ``tensor_parallel_size=2, context_parallel_size=2``::

    TP groups: [0,1] [2,3] [4,5] [6,7]      CP groups: [0,2] [1,3] [4,6] [5,7]
    DP groups: [0,4] [1,5] [2,6] [3,7]      DP x CP groups: [0,2,4,6] [1,3,5,7]

With world size 8, ``tensor_parallel_size=2, expert_model_parallel_size=4``::

    EP groups: [0,1,2,3] [4,5,6,7]          expert DP groups: [0,4] [1,5] [2,6] [3,7]

A PP group is one (dp, cp, tp) column: the ranks that hold the same TP shard of the same replica,
one per stage, so a stage's activation chunk goes to the same TP rank of the next stage. The
embedding group is the first and last rank of each PP group: the stages that hold the input
embedding and the LM head, whose gradients a tied model sums (:mod:`neuron_ckpt.pipeline.tied`).
A kind whose rank lists equal another's shares its communicator (no new process group): without
CP, ``dp_cp`` is ``dp``; without EP, ``edp`` is ``dp_cp`` and ``etp`` is ``tp``. A rank list made
by an earlier :func:`initialize_model_parallel` in this world reuses that communicator too (a gloo
process group lives until ``destroy_process_group()`` and holds three threads, so a fresh one per
call would pile up in a process that initialises many times, as a test worker does); the cache
goes with :func:`neuron_ckpt.destroy_distributed`.
"""

from __future__ import annotations

import datetime
import weakref
from dataclasses import FrozenInstanceError, dataclass
from typing import Any

import torch.distributed as dist

from ..checks import require_positive_int
from . import runtime
from .layout import ParallelLayout, parallel_layout


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


# Process groups made by _new_groups, by (rank list, timeout), for the WORLD they were made in.
_COMMUNICATORS: dict[tuple[tuple[int, ...], float | None], Any] = {}
_COMMUNICATORS_WORLD: list[Any] = []  # the WORLD group of the entries above, when there are any


def _communicator(ranks: list[int]) -> Any:
    """A process group over ``ranks`` (a collective: every rank asks for every list, in the same
    order, so every rank hits or misses the cache alike): the one made earlier in this world, or a
    new one with the default group's timeout."""
    seconds = runtime.collective_timeout_s()
    if not _COMMUNICATORS_WORLD or _COMMUNICATORS_WORLD[0] is not dist.group.WORLD:  # a new world: nothing to reuse
        _COMMUNICATORS.clear()
        _COMMUNICATORS_WORLD[:] = [dist.group.WORLD]
    key = (tuple(ranks), seconds)
    if key not in _COMMUNICATORS:
        # The same timeout as the default group (dist.new_group would use torch's own default).
        timeout = datetime.timedelta(seconds=seconds) if seconds is not None else None
        _COMMUNICATORS[key] = dist.new_group(ranks, timeout=timeout)
    return _COMMUNICATORS[key]


def release_process_groups() -> int:
    """Make every :class:`Group` drop its process group; returns how many did.

    :func:`neuron_ckpt.destroy_distributed` calls this before ``destroy_process_group()``, so the
    process groups die there (while torch.distributed is whole) rather than at interpreter exit.
    """
    groups = list(_HOLDING.values())
    _HOLDING.clear()
    _COMMUNICATORS.clear()
    _COMMUNICATORS_WORLD.clear()
    for group in groups:
        object.__setattr__(group, "_process_group", _RELEASED)
    return len(groups)


@dataclass(frozen=True)
class ParallelState:
    """This rank's place in every parallel dimension (the module docstring names the groups).

    ``pp`` and ``embedding`` are None without pipeline parallelism (a state built by hand with
    ``ParallelState(tp, dp)``): one stage, ``pp_size`` 1. ``embedding`` is also None on a rank of
    a middle stage (it holds neither the embedding nor the head). ``cp`` is None without context
    parallelism and ``ep`` None without expert parallelism (size 1). ``dp_cp``, ``edp`` and
    ``etp`` left None are filled with what they are without CP and EP: ``dp``, ``dp_cp``, ``tp``.
    """

    tp: Group
    dp: Group
    pp: Group | None = None
    embedding: Group | None = None
    cp: Group | None = None
    dp_cp: Group = None  # type: ignore[assignment]  # None: dp, set in __post_init__
    ep: Group | None = None
    edp: Group = None  # type: ignore[assignment]  # None: dp_cp, set in __post_init__
    etp: Group = None  # type: ignore[assignment]  # None: tp, set in __post_init__

    def __post_init__(self) -> None:
        for name, default in (("dp_cp", "dp"), ("edp", "dp_cp"), ("etp", "tp")):
            if getattr(self, name) is None:
                object.__setattr__(self, name, getattr(self, default))

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

    @property
    def cp_size(self) -> int:
        return self.cp.size if self.cp is not None else 1

    @property
    def cp_rank(self) -> int:
        return self.cp.rank if self.cp is not None else 0

    @property
    def ep_size(self) -> int:
        return self.ep.size if self.ep is not None else 1

    @property
    def ep_rank(self) -> int:
        return self.ep.rank if self.ep is not None else 0


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
        whole = len(all_groups) == 1 and len(ranks) == dist.get_world_size()
        pg = dist.group.WORLD if whole else _communicator(ranks)
        if rank in ranks:
            mine = Group(pg, tuple(ranks), tuple(tuple(g) for g in all_groups), ranks.index(rank))
    return mine


def initialize_model_parallel(
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    *,
    context_parallel_size: int = 1,
    expert_model_parallel_size: int = 1,
    expert_tensor_parallel_size: int | None = None,
) -> ParallelState:
    """Create this world's groups in every parallel dimension, as
    :func:`~neuron_ckpt.distributed.layout.parallel_layout` lays them out (TP contiguous, then
    CP, then DP, then PP outermost; experts over ``expert_model_parallel_size`` ranks of each
    stage), and return this rank's :class:`ParallelState`.

    Sizes of 1 (the defaults) give the layout without that dimension, group for group, and no new
    communicator. Every size is checked before any group is created. Initialises
    torch.distributed with :func:`neuron_ckpt.init_distributed` if that has not happened yet.
    """
    global _STATE
    sizes = {
        "tensor_parallel_size": tensor_parallel_size,
        "pipeline_parallel_size": pipeline_parallel_size,
        "context_parallel_size": context_parallel_size,
        "expert_model_parallel_size": expert_model_parallel_size,
    }
    for name, value in sizes.items():
        require_positive_int(name, value)
    rt = runtime.init_distributed() if not dist.is_initialized() else runtime.get_runtime()
    layout = parallel_layout(
        rt.world_size,
        tensor_parallel_size,
        pipeline_parallel_size,
        context_parallel_size=context_parallel_size,
        expert_model_parallel_size=expert_model_parallel_size,
        expert_tensor_parallel_size=expert_tensor_parallel_size,
    )
    if _STATE is not None:
        now = {
            "tensor_parallel_size": _STATE.tp_size,
            "pipeline_parallel_size": _STATE.pp_size,
            "context_parallel_size": _STATE.cp_size,
            "expert_model_parallel_size": _STATE.ep_size,
        }
        if now != sizes:
            held = ", ".join(f"{k}={v}" for k, v in now.items())
            raise ValueError(
                f"model parallel already initialised with {held}; call destroy_model_parallel() before changing it"
            )
        return _STATE
    _STATE = _create_groups(layout, rt.rank)
    return _STATE


def _create_groups(layout: ParallelLayout, rank: int) -> ParallelState:
    """Create every group of ``layout`` (every rank the same calls, in the same order) and return
    this rank's state. A kind whose rank lists equal an earlier kind's reuses its communicator;
    PP, CP and EP of size 1 are None (no group at all)."""
    made: dict[tuple[tuple[int, ...], ...], Group | None] = {}

    def groups(lists: tuple[tuple[int, ...], ...]) -> Group | None:
        if lists not in made:
            made[lists] = _new_groups([list(g) for g in lists], rank)
        return made[lists]

    tp, dp = groups(layout.tp), groups(layout.dp)
    assert tp is not None and dp is not None  # every rank is in one TP and one DP group
    pp = embedding = None
    if layout.pipeline_parallel_size > 1:
        pp = groups(layout.pp)
        embedding = groups(layout.embedding)  # at p = 2 the PP groups themselves
    cp = groups(layout.cp) if layout.context_parallel_size > 1 else None
    ep = groups(layout.ep) if layout.expert_model_parallel_size > 1 else None
    dp_cp, edp, etp = groups(layout.dp_cp), groups(layout.edp), groups(layout.etp)
    assert dp_cp is not None and edp is not None and etp is not None  # every rank is in one of each
    return ParallelState(tp, dp, pp, embedding, cp=cp, dp_cp=dp_cp, ep=ep, edp=edp, etp=etp)


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
