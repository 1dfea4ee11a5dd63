"""RNG streams for tensor parallelism, covering the CPU and the device generator.

Dropout on a tensor-parallel shard (attention probabilities split by head) must differ between
TP ranks, while dropout on replicated activations must agree. Megatron's convention:

* the default stream, seeded with ``seed`` on every rank, is used outside TP regions;
* the ``"model-parallel-rng"`` stream, seeded with ``seed + 2718 + tp_rank``, is used inside
  them via ``with get_rng_tracker().fork(): ...``. Under context parallelism the CP ranks hold
  different queries of the same heads, so the stream is per (TP, CP) rank:
  ``seed + 2718 + tp_rank + tp_size * cp_rank`` (the same as before at CP 1).

A stream here is the pair (CPU generator state, device generator state). Some peers save only
the CPU state; a dropout on an accelerator or XLA tensor draws from the device generator, so that
one must be saved and restored too. The accelerator's generator is reached through
``torch.get_device_module(type)`` (CUDA, XPU, and a PrivateUse1 device that registers a module
with ``get_rng_state`` / ``set_rng_state``, as TorchNeuron's ``neuron`` does), once that device has
been initialised: capturing it must not be what initialises the device. :func:`get_rng_state` /
:func:`set_rng_state` are what recompute uses to replay a region bit-identically.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from . import runtime
from .parallel_state import get_parallel_state

MODEL_PARALLEL_RNG = "model-parallel-rng"
TP_SEED_OFFSET = 2718


@dataclass
class RNGState:
    """A snapshot of every generator a forward pass may draw from."""

    cpu: torch.Tensor
    device: object | None  # accelerator: its module's get_rng_state(); XLA: int seed state; CPU: None


def _device_kind() -> str:
    """``xla``, the accelerator's device type when its generator can be captured, or ``cpu``."""
    if runtime.is_xla():
        return "xla"
    acc = runtime.accelerator_type()
    if acc is None:
        return "cpu"
    module = torch.get_device_module(acc)
    if not (hasattr(module, "get_rng_state") and hasattr(module, "set_rng_state")):
        return "cpu"
    is_initialized = getattr(module, "is_initialized", None)
    return acc if is_initialized is None or is_initialized() else "cpu"


def get_rng_state() -> RNGState:
    kind = _device_kind()
    if kind == "xla":
        import torch_xla.core.xla_model as xm

        dev = xm.get_rng_state()
    elif kind != "cpu":
        dev = torch.get_device_module(kind).get_rng_state()
    else:
        dev = None
    return RNGState(cpu=torch.get_rng_state(), device=dev)


def set_rng_state(state: RNGState) -> None:
    torch.set_rng_state(state.cpu)
    if state.device is None:
        return
    kind = _device_kind()
    if kind == "xla":
        import torch_xla.core.xla_model as xm

        xm.set_rng_state(state.device)
    elif kind != "cpu":
        torch.get_device_module(kind).set_rng_state(state.device)


def _seed_all(seed: int) -> None:
    torch.manual_seed(seed)  # seeds CPU and every accelerator device (CUDA, XPU, PrivateUse1)
    if _device_kind() == "xla":
        import torch_xla.core.xla_model as xm

        xm.set_rng_state(seed)


