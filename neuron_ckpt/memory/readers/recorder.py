"""Our own CPU measurement: the bytes autograd keeps for backward, per rank, as JSON.

:class:`~neuron_ckpt.memory.measure.SavedTensorRecorder` counts the distinct storages saved for
backward during a forward, exactly and on any device (the CPU included). :func:`write` records one
figure per rank::

    {"format": "neuron_ckpt.saved-tensors", "version": 1,
     "ranks": [{"rank": 0, "saved_bytes": B, "by_scope": {"<scope>": B, ...}}, ...]}

and :func:`read` returns it as category ``saved`` per rank, exact (no page): what the recorder saw
kept when it exited, so a peak of the saved activations, not of the whole device.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, cast

from ...files import write_atomic
from . import MemoryReading, ReadError

if TYPE_CHECKING:
    from ..measure import SavedTensorRecorder

FORMAT = "neuron_ckpt.saved-tensors"
VERSION = 1


def _count(record: dict, key: str, where: str) -> int:
    if key not in record:
        raise ReadError(f"{where}: no {key!r}")
    value = record[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ReadError(f"{where}: {key!r} is {value!r}, not a count")
    return value


def write(path: str | Path, per_rank: Sequence[SavedTensorRecorder | int]) -> None:
    """Write one record per rank (the index is the rank): a recorder (its kept bytes and their
    scopes) or a byte count. Atomic: the file holds the old content or all of the new."""
    ranks = []
    for rank, item in enumerate(per_rank):
        if isinstance(item, int) and not isinstance(item, bool) and item >= 0:
            ranks.append({"rank": rank, "saved_bytes": item, "by_scope": {}})
        elif hasattr(item, "bytes_by_scope"):  # a SavedTensorRecorder (measure imports torch; this does not)
            recorder = cast("SavedTensorRecorder", item)
            ranks.append({"rank": rank, "saved_bytes": recorder.total_bytes, "by_scope": recorder.bytes_by_scope()})
        else:
            raise ValueError(f"rank {rank}: expected a SavedTensorRecorder or a byte count, got {item!r}")
    if not ranks:
        raise ValueError("no ranks to write")
    text = json.dumps({"format": FORMAT, "version": VERSION, "ranks": ranks}, indent=1) + "\n"
    write_atomic(path, text.encode("utf-8"))


def read(path: str | Path) -> MemoryReading:
    """Read a file :func:`write` wrote; cores are ranks, category ``saved``."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ReadError(f"{path}: not a JSON recorder file ({exc})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        got = data.get("format") if isinstance(data, dict) else None
        raise ReadError(f"{path}: not a saved-tensors file (format {got!r}, expected {FORMAT!r})")
    if data.get("version") != VERSION:
        raise ReadError(f"{path}: version {data.get('version')!r} of {FORMAT}; this reader knows {VERSION}")
    if not isinstance(data.get("ranks"), list) or not data["ranks"]:
        raise ReadError(f"{path}: no 'ranks' records")
    cores: dict[int, dict[str, int]] = {}
    for n, record in enumerate(data["ranks"]):
        if not isinstance(record, dict):
            raise ReadError(f"{path}: ranks[{n}]: expected a record, got {record!r}")
        rank = _count(record, "rank", f"{path}: ranks[{n}]")
        if rank in cores:
            raise ReadError(f"{path}: rank {rank} is recorded twice")
        cores[rank] = {"saved": _count(record, "saved_bytes", f"{path}: rank {rank}")}
    return MemoryReading("recorder", str(path), "peak", dict(sorted(cores.items())))


__all__ = ["FORMAT", "VERSION", "read", "write"]
