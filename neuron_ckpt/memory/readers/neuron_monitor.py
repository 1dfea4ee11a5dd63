"""neuron-monitor's JSON lines: per NeuronCore and category, the largest value over the samples.

``neuron-monitor -c monitor.conf > nm.ndjson`` writes one complete report per line (every period,
5 s by default). ``neuron_runtime_data`` lists one runtime per process (a trn1 training job has one
per NeuronCore), and each runtime's ``report.memory_used.neuron_runtime_used_bytes.usage_breakdown.
neuroncore_memory_usage`` maps **every** NeuronCore of the instance (instance-wide indices) to five
categories of the bytes that process holds there (:data:`~.NEURON_CATEGORIES`), zeros on the cores
it does not use. So a core's bytes in one report are the sum over the runtimes; a core no runtime
uses reads as zeros. There is no peak in the format: the reader keeps the largest value of each
category over the samples and says how many there were, so a transient shorter than the period can
be missed (say so beside any figure). Runtimes can be picked by their ``neuron_runtime_tag``
(``NEURON_PROCESS_TAG``; several processes may share one). An error string in a metric group the
reader does not use (``neuron_runtime_vcpu_usage`` says ``open /proc/<pid>/stat: no such file or
directory`` when neuron-monitor cannot see the process) is ignored; one in ``memory_used``, or on
the runtime itself, is a :class:`ReadError`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from . import NEURON_CATEGORIES, SCRATCHPAD_PAGE_BYTES, MemoryReading, ReadError, read_lines


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


def _add_runtime(runtime: object, sample: dict[int, dict[str, int]], where: str) -> None:
    """Add one runtime's bytes per NeuronCore and category into ``sample``."""
    if not isinstance(runtime, dict):
        raise ReadError(f"{where}: a neuron_runtime_data entry is {type(runtime).__name__}, not an object")
    who = f"runtime {runtime.get('neuron_runtime_tag', '')!r} (pid {runtime.get('pid')})"
    if runtime.get("error"):
        raise ReadError(f"{where}: neuron-monitor reported an error for {who}: {runtime['error']}")
    memory = _at(runtime, ("report", "memory_used"), f"{where}: {who}")
    if isinstance(memory, dict) and memory.get("error"):
        raise ReadError(f"{where}: neuron-monitor reported an error in memory_used for {who}: {memory['error']}")
    per_core = _at(
        memory, ("neuron_runtime_used_bytes", "usage_breakdown", "neuroncore_memory_usage"), f"{where}: {who}"
    )
    if not isinstance(per_core, dict):
        raise ReadError(f"{where}: {who}: neuroncore_memory_usage is {per_core!r}, not an object")
    for key, categories in per_core.items():
        if not str(key).isdigit():
            raise ReadError(f"{where}: {who}: NeuronCore key {key!r} is not an index")
        core = int(key)
        missing = [c for c in NEURON_CATEGORIES if not isinstance(categories, dict) or c not in categories]
        if missing:
            raise ReadError(f"{where}: {who}: NeuronCore {core} lacks {', '.join(map(repr, missing))}")
        total = sample.setdefault(core, dict.fromkeys(NEURON_CATEGORIES, 0))
        for category in NEURON_CATEGORIES:
            total[category] += _bytes(categories[category], f"{where}: {who}: NeuronCore {core} {category!r}")


def read(path: str | Path, tag: str | None = None) -> MemoryReading:
    """Read a neuron-monitor output file. ``tag``: a regular expression the runtimes'
    ``neuron_runtime_tag`` must match in full (None: every runtime)."""
    path = Path(path)
    lines = read_lines(path)
    cores: dict[int, dict[str, int]] = {}
    samples = most = 0
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
        runtimes = report["neuron_runtime_data"] or []
        if not isinstance(runtimes, list):
            raise ReadError(f"{where}: neuron_runtime_data is {type(runtimes).__name__}, not a list")
        mine = [
            r
            for r in runtimes
            if tag is None or re.fullmatch(tag, str(r.get("neuron_runtime_tag", "") if isinstance(r, dict) else ""))
        ]
        sample: dict[int, dict[str, int]] = {}
        for runtime in mine:
            _add_runtime(runtime, sample, where)
        for core, values in sample.items():
            peak = cores.setdefault(core, dict.fromkeys(NEURON_CATEGORIES, 0))
            for category, value in values.items():
                peak[category] = max(peak[category], value)
        samples, most = samples + bool(sample), max(most, len(mine))
    if not samples:
        which = f" for tag {tag!r}" if tag is not None else ""
        raise ReadError(f"{path}: no memory samples{which} (an empty file, or no runtime reported memory)")
    note = (
        f"largest of {samples} samples per category, each the sum over its runtimes (at most {most} in one); "
        f"a transient shorter than neuron-monitor's period can be missed"
    )
    return MemoryReading(
        "neuron-monitor", str(path), "peak", dict(sorted(cores.items())), samples, SCRATCHPAD_PAGE_BYTES, (note,)
    )


__all__ = ["read"]
