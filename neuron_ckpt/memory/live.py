"""The peak of what autograd holds for backward, over the forward AND the backward of a step.

:class:`~.measure.SavedTensorRecorder` answers "what does the forward leave for backward"; this
answers "how much is ever held at once", which recompute decides: a recomputed layer or group
saves its activations again in the middle of the backward, on top of what the earlier layers
still hold.

``LiveSavedTensors`` keeps ``torch.autograd.graph.saved_tensors_hooks`` installed over the whole
step. The pack hook wraps each saved tensor in a small holder and counts the holder's storage.
The holder keeps the tensor detached: the same storage, so memory is exactly as without the
tracker (autograd rebuilds the tensor's history when it unpacks it), and an op's output that the
op itself saves does not hold its own graph alive through the holder (the tensor with its
``grad_fn`` would: a cycle through C++ that no garbage collection frees). A
``weakref.finalize`` on the holder uncounts it when autograd drops the holder, which it does
once the node that saved it has run its backward (or the graph is freed). A storage counts
while at least one holder of it is alive, once however many tensors of it were saved; the
running total of those distinct storages' bytes and its maximum are what it reports.
Parameters and the tensors the caller names are left out, and storages are identified as the
recorder does (:func:`~.measure.storage_key`; a tensor without a storage counts as its own
bytes while its holder lives).

Recompute inside backward is seen when it saves through the default hooks: the reentrant
checkpoint (``RecomputeConfig(..., use_reentrant=True)``, :mod:`neuron_ckpt.recompute`) reruns
the layers with grad enabled inside backward, so their saves come here. torch's non-reentrant
checkpoint (``use_reentrant=False``, the default off XLA) recomputes under hooks of its own and
is **not** seen: measure peaks with ``use_reentrant=True``.

::

    with LiveSavedTensors(exclude_modules=[model], exclude_tensors=masks) as live:
        loss = model(ids, labels=labels).loss
        live.mark("forward")
        loss.backward()
    live.peak_bytes, live.marks["forward"]
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable
from typing import Any

import torch

from .measure import SavedTensorHooks, StorageKey, storage_key


class _Held:
    """What autograd keeps instead of the tensor: the tensor itself, in a weak-referenceable box."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class LiveSavedTensors(SavedTensorHooks):
    """Context manager: the live and peak bytes of distinct storages saved for backward.

    ``exclude_modules``: their parameters are left out. ``exclude_tensors``: further storages
    to leave out (a shared causal mask). Enter before the forward and leave after the backward:
    saves made outside the ``with`` are not seen, though frees of what was seen still count.
    """

    def __init__(self, exclude_modules: Iterable[torch.nn.Module] = (), exclude_tensors: Iterable[torch.Tensor] = ()):
        super().__init__(exclude_modules, exclude_tensors)
        self._holders: dict[StorageKey, int] = {}  # live holders per storage
        self._nbytes: dict[StorageKey, int] = {}
        self._lock = threading.Lock()  # packs and frees may come from autograd's device threads
        self.live_bytes = 0
        """Bytes of the distinct storages saved and not yet released, now."""
        self.peak_bytes = 0
        """The most ``live_bytes`` has been."""
        self.marks: dict[str, int] = {}
        """``live_bytes`` at each :meth:`mark`."""

    def mark(self, label: str) -> int:
        """Record ``live_bytes`` now under ``label`` (say, "forward" once the loss is computed)."""
        self.marks[label] = self.live_bytes
        return self.live_bytes

    def _pack(self, tensor: torch.Tensor) -> Any:
        key = storage_key(tensor)
        if key is not None and key in self._excluded:
            return tensor
        held = _Held(tensor.detach())
        if key is None:  # nothing to dedupe by: its own bytes, for as long as it is held
            nbytes = tensor.numel() * tensor.element_size()
            self._add(nbytes)
            weakref.finalize(held, self._add, -nbytes).atexit = False
            return held
        with self._lock:
            count = self._holders.get(key, 0)
            self._holders[key] = count + 1
            if count == 0:
                self._nbytes[key] = tensor.untyped_storage().nbytes()
                self._add_locked(self._nbytes[key])
        weakref.finalize(held, self._release, key).atexit = False
        return held

    def _release(self, key: StorageKey) -> None:
        with self._lock:
            self._holders[key] -= 1
            if self._holders[key] == 0:
                del self._holders[key]
                self._add_locked(-self._nbytes.pop(key))

    def _add(self, nbytes: int) -> None:
        with self._lock:
            self._add_locked(nbytes)

    def _add_locked(self, nbytes: int) -> None:
        self.live_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def _unpack(self, packed: Any) -> torch.Tensor:
        return packed.tensor if isinstance(packed, _Held) else packed


__all__ = ["LiveSavedTensors"]
