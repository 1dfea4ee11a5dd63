"""Exact measurement of what autograd keeps for backward, on any device.

``SavedTensorRecorder`` installs ``torch.autograd.graph.saved_tensors_hooks`` for the duration
of a forward pass and records every tensor an op saves (what is held at once over the forward
and the backward, recompute included, is :class:`~.live.LiveSavedTensors`). Memory is counted per distinct storage
(several saved views of one buffer cost the buffer once, and a small view keeps its whole
storage alive), leaving out parameters and any buffer the caller names (a shared causal mask is
not an activation).

Choices, and why:

- The pack hook returns the tensor detached (the same storage; autograd rebuilds its history on
  unpack), so the graph holds exactly what it would without the recorder: an op's output that
  the op itself saves, returned with its ``grad_fn``, would hold its own graph alive in a cycle
  through C++ that no garbage collection frees, and a branch dropped in the forward would stay.
  The recorder keeps only a *weak* reference to each storage, its pointer and its size: it never
  extends a tensor's life.
- A storage is identified by (device, data pointer). A pointer alone is ambiguous: if a saved
  tensor dies during the forward (its graph branch was discarded) the allocator may hand the
  same address to a new tensor. When a save arrives at a known address whose storage weak
  reference has expired, it is a new storage and gets a new record.
- Totals count only storages still alive when the recorder exits (or now, if asked inside the
  ``with``): that is what backward will actually find. A saved tensor whose branch was freed
  during the forward costs nothing at the end, and is reported in ``freed_bytes`` instead.
  Exit the recorder before calling backward, which frees what it measured.
- A storage saved in one scope and again in a later one counts once, in the first.
- Ops inside ``torch.utils.checkpoint`` regions save through the checkpoint's own hooks, which
  replace ours (innermost hooks win); only what the checkpoint itself keeps (its inputs) is
  seen, which is exactly the memory it costs.
- Tensors without a storage (some lazy / subclass tensors) are counted by their own
  ``numel * element_size`` without deduplication and listed as ``unshared`` in their record.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.hooks import RemovableHandle

if TYPE_CHECKING:  # typing.Self is Python 3.11+; the package supports 3.10
    from typing_extensions import Self

UNSCOPED = "<unscoped>"

StorageKey = tuple[str, int]


@dataclass(frozen=True)
class SavedStorage:
    """One distinct storage kept for backward: who saved it first, where, and how big."""

    scope: str
    device: str
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]  # of the first tensor saved from it
    times_saved: int
    unshared: bool = False  # no storage to dedupe by; counted as the tensor's own bytes


@dataclass
class _Entry:
    scope: str
    device: str
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    ref: StorageWeakRef | None
    times_saved: int = 1

    def alive(self) -> bool:
        return self.ref is None or not self.ref.expired()

    def frozen(self) -> SavedStorage:
        return SavedStorage(
            self.scope, self.device, self.nbytes, self.dtype, self.shape, self.times_saved, unshared=self.ref is None
        )


def storage_key(tensor: torch.Tensor) -> StorageKey | None:
    """(device, data pointer) of the tensor's storage, or None if it has none."""
    try:
        return str(tensor.device), tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def excluded_keys(modules: Iterable[torch.nn.Module], tensors: Iterable[torch.Tensor]) -> set[StorageKey]:
    """The storage keys to leave out: every parameter of ``modules`` and the ``tensors``."""
    every = [p for m in modules for p in m.parameters()] + list(tensors)
    return {key for key in map(storage_key, every) if key is not None}


class SavedTensorHooks:
    """What the saved-tensor counters share: ``saved_tensors_hooks(self._pack, self._unpack)``
    installed for a ``with`` block, and the storages to leave out (every parameter of
    ``exclude_modules`` and the ``exclude_tensors``: :func:`excluded_keys`) resolved on entry."""

    def __init__(self, exclude_modules: Iterable[torch.nn.Module] = (), exclude_tensors: Iterable[torch.Tensor] = ()):
        self._exclude_modules = list(exclude_modules)
        self._exclude_tensors = list(exclude_tensors)
        self._excluded: set[StorageKey] = set()
        self._hooks: torch.autograd.graph.saved_tensors_hooks | None = None

    def __enter__(self) -> Self:
        if self._hooks is not None:
            raise RuntimeError(f"{type(self).__name__} is not re-entrant; use a new one")
        self._excluded = excluded_keys(self._exclude_modules, self._exclude_tensors)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._hooks is not None
        self._hooks.__exit__(*exc)

    def exclude(self, tensors: Iterable[torch.Tensor]) -> None:
        """Leave these storages out from now on too (tensors a forward makes and hands every
        layer, such as a model's per-layer-type masks, known only once it runs)."""
        self._excluded |= {key for key in map(storage_key, tensors) if key is not None}

    def _pack(self, tensor: torch.Tensor) -> object:
        raise NotImplementedError

    def _unpack(self, packed: object) -> torch.Tensor:
        raise NotImplementedError


