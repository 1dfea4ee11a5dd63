"""Neuron Explorer's ingested profile: device memory (HBM) per category over the run, from Neuron's profiler.

Produce it (SDK 2.29+, trn1 included; docs/memory.md, "Neuron's profiler: which tool on which SDK")::

    NEURON_RT_INSPECT_ENABLE=1 NEURON_RT_INSPECT_DEVICE_PROFILE=0 NEURON_RT_INSPECT_OUTPUT_DIR=out torchrun ...
    neuron-explorer view -d out --ingest-only --ignore-device-profile --display-name L8 --data-path ws

and read ``ws/profiles/global/L8@latest``: a directory of ``<Table>.parquet`` files, a large table
split as ``<Table>_0.parquet``, ``<Table>_1.parquet``, ...

**Documented** (profile schema 7.4.0 of SDK 2.31 and 2.32, ``tools/neuron-explorer/
profile-schema-reference.rst`` and ``how-to-analyze-profile-output.rst``; HBM usage came with the
dev tools of SDK 2.29):

* ``SystemProfileHbmUsage``, written from a system profile: one row per (``instance_id``,
  ``device_idx``, ``hbm_idx``, ``timestamp`` in ns) with ``total_bytes`` and 22 per-category int64
  byte counts (``tensors_bytes``, ``weights_bytes``, ``shared_scratchpad_bytes``,
  ``scratchpad_bytes``, ``profiler_buffers_bytes``, ``dma_rings_*_bytes``, ``unknown_bytes``, ...).
  Per HBM, not per core: "multiple NeuronCores may share the same HBM".
* ``HbmUsageSummaryByType``, a device-profile summary per NeuronCore: ``neuron_device_idx``,
  ``neuroncore_idx``, ``usage_type`` (the one documented value: ``Weights``), ``usage_bytes``.
* ``Metadata.profile_schema_version``, ``MAJOR.MINOR.PATCH``: a new MAJOR removes or renames tables or
  fields or changes types. SDK 2.33 moved to 12.0.1, whose memory tables public copies did not show:
  this reader refuses every major but 7, in one line naming the version.
* HBM stacks per device: 2 on Trainium and Inferentia2 (2 NeuronCores each), 4 on Trainium2 and
  Trainium3; on trn2 each HBM is shared by two physical cores, which LNC=2 (the default) makes one
  logical core.
* ``Warning``: ingestion warnings (``category``, ``message``), "worth checking first".

**Inferred**: one NeuronCore per HBM on trn1 (two of each per chip, and Explorer's summary page
draws "a separate line for each logical NeuronCore (HBM index)"), so the core is ``device_idx x
HBMs per device + hbm_idx``, numbered as the runtime numbers cores; on trn2 at LNC=1 a "core" here is
a pair of cores. ``usage_type`` strings name the categories as the byte columns' descriptions do
(``Shared Scratchpad`` -> ``shared_scratchpad``; a third-party reader filters on such strings).
``weights`` is what the runtime calls model constants; torch-xla's parameters, gradients and
optimizer state are ``tensors``, the control. Not documented: whether a system profile alone writes
``Metadata`` (its documented producer is the NEFF; without it the columns are checked by name and
type, and a note says the version is unknown), and the sampling cadence.

:func:`read`: per HBM and category, the largest value over the samples; categories are the columns
less ``_bytes``. Every HBM of the instance is listed: the job's hold tensors and scratchpad, the
others only the runtime's baseline, and ``compare`` compares the cores that hold what it compares.
Without ``SystemProfileHbmUsage`` it reads ``HbmUsageSummaryByType``: one snapshot per core (taken
when the device profile began, inferred from neuron-profile's "NC Memory Usage Info" tab), not a
peak, with the device profile's buffers in HBM. Parquet is read with pyarrow, the Apache Arrow
project's reader, an optional extra: ``pip install 'neuron_ckpt[profiler]'``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from . import MemoryReading, ReadError, scratchpad_page
from .oom_table import snake

HBM, SUMMARY, METADATA, WARNING = "SystemProfileHbmUsage", "HbmUsageSummaryByType", "Metadata", "Warning"
KNOWN_MAJORS = {7: "7.4.0, documented for SDK 2.31 and 2.32"}
GROUP = ("instance_id", "device_idx", "hbm_idx")
REQUIRED = ("total_bytes", "tensors_bytes", "shared_scratchpad_bytes", "scratchpad_bytes")
HBMS_PER_DEVICE = (2, 4)  # Trainium, Inferentia2 / Trainium2, Trainium3
_VERSION = re.compile(r"(\d+)\.\d+\.\d+")


def _arrow(path: Path) -> tuple[Any, Any, Any]:
    try:
        import pyarrow
        import pyarrow.compute
        import pyarrow.parquet
    except ImportError:
        raise ReadError(
            f"{path}: reading Neuron Explorer's Parquet tables needs pyarrow: pip install 'neuron_ckpt[profiler]'"
        ) from None
    return pyarrow, pyarrow.compute, pyarrow.parquet


def parts(root: Path, table: str) -> list[Path]:
    """``table``'s files under ``root``: ``<table>.parquet`` and ``<table>_<k>.parquet``, k from 0 with no gap."""
    numbered = {}
    for file in root.glob(f"{table}_*.parquet"):
        match = re.fullmatch(rf"{table}_(\d+)\.parquet", file.name)
        if match:
            numbered[int(match.group(1))] = file
    if sorted(numbered) != list(range(len(numbered))):
        raise ReadError(f"{root}: {table} parts {sorted(numbered)}: one is missing (numbered from 0, no gap)")
    whole = root / f"{table}.parquet"
    return ([whole] if whole.is_file() else []) + [numbered[k] for k in sorted(numbered)]


