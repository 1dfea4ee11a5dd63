"""The copies between device and host, and the ordering edges that make them safe: one small
interface (:class:`Copies`), one implementation per kind of device.

The four edges, each one line of :class:`StreamCopies` (the peers' bugs in brackets):

(a) the copy to host waits for the work queued on the compute stream when the tensor was saved
    (the tensor's producer);
(b) a reload waits for *its own* copy to host, whether it runs as a prefetch or at the moment of
    use (Megatron #7398: the inline reload had no edge and read a half-written host buffer), and
    for the work queued on the compute stream when it is issued (its device buffer may reuse a
    block that work frees: DeepSpeed #8186, axolotl #3833);
(c) the compute stream waits for the reload before anything reads it;
(d) the device storage is let go only once its copy to host has completed: when the copy's event
    says so, or after the compute stream waits for it (then the block is freed in the compute
    stream's order, so the next kernels may reuse it at once; TransformerEngine's way, rather than
    ``record_stream``, whose deferred free the allocator sees only when the host asks; torchtune
    #1867 freed too early). The engine (:mod:`.engine`) decides when: as soon as a copy is done,
    and at the latest when the layer after next starts its forward.

Where there are no streams the copies run at once (:class:`SyncCopies`, CPU tensors): every edge
holds trivially and nothing overlaps. tests/test_offload.py runs the engine against a backend that
defers every copy until something waits on it and poisons what it reads too early, so a missing
edge fails there deterministically.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch


class Copies(Protocol):
    """How one device's storages go to host and come back. Tensors are flat ``uint8`` views of
    whole storages; events are whatever the implementation waits on (None: already complete)."""

    def offload(self, source: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Start copying ``source`` into a new host buffer after the work queued on the compute
        stream so far (edge a); returns the buffer and the copy's event."""
        ...

    def done(self, event: Any) -> bool:
        """Whether ``event`` has completed (without waiting)."""
        ...

    def reload(self, host: torch.Tensor, device: torch.device, after: Any) -> tuple[torch.Tensor, Any]:
        """Start copying ``host`` into a new device buffer once ``after`` (the event of the copy
        that filled ``host``) and the work queued on the compute stream so far have completed
        (edge b); returns the buffer and the reload's event."""
        ...

    def wait(self, event: Any) -> None:
        """Make the compute stream wait for ``event`` before its next work (edge c)."""
        ...


class SyncCopies:
    """Copies that complete before they return: CPU tensors (nothing to overlap: the "host" copy
    is another CPU buffer, so no memory is saved either; for tests and the benchmark's mechanics),
    and a device without streams."""

    def offload(self, source: torch.Tensor) -> tuple[torch.Tensor, Any]:
        return source.to("cpu", copy=True), None

    def done(self, event: Any) -> bool:
        return True

    def reload(self, host: torch.Tensor, device: torch.device, after: Any) -> tuple[torch.Tensor, Any]:
        return host.to(device, copy=True), None

    def wait(self, event: Any) -> None:
        pass


class StreamCopies:
    """Copies on two side streams of an accelerator (``torch.Stream`` / ``torch.Event`` through
    ``torch.accelerator``: CUDA; TorchNeuron's ``neuron`` device has ``torch.neuron.Stream`` and
    ``record_stream``, unverified on hardware), into pinned host memory where the device's host
    allocator pins (CUDA), pageable memory otherwise."""

    def __init__(self, device: torch.device):
        self.device = device
        self.d2h = torch.Stream(device=device)
        self.h2d = torch.Stream(device=device)
        self.pin = True

    def _compute(self) -> torch.Stream:
        return torch.accelerator.current_stream(self.device)

    def _host(self, nbytes: int) -> torch.Tensor:
        if self.pin:
            try:
                return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            except RuntimeError:  # no pinning host allocator for this device: pageable (copies block the host)
                self.pin = False
        return torch.empty(nbytes, dtype=torch.uint8)

    def offload(self, source: torch.Tensor) -> tuple[torch.Tensor, Any]:
        host = self._host(source.numel())
        self.d2h.wait_stream(self._compute())  # (a)
        with self.d2h:
            host.copy_(source, non_blocking=True)
        return host, self.d2h.record_event()

    def done(self, event: Any) -> bool:
        return event.query()

    def reload(self, host: torch.Tensor, device: torch.device, after: Any) -> tuple[torch.Tensor, Any]:
        compute = self._compute()
        # Allocated on the compute stream (the stream that reads and frees it: TransformerEngine
        # PR #2131), filled on h2d once both edges (b) hold.
        dest = torch.empty(host.numel(), dtype=torch.uint8, device=device)
        self.h2d.wait_stream(compute)
        self.h2d.wait_event(after)
        with self.h2d:
            dest.copy_(host, non_blocking=True)
        return dest, self.h2d.record_event()

    def wait(self, event: Any) -> None:
        self._compute().wait_event(event)  # (c)
