"""RNG streams for tensor parallelism, covering the CPU and the device generator.

Dropout on a tensor-parallel shard (attention probabilities split by head) must differ between
TP ranks, while dropout on replicated activations must agree. Megatron's convention:

* the default stream, seeded with ``seed`` on every rank, is used outside TP regions;
* the ``"model-parallel-rng"`` stream, seeded with ``seed + 2718 + tp_rank``, is used inside
  them via ``with get_rng_tracker().fork(): ...``.

A stream here is the pair (CPU generator state, device generator state). Some peers save only
the CPU state; a dropout on an accelerator or XLA tensor draws from the device generator, so that
one must be saved and restored too. The accelerator's generator is reached through
``torch.get_device_module(type)`` (CUDA, XPU, and a PrivateUse1 device that registers a module
with ``get_rng_state`` / ``set_rng_state``, as TorchNeuron's ``neuron`` does), once that device has
been initialised: capturing it must not be what initialises the device. :func:`get_rng_state` / :func:`set_rng_state` are what
recompute uses to replay a region bit-identically.
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
    """Named RNG streams; ``fork(name)`` runs a block on that stream and then restores."""

    def __init__(self) -> None:
        self.states: dict[str, RNGState] = {}

    def reset(self) -> None:
        self.states = {}

    def add(self, name: str, seed: int) -> None:
        if name in self.states:
            raise ValueError(f"RNG stream {name!r} already exists")
        outer = get_rng_state()
        _seed_all(seed)
        self.states[name] = get_rng_state()
        set_rng_state(outer)

    def get_states(self) -> dict[str, RNGState]:
        return dict(self.states)

    def set_states(self, states: dict[str, RNGState]) -> None:
        self.states = dict(states)

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG):
        if name not in self.states:
            raise RuntimeError(
                f"RNG stream {name!r} is not set: call neuron_ckpt.model_parallel_manual_seed(seed) first"
            )
        outer = get_rng_state()
        set_rng_state(self.states[name])
        try:
            yield
        finally:
            self.states[name] = get_rng_state()
            set_rng_state(outer)


_TRACKER = RNGStatesTracker()


def get_rng_tracker() -> RNGStatesTracker:
    return _TRACKER


def model_parallel_manual_seed(seed: int) -> None:
    """Seed the default stream with ``seed`` and the TP stream with ``seed + 2718 + tp_rank``."""
    tp_rank = get_parallel_state().tp_rank
    _TRACKER.reset()
    _seed_all(seed)
    _TRACKER.add(MODEL_PARALLEL_RNG, seed + TP_SEED_OFFSET + tp_rank)
