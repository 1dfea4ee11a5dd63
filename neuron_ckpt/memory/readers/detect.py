"""Which reader a file needs, from what the file holds (for ``neuron-ckpt compare --run N=PATH``).

A directory is an unpacked NEFF (``sg00/def.json``), a sysfs tree or an ingested Neuron Explorer
profile (``*.parquet``); a raw profile (``ntrace.pb``) or an Explorer workspace is refused with the
step that makes it readable. ``*.neff`` is a NEFF; ``*.pickle`` / ``*.pkl`` CUDA's memory snapshot.
Otherwise the text decides: a JSON object by its keys (``var``: a NEFF's def.json;
``neuron<d>/neuron_core<c>``: a sysfs snapshot; ``format``: our recorder; ``allocated_bytes.*``:
``memory_stats()``; ``neuron_runtime_data``: neuron-monitor, one line per report), Prometheus
exposition text by its metric names, the runtime's per-NEFF load log by its breakdown lines, its
OOM table by its NeuronCore rows, XLA's buffer assignment by its allocation lines. Anything else is
refused, naming the file.
"""

from __future__ import annotations

import importlib
import json
import re
from pathlib import Path

from . import MemoryReading, ReadError

_SYSFS_KEY = re.compile(r"neuron\d+/neuron_core\d+")
_OOM_ROW = re.compile(r"^\s*\\_NC \d+\s*\|", re.MULTILINE)


def _json_kind(data: object) -> str | None:
    if not isinstance(data, dict):
        return None
    if "neuron_runtime_data" in data:
        return "neuron_monitor"
    if isinstance(data.get("var"), dict):
        return "neff"
    if data.get("format") == "neuron_ckpt.saved-tensors":
        return "recorder"
    if any(str(k).startswith("allocated_bytes.") for k in data):
        return "cuda_stats"
    if data and all(_SYSFS_KEY.fullmatch(str(k)) for k in data):
        return "sysfs"
    return None


def _refuse_profile_directory(path: Path) -> None:
    """A raw Neuron profile or an Explorer workspace: say what to pass instead."""
    if any(path.glob("ntrace.pb")) or any(path.glob("*/ntrace.pb")) or any(path.glob("*/*/ntrace.pb")):
        raise ReadError(
            f"{path}: a raw Neuron profile (ntrace.pb): ingest it first (neuron-explorer view -d {path} --ingest-only "
            f"--display-name NAME --data-path WS) and pass WS/profiles/global/NAME@latest"
        )
    profiles = sorted(path.glob("profiles/global/*@latest"))
    if profiles:
        raise ReadError(f"{path}: a Neuron Explorer workspace: pass one profile's directory, e.g. {profiles[0]}")


def source_of(path: str | Path) -> str:
    """The reader module (a name in :data:`~neuron_ckpt.memory.capture.SOURCES`) for ``path``."""
    path = Path(path)
    if path.is_dir():
        if (path / "sg00" / "def.json").is_file():
            return "neff"
        if any(path.glob("neuron*/neuron_core*")):
            return "sysfs"
        if any(path.glob("*.parquet")):
            return "explorer"
        _refuse_profile_directory(path)
        raise ReadError(
            f"{path}: a directory that is neither an unpacked NEFF (sg00/def.json), a sysfs tree nor an ingested "
            f"Neuron Explorer profile (*.parquet)"
        )
    if path.suffix == ".neff":
        return "neff"
    if path.suffix in (".pickle", ".pkl"):
        return "cuda_snapshot"
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ReadError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ReadError(f"{path}: cannot read it as text ({exc})") from None
    head = text.lstrip()
    if head.startswith("{"):
        try:
            kind = _json_kind(json.loads(text))
        except json.JSONDecodeError:  # JSON lines: one neuron-monitor report per line
            first = head.splitlines()[0]
            try:
                kind = _json_kind(json.loads(first))
            except json.JSONDecodeError:
                kind = None
        if kind is not None:
            return kind
        raise ReadError(
            f"{path}: JSON of no known report (neuron-monitor, sysfs snapshot, def.json, memory_stats, recorder)"
        )
    if "neuroncore_memory_usage_" in text:
        return "prometheus"
    if "Per NEFF memory usage breakdown for [" in text:
        return "load_log"
    if _OOM_ROW.search(text):
        return "oom_table"
    if re.search(r"^allocation \d+: size \d+", text, re.MULTILINE):
        return "xla_buffers"
    raise ReadError(
        f"{path}: not a memory report this tool reads (neuron-monitor, Prometheus, sysfs, NEFF, Neuron Explorer, "
        f"the runtime's OOM table or load log, XLA buffer assignment, CUDA snapshot or memory_stats, recorder)"
    )


def read_any(path: str | Path, source: str | None = None, **options) -> MemoryReading:
    """Read ``path`` with the reader ``source`` names, or the one :func:`source_of` picks;
    ``options`` go to that reader's ``read``."""
    name = source or source_of(path)
    return importlib.import_module(f"{__package__}.{name}").read(path, **options)


__all__ = ["read_any", "source_of"]
