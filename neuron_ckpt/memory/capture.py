"""A directory of memory measurements that ``neuron-ckpt compare --capture DIR`` reads as it is.

A capture (``scripts/capture_trn1_memory.py`` on trn1, ``scripts/xla_memory_slope.py`` on
XLA:CPU here) runs one job at several layer counts and recompute presets and writes, beside the
reports, ``manifest.json``::

    {"format": "neuron_ckpt.memory-capture", "version": 1,
     "job": {"model": "llama", "config": "tiny.json", "tp": 1, "seq": 256, ...},
     "runs": [{"layers": 2, "recompute": "none", "attention": "explicit",
               "files": {"sysfs": "none_L2/sysfs.json", "neff": "none_L2/def.json"}}, ...],
     "notes": ["..."]}

``job`` holds ``neuron-ckpt compare``'s job options by their argument names (``micro_batch``,
``sequence_parallel``: underscores); ``files`` maps a reader (a module of :mod:`.readers`) to a
path relative to the directory. Reading checks all of it and names the field that is wrong.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..files import write_atomic
from ..parallel.attention import ATTENTION
from ..recompute import PRESETS

MANIFEST = "manifest.json"
FORMAT, VERSION = "neuron_ckpt.memory-capture", 1
# In the order compare shows them: exact figures first (a NEFF's def.json, the runtime's per-NEFF
# load log), then the page-rounded device figures that confirm them, the profiler's first
# (docs/memory.md, "Checking the model against a device").
SOURCES = (
    "neff",
    "load_log",
    "xla_buffers",
    "recorder",
    "explorer",
    "sysfs",
    "oom_table",
    "neuron_monitor",
    "prometheus",
    "cuda_snapshot",
    "cuda_stats",
)


@dataclass(frozen=True)
class Run:
    """One measured run: ``layers`` decoder layers, every one with ``recompute``; ``files``: reader -> path."""

    layers: int
    recompute: str
    attention: str
    files: dict[str, str]


@dataclass(frozen=True)
class Capture:
    root: Path
    job: dict
    runs: tuple[Run, ...]
    notes: tuple[str, ...] = field(default=())

    def path(self, run: Run, source: str) -> Path:
        return self.root / run.files[source]


def _check_run(where: str, entry: object) -> Run:
    if not isinstance(entry, dict):
        raise ValueError(f"{where}: expected an object, got {entry!r}")
    layers, recompute, attention, files = (entry.get(k) for k in ("layers", "recompute", "attention", "files"))
    if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
        raise ValueError(f"{where}.layers: expected a positive integer, got {layers!r}")
    if recompute not in PRESETS:
        raise ValueError(f"{where}.recompute: expected one of {PRESETS}, got {recompute!r}")
    if attention not in ATTENTION:
        raise ValueError(f"{where}.attention: expected one of {ATTENTION}, got {attention!r}")
    if not isinstance(files, dict) or not files:
        raise ValueError(f"{where}.files: expected an object of reader -> path, got {files!r}")
    for source, rel in files.items():
        if source not in SOURCES:
            raise ValueError(f"{where}.files: unknown reader {source!r}; readers: {', '.join(SOURCES)}")
        if not isinstance(rel, str) or not rel or Path(rel).is_absolute() or ".." in Path(rel).parts:
            raise ValueError(f"{where}.files.{source}: expected a path inside the capture, got {rel!r}")
    return Run(layers, recompute, attention, dict(files))


def read_capture(root: str | Path) -> Capture:
    """The capture in directory ``root``; a ``ValueError`` naming the manifest field otherwise."""
    root = Path(root)
    path = root / MANIFEST
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"{root}: not a capture directory (no {MANIFEST})") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: cannot read it as JSON ({exc})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"{path}: not a {FORMAT} manifest")
    if data.get("version") != VERSION:
        raise ValueError(f"{path}: version {data.get('version')!r}, this reader knows {VERSION}")
    job, runs, notes = data.get("job"), data.get("runs"), data.get("notes", [])
    if not isinstance(job, dict):
        raise ValueError(f"{path}: job: expected an object of compare's options, got {job!r}")
    if not isinstance(runs, list) or not runs:
        raise ValueError(f"{path}: runs: expected a non-empty list, got {runs!r}")
    if not isinstance(notes, list) or not all(isinstance(n, str) for n in notes):
        raise ValueError(f"{path}: notes: expected a list of strings")
    checked = tuple(_check_run(f"{path}: runs[{i}]", entry) for i, entry in enumerate(runs))
    return Capture(root, job, checked, tuple(notes))


def write_capture(root: str | Path, job: dict, runs: list[Run], notes: Sequence[str] = ()) -> Path:
    """Write ``root/manifest.json`` atomically (checked as :func:`read_capture` checks it)."""
    root = Path(root)
    data: dict[str, Any] = {
        "format": FORMAT,
        "version": VERSION,
        "job": job,
        "runs": [
            {"layers": r.layers, "recompute": r.recompute, "attention": r.attention, "files": r.files} for r in runs
        ],
        "notes": list(notes),
    }
    for i, entry in enumerate(data["runs"]):
        _check_run(f"runs[{i}]", entry)
    path = root / MANIFEST
    write_atomic(path, (json.dumps(data, indent=1) + "\n").encode())
    return path


__all__ = ["Capture", "FORMAT", "MANIFEST", "Run", "SOURCES", "read_capture", "write_capture"]
