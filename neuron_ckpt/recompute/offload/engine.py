"""What a saved tensor becomes when it is offloaded, and how backward gets it back.

* A :class:`HostCopy` is one device *storage* copied to host, started when the first saved
  tensor viewing it is packed. Several saved tensors of one storage (views, the same tensor saved
  twice, a storage saved by two modules or two layers) share it: the bytes cross once, and come
  back as views of one reloaded storage, with their own size, stride and offset (the geometry
  autograd saw). A storage saved again after an in-place write (a new version) gets a new copy.
* A :class:`Handle` is what autograd keeps instead of the tensor: the copy and the view's geometry.
  Unpacking it reloads the storage (once for all its handles; a prefetch may have started it) and
  waits for the reload on the compute stream.
* A :class:`LayerRun` is one forward of one layer: the copies its modules made, and the run of the
  nearest earlier layer that offloaded something, which backward reloads next (the prefetch).

Memory: autograd holds the handles, the handles their copies and their layer's run; nothing here
holds a handle. So a host copy lives exactly as long as the saved tensors it stands for (freed with
the graph after backward, kept for a ``retain_graph`` backward), and the reloaded device storage
as long as an unpacked view uses it: the copy drops its own reference once every handle of it has
been unpacked (a second backward reloads again).

The device storage is held until its copy to host has completed (edge d of :mod:`.copies`): it
is let go as soon as the copy's event says so (:meth:`Offloader.poll`, at every group's and
layer's end), and at the latest when the second offloading layer after it starts its forward,
after the compute stream waits for the copy (:meth:`Offloader.settle`: what a copy slower than a
layer's compute costs, and the bound on what is in flight: the offloaded bytes of the layer
running and the one before it). The device memory is actually freed once nothing else holds the
storage. What else may hold it (a
tensor a module keeps in the forward's locals until it returns, the same storage saved by a
module that is not offloaded, a parameter) is why parameters and the layer's buffers are never
offloaded, and why a storage also kept on the device costs host memory and a copy for nothing.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from .copies import Copies


@dataclass
class OffloadStats:
    """What offload moved since the last :meth:`reset`: ``bytes`` by unit (``"3.mlp"``; each storage
    counted once, in the first unit that saved it), copies to host, reloads, how many reloads a
    prefetch started before backward needed them (the rest ran at the moment of use), and how many
    copies to host the compute stream had to wait for (``settled``: not done one layer later)."""

    bytes: dict[str, int] = field(default_factory=dict)
    copies: int = 0
    reloads: int = 0
    prefetched: int = 0
    settled: int = 0

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes.values())

    def reset(self) -> None:
        self.bytes.clear()
        self.copies = self.reloads = self.prefetched = self.settled = 0


class HostCopy:
    """One device storage on host: the copy to host, and the reload backward waits for."""

    def __init__(self, copies: Copies, storage: torch.UntypedStorage, device: torch.device, version: int):
        self.copies, self.device, self.version = copies, device, version
        self.ref = StorageWeakRef(storage)  # the same storage while it lives (see Offloader.pack)
        source = torch.empty(0, dtype=torch.uint8, device=device).set_(storage)  # the whole storage, as bytes
        self.nbytes = source.numel()
        self.host, self.offloaded = copies.offload(source)
        self.source: torch.Tensor | None = source  # held until the copy to host has completed (edge d)
        self.handles = 0  # saved tensors viewing it
        self.reloaded: torch.Tensor | None = None
        self.reload_event: Any = None
        self.unpacks_left = 0

    def is_copy_of(self, storage: torch.UntypedStorage, version: int) -> bool:
        return not self.ref.expired() and self.ref.cdata == storage._cdata and self.version == version

    def release(self, stats: OffloadStats, force: bool) -> bool:
        """Let the device storage go if its copy to host has completed; with ``force``, make the
        compute stream wait for the copy first (the storage is then freed in that stream's order).
        Whether it is let go."""
        if self.source is None:
            return True
        if not force and not self.copies.done(self.offloaded):
            return False
        if force and not self.copies.done(self.offloaded):
            self.copies.wait(self.offloaded)
            stats.settled += 1
        self.source = None
        return True

    def start_reload(self, stats: OffloadStats, prefetch: bool) -> None:
        self.release(stats, force=True)  # never the source and its reload at once
        if self.reloaded is None:
            self.reloaded, self.reload_event = self.copies.reload(self.host, self.device, after=self.offloaded)
            self.unpacks_left = self.handles
            stats.reloads += 1
            stats.prefetched += prefetch

    def take(self, stats: OffloadStats) -> torch.Tensor:
        """The reloaded storage (as bytes), ready on the compute stream, for one handle."""
        self.start_reload(stats, prefetch=False)
        self.copies.wait(self.reload_event)
        storage = self.reloaded
        assert storage is not None  # start_reload set it
        self.unpacks_left -= 1
        if self.unpacks_left <= 0:  # every handle has its view: the views keep the storage
            self.reloaded, self.reload_event = None, None
        return storage


class LayerRun:
    """One forward of layer ``index``: the copies its offloaded modules made (or share), and a
    weak reference to the run backward reaches next (the nearest earlier layer that offloaded)."""

    def __init__(self, index: int, previous: weakref.ref | None, excluded: set[int]):
        self.index, self.previous, self.excluded = index, previous, excluded
        self.copies: dict[int, HostCopy] = {}

    def reload(self, stats: OffloadStats, prefetch: bool) -> None:
        for copy in self.copies.values():
            copy.start_reload(stats, prefetch)

    def settle(self, stats: OffloadStats) -> None:
        """Let go of every device storage this run and the runs before it still hold, waiting for
        their copies on the compute stream where they are not done."""
        run: LayerRun | None = self
        while run is not None:
            held = [c for c in run.copies.values() if c.source is not None]
            if not held:
                break  # the runs before were settled when this one was
            for copy in held:
                copy.release(stats, force=True)
            run = run.previous() if run.previous is not None else None

    def nearest(self) -> weakref.ref | None:
        """The run a later layer's backward should prefetch: this one if it offloaded anything."""
        return weakref.ref(self) if self.copies else self.previous


@dataclass(frozen=True, eq=False)
class Handle:
    """What autograd keeps for one offloaded saved tensor."""

    copy: HostCopy
    run: LayerRun  # keeps the layer's run (its copies, its prefetch link) alive with the graph
    stats: OffloadStats
    dtype: torch.dtype
    size: torch.Size
    stride: tuple[int, ...]
    offset: int | torch.SymInt

    def tensor(self) -> torch.Tensor:
        storage = self.copy.take(self.stats)
        view = torch.empty(0, dtype=self.dtype, device=storage.device)
        return view.set_(storage.untyped_storage(), self.offset, self.size, self.stride)


class Offloader:
    """The copies of one model (``apply_recompute`` makes one): packs saved tensors into handles,
    one :class:`HostCopy` per storage. ``copies_for(device)`` picks the copies of a device."""

    def __init__(self, copies_for: Callable[[torch.device], Copies]):
        self.copies_for = copies_for
        self.stats = OffloadStats()
        self._copies: weakref.WeakValueDictionary[tuple[str, int], HostCopy] = weakref.WeakValueDictionary()
        self._held: list[HostCopy] = []  # copies whose device storage is still held

    def poll(self) -> None:
        """Let go of every device storage whose copy to host has completed."""
        self._held = [c for c in self._held if not c.release(self.stats, force=False)]

    def pack(self, t: torch.Tensor, run: LayerRun, unit: str) -> Handle | None:
        """A handle for ``t``, or None where it stays as it is (see :meth:`offloadable`)."""
        if not self.offloadable(t, run):
            return None
        storage = t.untyped_storage()
        key = (str(t.device), storage.data_ptr())
        copy = self._copies.get(key)
        if copy is None or not copy.is_copy_of(storage, t._version):
            copy = HostCopy(self.copies_for(t.device), storage, t.device, t._version)
            self._copies[key] = copy
            self._held.append(copy)
            self.stats.copies += 1
            self.stats.bytes[unit] = self.stats.bytes.get(unit, 0) + copy.nbytes
        run.copies.setdefault(id(copy), copy)
        copy.handles += 1
        return Handle(copy, run, self.stats, t.dtype, t.size(), t.stride(), t.storage_offset())

    @staticmethod
    def offloadable(t: torch.Tensor, run: LayerRun) -> bool:
        """Plain strided tensors with a storage, except parameters (any leaf that requires grad, and
        views of one: autograd keeps a leaf itself), the layer's parameters and buffers viewed any
        way (``run.excluded``: their storages' addresses), and host tensors on a machine with an
        accelerator (already on host)."""
        if type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
            return False  # tensor subclasses (DTensor, fake and functional tensors) keep their own storage
        root = t if t._base is None else t._base
        if t.layout != torch.strided or root.is_leaf and root.requires_grad or t.device.type in ("meta", "xla"):
            return False
        if t.device.type == "cpu" and torch.accelerator.is_available():
            return False
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return False
        return storage.nbytes() > 0 and storage.data_ptr() not in run.excluded
