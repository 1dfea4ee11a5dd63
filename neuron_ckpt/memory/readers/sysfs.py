"""The Neuron driver's per-NeuronCore memory counters in sysfs: the only peak in Neuron's tools.

The tree (``/sys/devices/virtual/neuron_device``, SDK 2.11+)::

    neuron<d>/neuron_core<c>/stats/memory_usage/device_mem/<category>/{total,present,peak}

holds one integer per file: ``total`` is the current usage, ``peak`` the largest seen (the
counters are write-to-clear). :func:`read` takes the tree itself, a copy of it, or the JSON a
capture writes of it (:func:`snapshot`, polls combined by :func:`merge_max`):
``{"neuron<d>/neuron_core<c>": {"<category>": {"total": B, "peak": B}}}``.
NeuronCores get instance-wide indices, ``d * cores_per_device + c``, as neuron-monitor's. The five
categories neuron-monitor has (:data:`~.NEURON_CATEGORIES`) are required; the others
(``collectives``, ``dma_rings``, ``nonshared_scratchpad``, ...) are kept when present.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from . import NEURON_CATEGORIES, SCRATCHPAD_PAGE_BYTES, MemoryReading, ReadError

KINDS = {"peak": "peak", "current": "total"}
_CORE = re.compile(r"neuron(\d+)/neuron_core(\d+)")
_DEVICE_MEM = Path("stats/memory_usage/device_mem")


def _int(text: object, where: str) -> int:
    value = text.strip() if isinstance(text, str) else text
    if isinstance(value, str) and value.isdigit():
        return int(value)
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    raise ReadError(f"{where}: expected a byte count, got {text!r}")


def _from_tree(root: Path, counter: str) -> dict[str, dict[str, int]]:
    found: dict[str, dict[str, int]] = {}
    for mem in sorted(root.glob(f"neuron*/neuron_core*/{_DEVICE_MEM}")):
        key = str(mem.relative_to(root).parent.parent.parent)
        values = {}
        for category in sorted(p for p in mem.iterdir() if p.is_dir()):
            file = category / counter
            if not file.is_file():
                raise ReadError(f"{file}: missing (every category has total, present and peak)")
            values[category.name] = _int(file.read_text(encoding="ascii", errors="replace"), str(file))
        found[key] = values
    return found


def _from_json(path: Path, counter: str) -> dict[str, dict[str, int]]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ReadError(f"{path}: not a JSON sysfs snapshot ({exc})") from None
    if not isinstance(data, dict) or not data or not all(_CORE.fullmatch(str(k)) for k in data):
        raise ReadError(f"{path}: not a sysfs snapshot (expected keys like 'neuron0/neuron_core0')")
    found = {}
    for key, categories in data.items():
        if not isinstance(categories, dict):
            raise ReadError(f"{path}: {key}: expected categories, got {categories!r}")
        values = {}
        for name, counters in categories.items():
            if not isinstance(counters, dict) or counter not in counters:
                raise ReadError(f"{path}: {key}/{name}: no {counter!r} counter")
            values[name] = _int(counters[counter], f"{path}: {key}/{name}/{counter}")
        found[key] = values
    return found


def snapshot(root: str | Path) -> dict[str, dict[str, dict[str, int]]]:
    """The counters under the tree ``root`` as the JSON snapshot :func:`read` takes:
    ``{"neuron<d>/neuron_core<c>": {"<category>": {"total": B, "peak": B}}}`` (what a capture
    polls while its job runs, then writes)."""
    root = Path(root)
    if not root.is_dir():
        raise ReadError(f"{root}: no such directory")
    totals, peaks = _from_tree(root, "total"), _from_tree(root, "peak")
    if not totals:
        raise ReadError(f"{root}: no neuron<d>/neuron_core<c>/{_DEVICE_MEM} counters under it")
    if {k: v.keys() for k, v in totals.items()} != {k: v.keys() for k, v in peaks.items()}:
        raise ReadError(f"{root}: NeuronCores or categories changed while the tree was read")
    return {
        key: {name: {"total": totals[key][name], "peak": peaks[key][name]} for name in values}
        for key, values in totals.items()
    }


def merge_max(a: dict, b: dict) -> dict:
    """Two snapshots of the same tree, ``b`` the later: per core and category the larger
    ``total`` (the current usage, so the largest seen over the polls) and ``b``'s ``peak`` (the
    counter is already a running maximum; the later read is the one that holds after a clear).
    Snapshots of different cores or categories are an error."""
    if a.keys() != b.keys() or any(a[k].keys() != b[k].keys() for k in a):
        raise ReadError("sysfs snapshots of different NeuronCores or categories cannot be merged")
    return {
        key: {
            name: {"total": max(a[key][name]["total"], b[key][name]["total"]), "peak": b[key][name]["peak"]}
            for name in b[key]
        }
        for key in b
    }


def read(path: str | Path, kind: str = "peak") -> MemoryReading:
    """Read the counters under ``path`` (a directory) or in ``path`` (a JSON snapshot).
    ``kind``: "peak" (the peak counters) or "current" (``total``)."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {tuple(KINDS)}, got {kind!r}")
    path = Path(path)
    if not path.exists():
        raise ReadError(f"{path}: no such file or directory")
    found = _from_tree(path, KINDS[kind]) if path.is_dir() else _from_json(path, KINDS[kind])
    if not found:
        raise ReadError(f"{path}: no neuron<d>/neuron_core<c>/{_DEVICE_MEM} counters under it")
    per_device: dict[int, set[int]] = {}
    for key in found:
        device, core = map(int, _CORE.fullmatch(key).groups())  # type: ignore[union-attr]  # the keys matched _CORE
        per_device.setdefault(device, set()).add(core)
    widths = {len(cores) for cores in per_device.values()}
    if len(widths) != 1 or any(cores != set(range(len(cores))) for cores in per_device.values()):
        raise ReadError(
            f"{path}: devices have different or gapped NeuronCore sets: "
            f"{ {d: sorted(c) for d, c in sorted(per_device.items())} }"
        )
    width = widths.pop()
    cores = {}
    for key, values in found.items():
        missing = [c for c in NEURON_CATEGORIES if c not in values]
        if missing:
            raise ReadError(f"{path}: {key} lacks {', '.join(map(repr, missing))}")
        device, core = map(int, _CORE.fullmatch(key).groups())  # type: ignore[union-attr]  # the keys matched _CORE
        cores[device * width + core] = values
    return MemoryReading("sysfs", str(path), kind, dict(sorted(cores.items())), 1, SCRATCHPAD_PAGE_BYTES)


__all__ = ["KINDS", "merge_max", "read", "snapshot"]
