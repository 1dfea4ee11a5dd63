"""The bytes an XLA executable needs, as XLA's own buffer assignment of the compiled module fixed them.

``XLA_FLAGS="--xla_dump_to=DIR --xla_dump_hlo_as_text"`` makes XLA write, per compiled module,
``module_NNNN.<name>.cpu_after_optimizations-buffer-assignment.txt`` (``gpu_...`` on GPU): the
allocations (``allocation 7: size 90112, parameter 4, shape |bf16[128,352]| ...:``), each with
the HLO values packed into it, ``Total bytes used: N``, then XLA's live-range analysis of the
scheduled module. torch-xla 2.9's CPU client also writes a ``...-memory-usage-report.txt``; it is
derived from the same allocations but lists only the largest and leaves the kind of the rest
out, so this file is the one read. One reading, ``cores[0]``, bytes by category:

* ``temp``: allocations that hold no entry parameter, are not live-out, not constants and not
  thread-local. On XLA:CPU that is the one ``preallocated-temp`` allocation the runtime
  allocates per execution: the heap simulator's packing (by liveness) of every value that
  does not share a parameter or output allocation; the analogue of a NEFF's scratchpad.
  XLA also packs temporaries into output allocations before the output is written; those
  cost nothing extra and are not in ``temp``.
* ``parameters``: allocations holding an entry parameter, also those that are live-out too
  (an output that passes a parameter through aliases it; no copy).
* ``outputs``: live-out allocations that hold no parameter (the tuple's pointer table included).
* ``constants``, ``thread_local`` (scalars of called computations, on the stack).
* ``live_at_peak``: XLA's logical peak (``Stack trace breakdown for peak usage: N bytes``):
  the bytes of every value live at the busiest step of the module's schedule, parameters and
  outputs included, without packing; left out, with a note, when the dump has no live ranges.

Strict: the allocations must be numbered 0..n-1 and sum to ``Total bytes used``, else
:class:`~.ReadError`, one line naming the file.
"""

from __future__ import annotations

import re
from pathlib import Path

from . import MemoryReading, ReadError, read_lines

SOURCE = "xla-buffer-assignment"
CATEGORIES = ("temp", "parameters", "outputs", "constants", "thread_local")
_ALLOCATION = re.compile(r"allocation (\d+): size (\d+)(.*)")
_TOTAL = re.compile(r"Total bytes used: (\d+)")
_PEAK_AT = re.compile(r"  Live ranges at (\d+) \(peak\):")
_PEAK = re.compile(r"  Stack trace breakdown for peak usage: ([\d ,]+) bytes")
_CUMULATIVE = re.compile(r"    \S.*: \d+ bytes \(cumulative: (\d+) bytes\)")


def _category(flags: str) -> str:
    flags = re.sub(r"\|[^|]*\|", "", flags)  # shapes, which hold commas of their own
    if re.search(r", parameter \d+", flags):
        return "parameters"
    if ", constant" in flags:
        return "constants"
    if "maybe-live-out" in flags:
        return "outputs"
    return "thread_local" if "thread-local" in flags else "temp"


def _peak(lines: list[str], path: Path, notes: list[str]) -> int | None:
    start = next((i for i, line in enumerate(lines) if _PEAK_AT.fullmatch(line)), None)
    if start is None:
        notes.append(f"{path}: no live ranges (HloLiveRange) in the dump, so no live_at_peak")
        return None
    cumulative = 0
    for line in lines[start + 1 :]:
        found = _CUMULATIVE.fullmatch(line)
        if found:
            cumulative = int(found.group(1))
            continue
        peak = _PEAK.fullmatch(line)
        if peak is None:
            break
        total = int(re.sub(r"[ ,]", "", peak.group(1)))
        if total != cumulative:
            raise ReadError(f"{path}: peak usage {total} bytes, but the live values at the peak sum to {cumulative}")
        return total
    raise ReadError(
        f"{path}: the live ranges at the peak end without 'Stack trace breakdown for peak usage' (truncated?)"
    )


def read(path: str | Path) -> MemoryReading:
    """Read one ``*buffer-assignment.txt`` (see the module docstring for the categories)."""
    path = Path(path)
    lines = read_lines(path)
    if not lines or lines[0] != "BufferAssignment:":
        raise ReadError(f"{path}: not an XLA buffer assignment (its first line is not 'BufferAssignment:')")
    values = dict.fromkeys(CATEGORIES, 0)
    count, total = 0, None
    for number, line in enumerate(lines[1:], start=2):
        found = _ALLOCATION.fullmatch(line)
        if found:
            index, size, flags = int(found.group(1)), int(found.group(2)), found.group(3)
            if index != count or not flags.endswith(":"):
                raise ReadError(f"{path}:{number}: expected 'allocation {count}: size N...:', got {line[:80]!r}")
            values[_category(flags)] += size
            count += 1
        elif matched := _TOTAL.match(line):
            total = int(matched.group(1))
            break
    if count == 0:
        raise ReadError(f"{path}: no 'allocation N: size S' lines")
    if total is None:
        raise ReadError(f"{path}: no 'Total bytes used' line after {count} allocations (truncated?)")
    if sum(values.values()) != total:
        raise ReadError(
            f"{path}: the {count} allocations sum to {sum(values.values())} bytes, but 'Total bytes used' says {total}"
        )
    notes: list[str] = []
    if values["temp"] == 0:
        notes.append(f"{path}: no temporary allocation (every value fits in parameter or output buffers)")
    peak = _peak(lines, path, notes)
    if peak is not None:
        values["live_at_peak"] = peak
    return MemoryReading(SOURCE, str(path), "peak", {0: values}, 1, None, tuple(notes))


__all__ = ["CATEGORIES", "SOURCE", "read"]
