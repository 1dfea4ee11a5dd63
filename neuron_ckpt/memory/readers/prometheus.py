"""neuron-monitor's metrics as the Prometheus exporter exposes them (text exposition format).

``neuron-monitor | neuron-monitor-prometheus.py --port 8000`` serves, per NeuronCore, the gauges
``neuroncore_memory_usage_<category>{neuroncore="N", runtime_tag="...", ...} <bytes>`` for the five
categories of :data:`~.NEURON_CATEGORIES`, current values, no peak. A file holds one scrape, or
several appended (``curl -s host:8000/metrics >> scrapes.txt``): each (core, category) series then
appears once per scrape and the reader keeps the largest value, with the number of scrapes.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

from . import NEURON_CATEGORIES, SCRATCHPAD_PAGE_BYTES, MemoryReading, ReadError

PREFIX = "neuroncore_memory_usage_"
_SAMPLE = re.compile(r"(?P<name>[A-Za-z_:][A-Za-z0-9_:]*)(?:\{(?P<labels>.*)\})?\s+(?P<value>\S+)(?:\s+-?\d+)?")
_LABEL = re.compile(r'\s*([A-Za-z_][A-Za-z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*(?:,|$)')


def _labels(text: str, where: str) -> dict[str, str]:
    labels, pos = {}, 0
    while pos < len(text):
        match = _LABEL.match(text, pos)
        if match is None:
            raise ReadError(f"{where}: cannot parse the labels {{{text}}}")
        labels[match.group(1)] = match.group(2)
        pos = match.end()
    return labels


def read(path: str | Path, tag: str | None = None) -> MemoryReading:
    """Read an exposition file; ``tag``: a regular expression ``runtime_tag`` must match in full."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ReadError(f"{path}: cannot read it as text ({exc})") from None
    values: dict[tuple[int, str], list[int]] = {}
    for number, line in enumerate(lines, 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        where = f"{path}: line {number}"
        match = _SAMPLE.fullmatch(line.strip())
        if match is None:
            raise ReadError(f"{where}: not a Prometheus sample line (truncated?): {line[:60]!r}")
        name = match.group("name")
        if not name.startswith(PREFIX):
            continue
        category = name[len(PREFIX):]
        if category not in NEURON_CATEGORIES:
            continue  # e.g. CloudWatch's _total
        labels = _labels(match.group("labels") or "", where)
        if tag is not None and not re.fullmatch(tag, labels.get("runtime_tag", "")):
            continue
        core = labels.get("neuroncore", "")
        if not core.isdigit():
            raise ReadError(f"{where}: {name} has no neuroncore index label (got {core!r})")
        try:
            value = float(match.group("value"))
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value < 0 or value != int(value):
            raise ReadError(f"{where}: {name} expected a byte count, got {match.group('value')!r}")
        values.setdefault((int(core), category), []).append(int(value))
    if not values:
        which = f" with runtime_tag matching {tag!r}" if tag is not None else ""
        raise ReadError(f"{path}: no {PREFIX}* samples{which}: not the Neuron exporter's output")
    cores: dict[int, dict[str, int]] = {}
    for core in sorted({c for c, _ in values}):
        missing = [c for c in NEURON_CATEGORIES if (core, c) not in values]
        if missing:
            raise ReadError(f"{path}: NeuronCore {core} lacks {', '.join(PREFIX + c for c in missing)}")
        cores[core] = {c: max(values[(core, c)]) for c in NEURON_CATEGORIES}
    counts = {len(v) for v in values.values()}
    if len(counts) != 1:
        raise ReadError(f"{path}: series appear a different number of times ({sorted(counts)}): a scrape is cut short")
    scrapes = counts.pop()
    return MemoryReading("prometheus", str(path), "peak" if scrapes > 1 else "current", cores, scrapes,
                         SCRATCHPAD_PAGE_BYTES)


__all__ = ["PREFIX", "read"]