def _table(part: Path, columns: list[str], integers: tuple[str, ...], suffix: str | None = None) -> Any:
    """The ``columns`` of one Parquet file (and every column named ``*<suffix>``, an integer), checked:
    present, ``integers`` of an integer type and never negative, no empty value (the schema
    requires every field read here)."""
    pa, pc, pq = _arrow(part)
    try:
        schema = pq.read_schema(part)
        missing = [c for c in columns if c not in schema.names]
        if missing:
            raise ReadError(f"{part}: no column {', '.join(missing)} (columns: {', '.join(schema.names)})")
        more = [n for n in schema.names if suffix and n.endswith(suffix) and n not in columns]
        columns, integers = [*columns, *more], (*integers, *more)
        for name in integers:
            if not pa.types.is_integer(schema.field(name).type):
                raise ReadError(f"{part}: {name} is {schema.field(name).type}, not an integer byte count or index")
        table = pq.read_table(part, columns=columns)
    except (OSError, pa.ArrowException) as exc:
        raise ReadError(f"{part}: not a Parquet table ({' '.join(str(exc).split())})") from None
    for name in columns:
        column = table.column(name)
        if column.null_count:
            raise ReadError(f"{part}: {name} has {column.null_count} empty values (the schema requires it)")
        if name in integers and len(column) and pc.min(column).as_py() < 0:
            raise ReadError(f"{part}: {name} holds {pc.min(column).as_py()}, not a byte count or index")
    return table


def schema_version(root: Path) -> str | None:
    """``Metadata.profile_schema_version``, checked against the majors this reader knows; None
    when the profile has no Metadata table."""
    found = set()
    for part in parts(root, METADATA):
        found |= set(_table(part, ["profile_schema_version"], ()).column("profile_schema_version").to_pylist())
    if not found:
        return None
    if len(found) > 1:
        raise ReadError(f"{root}: Metadata holds several profile_schema_version values: {sorted(found)}")
    version = found.pop()
    match = _VERSION.fullmatch(str(version))
    if not match or int(match.group(1)) not in KNOWN_MAJORS:
        known = "; ".join(f"{major}.x ({what})" for major, what in KNOWN_MAJORS.items())
        raise ReadError(
            f"{root}: profile schema {version}: this reader knows major version {known}; a new major renames or "
            f"removes tables and fields (12.x came with SDK 2.33, its memory tables unconfirmed)"
        )
    return str(version)


