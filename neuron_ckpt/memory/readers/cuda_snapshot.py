"""CUDA's allocator snapshot: the pickle of its segments, blocks and allocation history.

``_dump_snapshot(path)`` of torch's CUDA memory module (after ``_record_memory_history()``) writes
``{"segments": [{total_size, blocks: [{size, requested_size, state}]}], "device_traces": [[entry]]}``
(``torch/cuda/memory.py``). Read in torch 2.13's source: the installed docstring has no segment
``device`` and names the pending state "active_awaiting_free", but the C++ that builds the dict
(``torch/csrc/cuda/Module.cpp``, upstream, not in the wheel) writes ``device``, ``requested_size``,
``segment_pool_id``, ``is_expandable`` and ``frames`` per segment, the state "active_pending_free",
actions ``segment_map`` / ``segment_unmap`` too, and top-level ``allocator_settings`` and
``external_annotations``; the installed ``_memory_viz.py`` writes ``device`` too. Both state names
are accepted; a segment without ``device`` is device 0, with a note. Trace sizes are *requested*
bytes for ``alloc`` / ``free_*`` (CUDACachingAllocator.cpp) and segment bytes for ``segment_*``.

``current``: ``allocated`` and ``active`` (rounded block sizes, as ``memory_stats()``),
``requested`` (the tensors' own bytes), ``reserved`` (segments). ``peak``: ``requested`` (alloc
adds, free_requested removes) and ``reserved`` (segment alloc/map add, free/unmap remove), replayed
from the current value back over the trace; ``allocated`` / ``active`` have no exact peak (no rounded
sizes in the trace). No trace: peak = current, with a note. Every class is refused when unpickling:
a snapshot is plain data, and nothing in a file is ever run.
"""

from __future__ import annotations

import pickle
from pathlib import Path

from . import MemoryReading, ReadError, byte_count

KINDS = ("peak", "current")
STATES = ("active_allocated", "active_pending_free", "active_awaiting_free", "inactive")
CATEGORIES = ("allocated", "active", "requested", "reserved")
_STEPS = {
    "requested": {"alloc": 1, "free_requested": -1},
    "reserved": {"segment_alloc": 1, "segment_map": 1, "segment_free": -1, "segment_unmap": -1},
}
_ACTIONS = {"free_completed", "oom", "snapshot"}.union(*_STEPS.values())


class _NeedsClass(pickle.UnpicklingError):
    pass


class _PlainData(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        raise _NeedsClass(f"{module}.{name}")


def _load(path: Path) -> dict:
    try:
        with open(path, "rb") as f:
            data = _PlainData(f).load()
    except OSError as exc:
        raise ReadError(f"{path}: cannot read it ({exc})") from None
    except _NeedsClass as exc:
        raise ReadError(f"{path}: refused: the pickle needs {exc} (a snapshot needs no class; none is run)") from None
    except Exception as exc:  # noqa: BLE001  bytes that are not a pickle raise many kinds of error
        raise ReadError(f"{path}: not a pickle ({type(exc).__name__}: {exc})") from None
    if not isinstance(data, dict) or not isinstance(data.get("segments"), list):
        raise ReadError(f"{path}: not a memory snapshot (no 'segments' list)")
    return data


def _current(segments: list, path: Path, notes: list[str]) -> dict[int, dict[str, int]]:
    devices: dict[int, dict[str, int]] = {}
    for i, seg in enumerate(segments):
        where = f"{path}: segment {i}"
        if not isinstance(seg, dict) or not isinstance(seg.get("blocks"), list):
            raise ReadError(f"{where}: malformed segment (no 'blocks' list)")
        values = devices.setdefault(
            byte_count(seg, "device", where) if "device" in seg else 0, dict.fromkeys(CATEGORIES, 0)
        )
        total = byte_count(seg, "total_size", where)
        values["reserved"] += total
        for j, block in enumerate(seg["blocks"]):
            state = block.get("state") if isinstance(block, dict) else None
            if state not in STATES:
                raise ReadError(f"{where} block {j}: malformed block (state {state!r}, expected one of {STATES})")
            size = byte_count(block, "size", f"{where} block {j}")
            total -= size
            values["active"] += size if state != "inactive" else 0
            if state == "active_allocated":
                values["allocated"] += size
                values["requested"] += byte_count(block, "requested_size", f"{where} block {j}")
        if total:
            raise ReadError(f"{where}: malformed segment (its blocks do not add up to its total_size)")
    if any("device" not in seg for seg in segments):
        notes.append("segments carry no 'device' key: read as device 0")
    return devices


def _peak(trace: list, now: int, name: str, where: str) -> int:
    """The largest value ``name`` had over ``trace``, replayed back from ``now``, its value at the end."""
    deltas = []
    for n, entry in enumerate(trace):
        action = entry.get("action") if isinstance(entry, dict) else None
        if action not in _ACTIONS:
            raise ReadError(f"{where} entry {n}: malformed trace entry (action {action!r})")
        if action in _STEPS[name]:
            deltas.append((n, _STEPS[name][action] * byte_count(entry, "size", f"{where} entry {n}")))
    level = peak = now - sum(delta for _, delta in deltas)
    for at, delta in [("before it starts", 0), *((f"at entry {n}", delta) for n, delta in deltas)]:
        level += delta
        if level < 0:
            raise ReadError(f"{where}: the trace does not match the segments ({name} replays below 0 {at})")
        peak = max(peak, level)
    return peak


def read(path: str | Path, kind: str = "peak") -> MemoryReading:
    """Read a pickled allocator snapshot; ``kind``: "peak" (replayed over the trace) or "current"."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    path = Path(path)
    data = _load(path)
    notes: list[str] = []
    devices = _current(data["segments"], path, notes)
    traces = data.get("device_traces", [])
    if not isinstance(traces, list) or not all(isinstance(t, list) for t in traces):
        raise ReadError(f"{path}: 'device_traces' is not a list of lists")
    for device in (d for d, t in enumerate(traces) if t):
        devices.setdefault(device, dict.fromkeys(CATEGORIES, 0))
    if not devices:
        raise ReadError(f"{path}: no segments and no trace (nothing was allocated on any device)")
    if kind == "peak":
        for device, values in devices.items():
            trace = traces[device] if device < len(traces) else []
            where = f"{path}: device_traces[{device}]"
            devices[device] = {name: _peak(trace, values[name], name, where) for name in _STEPS}
            notes.append(
                f"device {device}: peak over {len(trace)} trace entries (the recorder keeps the last max_entries)"
                if trace
                else f"device {device}: no history recorded, so peak = current"
            )
    return MemoryReading("cuda-snapshot", str(path), kind, dict(sorted(devices.items())), notes=tuple(notes))


__all__ = ["CATEGORIES", "KINDS", "read"]
