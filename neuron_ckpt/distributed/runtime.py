"""Process-level runtime: which device drives this process, which backend talks between ranks.

This is the one module that reads launcher environment variables (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``, ``PJRT_DEVICE``), and the one that names devices
or asks torch which accelerator it has. Layers never do.

Device and backend, unless ``backend=`` overrides them:

* ``xla`` when torch-xla drives the device: torch-neuronx is importable together with torch-xla
  (trn1, Neuron SDK 2.28: AWS tells XLA training users to stay there), or ``PJRT_DEVICE`` is set
  and torch-xla is importable;
* otherwise the accelerator ``torch.accelerator`` reports (``neuron`` under TorchNeuron on
  trn2/trn3, ``cuda``, ``xpu``, ... any device torch registers), one per local rank, with the
  backend torch registers as that device's default
  (``torch.distributed.get_default_backend_for_device``: ``nccl`` for cuda, ``xccl`` for xpu);
* ``cpu`` with ``gloo`` when there is no accelerator.

An explicit eager backend that is not the accelerator's default (``backend="gloo"`` on a GPU or
Trainium host) runs on the host CPU. torch-neuronx without torch-xla and without an accelerator
torch can see is refused rather than quietly training on the host CPU: it is a TorchNeuron SDK
(2.30 or later) on a machine with no NeuronCore visible, or a trn1 venv missing torch-xla.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib.util
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Runtime:
    """What :func:`init_distributed` set up for this process."""

    backend: str
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    host_group: dist.ProcessGroup | None = None
    """When the default group is not gloo (XLA, nccl, xccl, TorchNeuron's), a gloo group of all
    ranks for host-side agreement (:mod:`.host`): on XLA, ``xm.rendezvous`` runs a device graph and
    reads its result back each time; elsewhere a flag on the device would sync it. None on gloo
    (the default group is the host group), and after :func:`neuron_ckpt.destroy_distributed`."""


_RUNTIME: Runtime | None = None
_TIMEOUT_S: float | None = None


def _module_available(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


NEURON_WITHOUT_XLA = (
    "torch-neuronx is installed but torch-xla is not, and torch sees no accelerator "
    "(torch.accelerator.is_available() is False). A Neuron SDK of 2.30 or later (TorchNeuron) trains "
    "on trn2/trn3 through the native 'neuron' device, which torch does not see on this machine. "
    "Training on trn1 needs Neuron SDK 2.28 (torch-neuronx 2.9 with torch-xla 2.9; AWS tells XLA training users "
    'to stay on it): activate that SDK\'s venv and pip install -e ".[trn1,tutorial]" -c constraints-trn1.txt '
    "(docs/trainium.md). Pass "
    "backend='gloo' to train on the host CPU instead."
)


def backends() -> tuple[str, ...]:
    """Backends ``init_distributed(backend=...)`` accepts: ``xla`` and every backend torch
    registers as some device's default (gloo, nccl, xccl, and a PrivateUse1 device's own), except
    torch's testing-only ``fake`` process group."""
    defaults = dist.Backend.default_device_backend_map.values()
    return ("xla", *sorted(set(defaults) - {"xla", "fake"}))


def accelerator_type() -> str | None:
    """The accelerator torch has in this process (``neuron``, ``cuda``, ``xpu``, ...), or None
    when there is none. From ``torch.accelerator``, so a PrivateUse1 device counts too."""
    if not torch.accelerator.is_available():
        return None
    acc = torch.accelerator.current_accelerator()
    return None if acc is None else acc.type


def _xla_drives_device() -> bool:
    if not _module_available("torch_xla"):
        return False
    return _module_available("torch_neuronx") or bool(os.environ.get("PJRT_DEVICE"))


def _default_backend(device_type: str) -> str:
    try:
        return dist.get_default_backend_for_device(device_type)
    except ValueError:
        raise RuntimeError(
            f"torch.distributed has no default backend for the {device_type!r} device (its torch "
            f"extension registered none); pass init_distributed(backend=...), one of {backends()}"
        ) from None


def detect_device_type() -> str:
    """The device type this process would use: ``xla``, the accelerator's, or ``cpu``."""
    if _xla_drives_device():
        return "xla"
    acc = accelerator_type()
    if acc is None and _module_available("torch_neuronx"):
        raise RuntimeError(NEURON_WITHOUT_XLA)
    return acc or "cpu"


def detect_backend() -> str:
    """The backend this process would use: ``xla``, or torch's default for the device type of
    :func:`detect_device_type` (``gloo`` on CPU)."""
    return _select(None)[0]