def _hbm_peaks(root: Path, files: list[Path]) -> tuple[dict[tuple, dict], set[int]]:
    """Per (instance, device, HBM): the largest value of each category, the samples and their span;
    and the shared-scratchpad figures seen (for the page)."""
    pc = _arrow(root)[1]
    hbms: dict[tuple, dict] = {}
    shared: set[int] = set()
    for part in files:
        table = _table(
            part, [*GROUP, "timestamp", *REQUIRED], ("device_idx", "hbm_idx", "timestamp", *REQUIRED), "_bytes"
        )
        categories = [n for n in table.column_names if n.endswith("_bytes")]
        shared |= set(pc.unique(table.column("shared_scratchpad_bytes")).to_pylist())
        aggregates = [(c, "max") for c in categories] + [
            ("timestamp", "min"),
            ("timestamp", "max"),
            ("timestamp", "count"),
        ]
        for row in table.group_by(list(GROUP)).aggregate(aggregates).to_pylist():
            key = tuple(row[k] for k in GROUP)
            hbm = hbms.setdefault(key, {"values": {}, "samples": 0, "first": row["timestamp_min"], "last": 0})
            for name in categories:
                category = name[: -len("_bytes")]
                hbm["values"][category] = max(hbm["values"].get(category, 0), row[f"{name}_max"])
            hbm["samples"] += row["timestamp_count"]
            hbm["first"] = min(hbm["first"], row["timestamp_min"])
            hbm["last"] = max(hbm["last"], row["timestamp_max"])
    return hbms, shared


def _from_hbm_table(root: Path, files: list[Path], instance: str | None) -> tuple[dict, int, list[str], set[int]]:
    hbms, shared = _hbm_peaks(root, files)
    if not hbms:
        raise ReadError(f"{root}: {HBM} has no rows")
    instances = sorted({key[0] for key in hbms})
    if instance is None and len(instances) > 1:
        raise ReadError(
            f"{root}: HBM rows of {len(instances)} instances ({', '.join(instances)}): read one (instance=...); "
            f"each instance's per-core slope is its own"
        )
    mine = {key[1:]: hbm for key, hbm in hbms.items() if instance is None or key[0] == instance}
    if not mine:
        raise ReadError(f"{root}: no HBM rows of instance {instance!r} (instances: {', '.join(instances)})")
    highest = max(h for _, h in mine) + 1
    per_device = next((n for n in HBMS_PER_DEVICE if highest <= n), None)
    if per_device is None:
        raise ReadError(f"{root}: hbm_idx {highest - 1}: devices have 2 HBMs (trn1, inf2) or 4 (trn2, trn3)")
    cores = {device * per_device + h: hbm["values"] for (device, h), hbm in mine.items()}
    samples = max(hbm["samples"] for hbm in mine.values())
    span = (max(h["last"] for h in mine.values()) - min(h["first"] for h in mine.values())) / 1e9
    used = sorted(c for c, v in cores.items() if v["tensors"] or v["shared_scratchpad"] or v["scratchpad"])
    note = (
        f"{HBM}: the largest of up to {samples} samples per HBM and category over {span:.1f} s (the sampling cadence "
        f"is not documented: a transient between samples can be missed); {len(used)} of {len(cores)} HBMs hold "
        f"tensors or scratchpad, the others only the runtime's baseline"
    )
    notes = [note]
    if per_device == 4:
        notes.append(
            "4 HBMs per device (trn2, trn3): each HBM is one logical NeuronCore at LNC=2 (the default); at LNC=1 two "
            "cores share an HBM and each figure here is theirs together"
        )
    buffers = [c for c in used if cores[c].get("profiler_buffers")]
    if buffers:
        notes.append(
            f"profiler buffers on NeuronCores {', '.join(map(str, buffers))}: a device profile ran, which takes HBM "
            f"(~2 GB a core); they are outside the compared categories, but capture memory without one"
        )
    return cores, samples, notes, shared