class RNGStatesTracker:
    """Named RNG streams; ``with tracker.fork(name):`` draws from stream ``name``.

    Each stream is an independent sequence, and so is the default stream (the generators outside
    every fork): forks nest in any order, the same stream included, and every stream continues
    where it stopped, as if the forks had not been nested. ``fork`` parks the live generator state
    in the stream it belongs to (the innermost open fork's, or the default stream's) before it
    switches, and switches back to that stream's latest state when it ends. No two streams share a
    name or a seed: the same seed in two streams draws the same dropout masks in both
    (Megatron's tracker refuses it too).
    """

    def __init__(self) -> None:
        self.states: dict[str, RNGState] = {}
        self.seeds: dict[str, int] = {}
        self._open: list[str] = []  # the forks in progress, innermost last
        self._default: RNGState | None = None  # the default stream, parked while a fork is open

    def reset(self) -> None:
        if self._open:
            raise RuntimeError(f"RNG tracker: cannot reset inside fork({self._open[-1]!r})")
        self.states, self.seeds = {}, {}

    def add(self, name: str, seed: int) -> None:
        if name in self.states:
            raise ValueError(f"RNG stream {name!r} already exists (seed {self.seeds.get(name)})")
        taken = next((other for other, s in self.seeds.items() if s == seed), None)
        if taken is not None:
            raise ValueError(
                f"RNG stream {name!r}: seed {seed} is already the seed of stream {taken!r}; two streams "
                "with one seed draw the same numbers (the same dropout masks): choose another seed"
            )
        outer = get_rng_state()
        _seed_all(seed)
        self.states[name] = get_rng_state()
        self.seeds[name] = seed
        set_rng_state(outer)

    def get_states(self) -> dict[str, RNGState]:
        """Each stream's state as of its last fork's end (Megatron's ``get_states``)."""
        return dict(self.states)

    def set_states(self, states: dict[str, RNGState]) -> None:
        self.states = dict(states)

    def snapshot(self) -> TrackerSnapshot:
        """Everything :meth:`restore` needs to replay from here, inside open forks too."""
        return TrackerSnapshot(dict(self.states), tuple(self._open), self._default)

    def restore(self, snap: TrackerSnapshot) -> None:
        self.states, self._open, self._default = dict(snap.states), list(snap.open), snap.default

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG):
        if name not in self.states:
            raise RuntimeError(
                f"RNG stream {name!r} is not set: call neuron_ckpt.model_parallel_manual_seed(seed) first"
            )
        self._park(get_rng_state())
        set_rng_state(self.states[name])
        self._open.append(name)
        try:
            yield
        finally:
            self.states[name] = get_rng_state()
            self._open.pop()
            if self._open:
                set_rng_state(self.states[self._open[-1]])
            else:
                assert self._default is not None  # parked when the first fork opened
                set_rng_state(self._default)
                self._default = None

    def _park(self, live: RNGState) -> None:
        if self._open:
            self.states[self._open[-1]] = live
        else:
            self._default = live


@dataclass(frozen=True)
class TrackerSnapshot:
    """The tracker's streams, open forks and parked default stream at one moment."""

    states: dict
    open: tuple
    default: RNGState | None


_TRACKER = RNGStatesTracker()


def get_rng_tracker() -> RNGStatesTracker:
    return _TRACKER


def model_parallel_manual_seed(seed: int) -> None:
    """Seed the default stream with ``seed`` and the TP stream with ``seed + 2718 + tp_rank``
    (``+ tp_size * cp_rank`` under context parallelism).

    What it does to the default generators, and why: it calls ``torch.manual_seed(seed)`` (the CPU
    generator and every accelerator's; on XLA also ``xm.set_rng_state(seed)``) with the same
    ``seed`` on every rank. Whatever is drawn outside a fork is then the same on every rank: dropout
    on activations that are replicated over the tensor-parallel group must be, or the replicas
    drift apart. Data-parallel ranks draw the same masks too, on different data, as Megatron does
    by default. Anything else that draws from torch's global generators afterwards (parameter
    initialisation, a ``torch.randperm`` data order) starts from ``seed`` as well. Megatron's
    ``model_parallel_cuda_manual_seed`` seeds only the CUDA generator; ours seeds the CPU one too,
    because dropout on CPU tensors draws from it.

    Context parallelism: Megatron and torchtitan give every CP rank the same streams, so the CP
    ranks draw the same attention-dropout masks, each on its own queries (masks correlated along
    the sequence). Here each CP rank's model-parallel stream is its own, as each TP rank's is: the
    masks of the whole ``[s, s]`` attention are independent draws, as at CP 1 (not the same
    draws: a CP run matches a CP 1 run with attention dropout off). The default stream stays one
    seed everywhere (what is drawn outside forks must agree across the replicas of a weight).

    The tracker is reset first: every other stream is dropped, and the TP stream restarts from its
    seed. Not allowed inside a fork.
    """
    ps = get_parallel_state()
    _TRACKER.reset()
    _seed_all(seed)
    _TRACKER.add(MODEL_PARALLEL_RNG, seed + TP_SEED_OFFSET + ps.tp_rank + ps.tp_size * ps.cp_rank)