def _select(backend: str | None) -> tuple[str, str]:
    """``(backend, device type)`` for ``init_distributed(backend=...)``."""
    if backend is None:
        device_type = detect_device_type()
        return ("xla" if device_type == "xla" else _default_backend(device_type)), device_type
    if backend == "xla":
        return "xla", "xla"
    acc = accelerator_type()
    if acc is not None and backend == dist.Backend.default_device_backend_map.get(acc):
        return backend, acc
    return backend, "cpu"  # e.g. gloo on a GPU or Trainium host: train on the host CPU


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it), for a rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _xla_rendezvous_env(launched: bool):
    """xla:// opens a TCPStore on MASTER_ADDR:MASTER_PORT, by default localhost:12355: a fixed
    port, so two plain single-process runs on one host would collide. Without a launcher, use a
    free port for the rendezvous only (not left in the environment child processes inherit)."""
    if launched or "MASTER_PORT" in os.environ:
        yield
        return
    saved = os.environ.get("MASTER_ADDR")
    os.environ.update(MASTER_ADDR=saved or "127.0.0.1", MASTER_PORT=str(free_port()))
    try:
        yield
    finally:
        del os.environ["MASTER_PORT"]
        if saved is None:
            del os.environ["MASTER_ADDR"]


def _device_for(device_type: str, local_rank: int) -> torch.device:
    if device_type == "xla":
        import torch_xla

        return torch_xla.device()
    if device_type == "cpu":
        return torch.device("cpu")
    torch.accelerator.set_device_index(local_rank)
    return torch.device(device_type, local_rank)


def init_distributed(backend: str | None = None, timeout_s: float = 1800.0) -> Runtime:
    """Initialise ``torch.distributed`` for this process and return the :class:`Runtime`.

    Works under ``torchrun`` (any world size) and as a plain single process (world size 1, no
    launcher needed). Calling it again returns the existing runtime.

    ``timeout_s``: how long a collective (and the rendezvous) may wait for the other ranks before
    it raises; it applies to the default group and to ``host_group``
    (:func:`collective_timeout_s` returns it; :func:`~.parallel_state.initialize_model_parallel`
    gives the TP and DP groups the same).
    """
    global _RUNTIME, _TIMEOUT_S
    if backend is not None and backend not in backends():
        raise ValueError(f"backend must be one of {backends()} or None (auto), got {backend!r}")
    if _RUNTIME is not None and dist.is_initialized():
        if backend is not None and backend != _RUNTIME.backend:
            raise ValueError(
                f"backend={backend!r} requested but torch.distributed already runs "
                f"{_RUNTIME.backend!r}; call destroy_distributed() first"
            )
        return _RUNTIME
    backend, device_type = _select(backend)
    timeout = datetime.timedelta(seconds=timeout_s)
    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    local_rank = int(os.environ.get("LOCAL_RANK", "0")) if launched else 0

    _TIMEOUT_S = None if dist.is_initialized() else float(timeout_s)  # already initialised: not ours
    if not dist.is_initialized():
        if backend == "xla":
            import torch_xla.distributed.xla_backend  # noqa: F401  registers the "xla" backend

            with _xla_rendezvous_env(launched):
                dist.init_process_group("xla", init_method="xla://", timeout=timeout)
        elif launched:
            dist.init_process_group(backend, init_method="env://", timeout=timeout)
        else:
            dist.init_process_group(
                backend,
                init_method=f"tcp://127.0.0.1:{free_port()}",
                rank=0,
                world_size=1,
                timeout=timeout,
            )
    _RUNTIME = Runtime(
        backend=backend,
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=local_rank,
        device=_device_for(device_type, local_rank),
        host_group=dist.new_group(backend="gloo", timeout=timeout) if dist.get_backend() != "gloo" else None,
    )
    return _RUNTIME


def collective_timeout_s() -> float | None:
    """The ``timeout_s`` :func:`init_distributed` initialised torch.distributed with (None when
    it found torch.distributed already initialised, or has not run)."""
    return _TIMEOUT_S if dist.is_initialized() else None


def get_runtime() -> Runtime:
    """The runtime set up by :func:`init_distributed`; raises if there is none."""
    if _RUNTIME is None or not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised: call neuron_ckpt.init_distributed() first")
    return _RUNTIME


def is_xla() -> bool:
    """True when this process runs on torch-xla (NeuronCores or XLA:CPU)."""
    return _RUNTIME is not None and _RUNTIME.backend == "xla"


def step_boundary(wait: bool = False) -> None:
    """On XLA, end the graph traced so far here and run it (``torch_xla.sync``; ``mark_step`` on
    older torch-xla); ``wait``: also wait until the device is done. A no-op on eager backends,
    where every op has already run. The training step, checkpoint loading and the HF export cut
    their graphs through this one function."""
    if not is_xla():
        return
    import torch_xla
    import torch_xla.core.xla_model as xm

    (getattr(torch_xla, "sync", None) or xm.mark_step)()
    if wait:
        xm.wait_device_ops()


def destroy_runtime() -> None:
    """Forget the runtime, drop its ``host_group``, then ``destroy_process_group()`` (WORLD included).

    The last step of :func:`neuron_ckpt.destroy_distributed`, which first makes every
    :class:`~.parallel_state.Group` let go of its process group: call that instead. A
    :class:`Runtime` the caller kept reads ``host_group`` None afterwards (frozen, but the group
    must not outlive this call).
    """
    global _RUNTIME
    rt, _RUNTIME = _RUNTIME, None
    if rt is not None and rt.host_group is not None:
        object.__setattr__(rt, "host_group", None)
    del rt
    if dist.is_initialized():
        dist.destroy_process_group()
