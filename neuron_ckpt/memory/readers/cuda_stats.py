"""CUDA's caching-allocator counters: ``torch.accelerator.memory_stats()`` saved as JSON.

``json.dump(torch.accelerator.memory_stats(device), f)`` after a step writes flat keys
``"<stat>.<pool>.<which>"`` (the CUDA caching allocator's, as torch documents them): the reader
takes, for the ``all`` pool, ``allocated_bytes`` (what tensors hold; ``max_memory_allocated`` is
its peak), ``active_bytes`` and ``reserved_bytes`` (what the allocator holds from the driver), as
categories of one device. Exact bytes, no page; the peak is since the last
``reset_peak_memory_stats``.
"""

from __future__ import annotations

import json
from pathlib import Path

from . import MemoryReading, ReadError

CATEGORIES = ("allocated_bytes", "active_bytes", "reserved_bytes")
KINDS = ("peak", "current")


def read(path: str | Path, kind: str = "peak", device: int = 0) -> MemoryReading:
    """Read one device's saved ``memory_stats()``; ``device`` is the index it is recorded under."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    path = Path(path)
    try:
        stats = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ReadError(f"{path}: not a JSON file of torch.accelerator.memory_stats() ({exc})") from None
    if not isinstance(stats, dict) or not any(str(k).startswith("allocated_bytes.") for k in stats):
        raise ReadError(f"{path}: not torch.accelerator.memory_stats() output (no 'allocated_bytes.*' keys)")
    values = {}
    for category in CATEGORIES:
        key = f"{category}.all.{kind}"
        value = stats.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            what = "missing" if key not in stats else f"not a byte count: {value!r}"
            raise ReadError(f"{path}: {key!r} {what}")
        values[category] = value
    return MemoryReading("cuda-memory-stats", str(path), kind, {device: values})


__all__ = ["CATEGORIES", "read"]