class SavedTensorRecorder(SavedTensorHooks):
    """Context manager recording the distinct storages saved for backward during a forward.

    ``exclude_modules``: their parameters are not activations and are left out.
    ``exclude_tensors``: further storages to leave out (shared buffers such as a causal mask).

    Attribute bytes to layers with ``with rec.scope("layer3"):`` or ``rec.attach(...)``.
    """

    def __init__(
        self,
        exclude_modules: Iterable[torch.nn.Module] = (),
        exclude_tensors: Iterable[torch.Tensor] = (),
    ) -> None:
        super().__init__(exclude_modules, exclude_tensors)
        self._live: dict[StorageKey, _Entry] = {}
        self._retired: list[_Entry] = []  # entries whose address was reused by a new storage
        self._unshared: list[_Entry] = []
        self._scopes: list[str] = []
        self._snapshot: tuple[list[SavedStorage], int] | None = None

    # --- lifecycle ---------------------------------------------------------------------
    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        self._snapshot = (self._kept(), self._freed())

    # --- scopes ------------------------------------------------------------------------
    @contextmanager
    def scope(self, name: str) -> Iterator[None]:
        """Attribute storages first saved inside this block to ``name`` (innermost wins)."""
        self._scopes.append(name)
        try:
            yield
        finally:
            self._scopes.pop()

    def attach(self, modules: Mapping[str, torch.nn.Module]) -> list[RemovableHandle]:
        """Scope each module's forward by its name, via forward pre/post hooks.

        Returns the hook handles; call ``.remove()`` on them when done.
        """
        handles = []
        for name, module in modules.items():
            handles.append(module.register_forward_pre_hook(self._push_hook(name)))
            handles.append(module.register_forward_hook(self._pop_hook, always_call=True))
        return handles

    def _push_hook(self, name: str):
        def hook(module: torch.nn.Module, args: object) -> None:
            self._scopes.append(name)

        return hook

    def _pop_hook(self, module: torch.nn.Module, args: object, output: object) -> None:
        self._scopes.pop()

    # --- the hook ----------------------------------------------------------------------
    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        key = storage_key(tensor)
        if key is not None and key in self._excluded:
            return tensor
        scope = self._scopes[-1] if self._scopes else UNSCOPED
        shape, dtype = tuple(tensor.shape), tensor.dtype
        if key is None:
            nbytes = tensor.numel() * tensor.element_size()
            self._unshared.append(_Entry(scope, str(tensor.device), nbytes, dtype, shape, None))
            return tensor.detach()
        entry = self._live.get(key)
        if entry is not None and entry.alive():
            entry.times_saved += 1
            return tensor.detach()
        if entry is not None:  # the old storage died and its address was reused
            self._retired.append(entry)
        storage = tensor.untyped_storage()
        self._live[key] = _Entry(scope, key[0], storage.nbytes(), dtype, shape, StorageWeakRef(storage))
        return tensor.detach()

    # --- results -----------------------------------------------------------------------
    def _entries(self) -> list[_Entry]:
        return self._retired + list(self._live.values()) + self._unshared

    def _kept(self) -> list[SavedStorage]:
        return [e.frozen() for e in self._entries() if e.alive()]

    def _freed(self) -> int:
        return sum(e.nbytes for e in self._entries() if not e.alive())

    @property
    def storages(self) -> list[SavedStorage]:
        """Distinct storages kept for backward (at exit, or now while recording)."""
        return self._snapshot[0] if self._snapshot is not None else self._kept()

    @property
    def total_bytes(self) -> int:
        """Bytes of all distinct storages kept for backward."""
        return sum(s.nbytes for s in self.storages)

    @property
    def freed_bytes(self) -> int:
        """Bytes saved during the forward whose storage was already freed (not kept)."""
        return self._snapshot[1] if self._snapshot is not None else self._freed()

    def bytes_by_scope(self) -> dict[str, int]:
        """Kept bytes per scope, in the order scopes first saved something."""
        out: dict[str, int] = {}
        for s in self.storages:
            out[s.scope] = out.get(s.scope, 0) + s.nbytes
        return out

    def _unpack(self, packed: object) -> torch.Tensor:
        return cast(torch.Tensor, packed)  # _pack gave the tensor itself


def device_peak_bytes(device: torch.device | str) -> int | None:
    """Peak bytes the device allocator has handed out, or None where there is no such counter.

    The accelerator torch has (CUDA, XPU, TorchNeuron's ``neuron``, ...):
    ``torch.accelerator.max_memory_allocated`` (reset it with ``reset_device_peak``); a device
    that is not the current accelerator gets None.
    XLA: ``xm.get_memory_info``'s ``peak_bytes_used`` when torch_xla is installed and the runtime
    reports it (torch-xla 2.6+; None otherwise, e.g. XLA:CPU). Untested here: no XLA device with a memory counter.
    CPU: None; there is no allocator peak to read, use ``SavedTensorRecorder`` instead.
    """
    device = torch.device(device)
    if device.type == "xla":
        return _xla_peak_bytes(device)
    if _is_accelerator(device):
        return torch.accelerator.max_memory_allocated(device)
    return None


def reset_device_peak(device: torch.device | str) -> None:
    """Start a new peak window where the device supports it (the accelerator); a no-op elsewhere."""
    device = torch.device(device)
    if _is_accelerator(device):
        torch.accelerator.reset_peak_memory_stats(device)


def _is_accelerator(device: torch.device) -> bool:
    if device.type == "cpu" or not torch.accelerator.is_available():
        return False
    acc = torch.accelerator.current_accelerator()
    return acc is not None and acc.type == device.type


def _xla_peak_bytes(device: torch.device) -> int | None:
    try:
        import torch_xla.core.xla_model as xm  # imported lazily: optional, heavy
    except ImportError:
        return None
    try:
        info = xm.get_memory_info(device)
    except Exception:  # noqa: BLE001  runtimes without memory info (XLA:CPU) raise various errors
        return None
    # Only a peak: ``bytes_used`` is what is held now, which a caller would misread as one.
    peak = info.get("peak_bytes_used") if isinstance(info, Mapping) else None
    return int(peak) if peak else None
