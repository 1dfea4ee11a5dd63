"""neuron-monitor's JSON lines: per NeuronCore and category, the largest value over the samples.

``neuron-monitor -c monitor.conf > nm.ndjson`` writes one complete report per line (every period,
5 s by default); each runtime's ``report.memory_used.neuron_runtime_used_bytes.usage_breakdown.
neuroncore_memory_usage`` maps instance-wide NeuronCore indices to five categories of current
bytes (:data:`~.NEURON_CATEGORIES`). There is no peak in the format: the reader keeps the largest
value of each category over the samples and says how many there were, so a transient shorter
than the period can be missed (say so beside any figure). Runtimes can be picked by their
``neuron_runtime_tag`` (``NEURON_PROCESS_TAG``); a NeuronCore that two runtimes report is an error.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from . import NEURON_CATEGORIES, SCRATCHPAD_PAGE_BYTES, MemoryReading, ReadError


def _at(obj, keys: tuple[str, ...], where: str):
    for key in keys:
        if not isinstance(obj, dict) or key not in obj:
            raise ReadError(f"{where}: no {'.'.join(keys)!r} (stopped at {key!r})")
        obj = obj[key]
    return obj


def _bytes(value, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 or value != int(value):
        raise ReadError(f"{where}: expected a byte count, got {value!r}")
    return int(value)


def read(path: str | Path, tag: str | None = None) -> MemoryReading:
    """Read a neuron-monitor output file. ``tag``: a regular expression the runtimes'
    ``neuron_runtime_tag`` must match in full (None: every runtime)."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ReadError(f"{path}: cannot read it as text ({exc})") from None
    cores: dict[int, dict[str, int]] = {}
    samples = 0
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}: line {number}"
        try:
            report = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ReadError(f"{where}: not one complete JSON object (truncated?): {exc.msg}") from None
        if not isinstance(report, dict) or "neuron_runtime_data" not in report:
            raise ReadError(f"{where}: not neuron-monitor output (no 'neuron_runtime_data')")
        seen: set[int] = set()
        for runtime in _at(report, ("neuron_runtime_data",), where):
            name = runtime.get("neuron_runtime_tag", "") if isinstance(runtime, dict) else ""
            if tag is not None and not re.fullmatch(tag, str(name)):
                continue
            memory = _at(runtime, ("report", "memory_used"), where)
            if memory.get("error"):
                raise ReadError(f"{where}: neuron-monitor reported an error for runtime {name!r}: {memory['error']}")
            per_core = _at(memory, ("neuron_runtime_used_bytes", "usage_breakdown", "neuroncore_memory_usage"), where)
            for key, categories in per_core.items():
                if not str(key).isdigit():
                    raise ReadError(f"{where}: NeuronCore key {key!r} is not an index")
                core = int(key)
                if core in seen:
                    raise ReadError(f"{where}: NeuronCore {core} is reported by two runtimes")
                seen.add(core)
                missing = [c for c in NEURON_CATEGORIES if not isinstance(categories, dict) or c not in categories]
                if missing:
                    raise ReadError(f"{where}: NeuronCore {core} lacks {', '.join(map(repr, missing))}")
                peak = cores.setdefault(core, dict.fromkeys(NEURON_CATEGORIES, 0))
                for category in NEURON_CATEGORIES:
                    value = _bytes(categories[category], f"{where}: NeuronCore {core} {category!r}")
                    peak[category] = max(peak[category], value)
        samples += 1 if seen else 0
    if not samples:
        which = f" for tag {tag!r}" if tag is not None else ""
        raise ReadError(f"{path}: no memory samples{which} (an empty file, or no runtime reported memory)")
    note = f"largest of {samples} samples per category; a transient shorter than neuron-monitor's period can be missed"
    return MemoryReading("neuron-monitor", str(path), "peak", dict(sorted(cores.items())), samples,
                         SCRATCHPAD_PAGE_BYTES, (note,))


__all__ = ["read"]