def _from_summary(root: Path, files: list[Path], cores_per_device: int) -> tuple[dict, int, list[str], set[int]]:
    rows = []
    for part in files:
        columns = ["neuron_device_idx", "neuroncore_idx", "usage_type", "usage_bytes"]
        rows += _table(part, columns, ("neuron_device_idx", "neuroncore_idx", "usage_bytes")).to_pylist()
    if not rows:
        raise ReadError(f"{root}: {SUMMARY} has no rows")
    # neuroncore_idx: instance-wide if every row's index lies on its own device, else on-device.
    wide = all(r["neuroncore_idx"] // cores_per_device == r["neuron_device_idx"] for r in rows)
    if not wide and not all(r["neuroncore_idx"] < cores_per_device for r in rows):
        raise ReadError(
            f"{root}: {SUMMARY}: neuroncore_idx is neither on-device (below cores_per_device={cores_per_device}) "
            f"nor instance-wide; pass cores_per_device (2 on trn1; trn2: 4 at LNC=2, 8 at LNC=1)"
        )
    cores: dict[int, dict[str, int]] = {}
    for r in rows:
        core = r["neuroncore_idx"] if wide else r["neuron_device_idx"] * cores_per_device + r["neuroncore_idx"]
        values = cores.setdefault(core, {})
        category = snake(str(r["usage_type"]))
        values[category] = max(values.get(category, 0), r["usage_bytes"])
    for core, values in cores.items():
        missing = [c[: -len("_bytes")] for c in REQUIRED if c[: -len("_bytes")] not in values]
        if missing:
            raise ReadError(
                f"{root}: {SUMMARY}: NeuronCore {core} has no usage_type for {', '.join(missing)} "
                f"(types: {', '.join(sorted(values))})"
            )
    note = (
        f"{SUMMARY} (no {HBM}: no system profile): one snapshot per NeuronCore, taken when the device profile "
        f"began (inferred), not a peak over the run; the device profile's buffers take HBM"
    )
    return cores, 1, [note], {v["shared_scratchpad"] for v in cores.values()}


def _warnings(root: Path) -> list[str]:
    rows: list[dict] = []
    for part in parts(root, WARNING):
        rows += _table(part, ["category", "message"], ()).to_pylist()
    if not rows:
        return []
    first = rows[0]
    return [f"{WARNING}: {len(rows)} ingestion warnings, the first: [{first['category']}] {first['message']}"]


def read(path: str | Path, instance: str | None = None, cores_per_device: int = 2) -> MemoryReading:
    """Read an ingested Explorer profile directory. ``instance``: the ``instance_id`` to read where
    the profile holds several. ``cores_per_device``: for ``HbmUsageSummaryByType`` only (2: trn1)."""
    root = Path(path)
    if not root.is_dir():
        raise ReadError(f"{root}: not a directory (an ingested Neuron Explorer profile is a directory of .parquet)")
    _arrow(root)
    version = schema_version(root)
    hbm_files, summary_files = parts(root, HBM), parts(root, SUMMARY)
    if hbm_files:
        cores, samples, notes, shared = _from_hbm_table(root, hbm_files, instance)
        kind = "peak"
        if summary_files:
            notes.append(f"{SUMMARY} is there too (a device profile ran): the figures are {HBM}'s, over the run")
    elif summary_files:
        cores, samples, notes, shared = _from_summary(root, summary_files, cores_per_device)
        kind = "current"
    else:
        raise ReadError(
            f"{root}: an Explorer profile without {HBM} or {SUMMARY}: HBM usage is in system profiles from SDK 2.29 "
            f"(NEURON_RT_INSPECT_ENABLE=1), not in SDK 2.28's"
        )
    if version is None:
        notes.append("no Metadata table, so the profile schema version is unknown; the columns were checked by name")
    page, page_note = scratchpad_page(shared)
    notes += [page_note] if page_note else []
    notes += _warnings(root)
    return MemoryReading("neuron-explorer", str(root), kind, dict(sorted(cores.items())), samples, page, tuple(notes))


__all__ = ["HBM", "KNOWN_MAJORS", "METADATA", "SUMMARY", "WARNING", "parts", "read", "schema_version"]
