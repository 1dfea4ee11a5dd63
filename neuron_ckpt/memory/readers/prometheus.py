"""neuron-monitor's metrics as the Prometheus exporter exposes them (text exposition format).

``neuron-monitor | neuron-monitor-prometheus.py --port 8000`` serves, per runtime and NeuronCore,
the gauges ``neuroncore_memory_usage_<category>{neuroncore="N", runtime_tag="...", ...} <bytes>``
for the five categories of :data:`~.NEURON_CATEGORIES`: current values, no peak. As in
neuron-monitor's JSON, every runtime reports every core (zeros where it holds nothing), so a core's
bytes in one scrape are the sum over its series. The exporter keeps one series per label set, and
its labels name the runtime only by ``runtime_tag``: processes that share a tag share series, and
the last runtime in neuron-monitor's list overwrites the others (docs/memory.md; give each process
its own ``NEURON_PROCESS_TAG``, as ``scripts/capture_trn1_memory.py`` does).

A file holds one scrape, or several appended (``curl -s host:8000/metrics >> scrapes.txt``). No
series appears twice in one scrape, so a scrape ends where a series (any metric) repeats; the
reader keeps per core and category the largest sum over the scrapes. The exporter
never drops a series while any runtime runs, so a scrape that lacks memory series the one before
it had is taken as cut short (an error), unless it has none at all (every runtime had ended).
"""

from __future__ import annotations

import math
import re
from pathlib import Path

from . import NEURON_CATEGORIES, SCRATCHPAD_PAGE_BYTES, MemoryReading, ReadError, read_lines

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


class _Scrapes:
    """The scrapes of a file, one at a time: ``seen``, every series of the open scrape (a repeat
    ends it); ``memory``, its memory series read; ``sums``, their bytes per (core, category).
    :meth:`close` checks the open scrape against the one before it and keeps its sums."""

    def __init__(self, path: Path):
        self.path = path
        self.closed: list[dict[tuple[int, str], int]] = []
        self.previous: set[str] = set()
        self.start = 1
        self.seen: set[str] = set()
        self.memory: set[str] = set()
        self.sums: dict[tuple[int, str], int] = {}

    def close(self, next_line: int) -> None:
        if self.sums:
            where = f"{self.path}: the scrape from line {self.start}"
            lost = self.previous - self.memory
            if lost:
                raise ReadError(
                    f"{where} lacks {len(lost)} memory series the scrape before it had (cut short?), e.g. {min(lost)}"
                )
            for core in sorted({c for c, _ in self.sums}):
                missing = [c for c in NEURON_CATEGORIES if (core, c) not in self.sums]
                if missing:
                    raise ReadError(f"{where}: NeuronCore {core} lacks {', '.join(PREFIX + c for c in missing)}")
            self.closed.append(self.sums)
            self.previous = self.memory
        self.start, self.seen, self.memory, self.sums = next_line, set(), set(), {}


def read(path: str | Path, tag: str | None = None) -> MemoryReading:
    """Read an exposition file; ``tag``: a regular expression ``runtime_tag`` must match in full."""
    path = Path(path)
    lines = read_lines(path)
    scrapes = _Scrapes(path)
    for number, line in enumerate(lines, 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        where = f"{path}: line {number}"
        match = _SAMPLE.fullmatch(line.strip())
        if match is None:
            raise ReadError(f"{where}: not a Prometheus sample line (truncated?): {line[:60]!r}")
        name, series = match.group("name"), f"{match.group('name')}{{{match.group('labels') or ''}}}"
        if series in scrapes.seen:
            scrapes.close(number)
        scrapes.seen.add(series)
        category = name[len(PREFIX) :] if name.startswith(PREFIX) else None
        if category not in NEURON_CATEGORIES:
            continue  # other metrics, and CloudWatch's neuroncore_memory_usage_total
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
        key = (int(core), category)
        scrapes.sums[key] = scrapes.sums.get(key, 0) + int(value)
        scrapes.memory.add(series)
    scrapes.close(len(lines) + 1)
    if not scrapes.closed:
        which = f" with runtime_tag matching {tag!r}" if tag is not None else ""
        raise ReadError(f"{path}: no {PREFIX}* samples{which}: not the Neuron exporter's output")
    cores: dict[int, dict[str, int]] = {}
    for sums in scrapes.closed:
        for (index, kind), value in sums.items():
            peak = cores.setdefault(index, dict.fromkeys(NEURON_CATEGORIES, 0))
            peak[kind] = max(peak[kind], value)
    count = len(scrapes.closed)
    return MemoryReading(
        "prometheus",
        str(path),
        "peak" if count > 1 else "current",
        dict(sorted(cores.items())),
        count,
        SCRATCHPAD_PAGE_BYTES,
    )


__all__ = ["PREFIX", "read"]
