"""Neuron Explorer's ingested profiles, written with pyarrow in the shape profile schema 7.4.0 documents.

**Hand-made**: no public dump of ``SystemProfileHbmUsage`` was found (tests/fixtures/memory/README.md).
The tables, column names, order and types are those of AWS's schema reference (SDK 2.31 and 2.32,
``tools/neuron-explorer/profile-schema-reference.rst``); the layout of the directory is AWS's
"Analyze Profile Output" page: one ``<Table>.parquet`` per table, a large one split as
``<Table>_0.parquet``, ``<Table>_1.parquet``, ... A system profile's rows cover **every HBM of the
instance** (16 devices x 2 HBMs on a trn1.32xlarge), each holding what the runtime keeps on every
core (its microcode, a few DMA rings: the baseline) and, on the job's cores, what the job holds.
The numbers are chosen by hand; ``Sample`` is one moment of the run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

MIB = 1 << 20
# The per-category columns of SystemProfileHbmUsage in the schema's order (each "<name>_bytes").
CATEGORIES = (
    "generic",
    "tensor_instructions",
    "scalar_instructions",
    "gpsimd_instructions",
    "io",
    "dram_spill",
    "weights",
    "profiler_buffers",
    "scalar_table",
    "vector_instructions",
    "sync_instructions",
    "shared_scratchpad",
    "tensors",
    "ucode_lib",
    "gpsimd_stdio",
    "collectives",
    "scratchpad",
    "dma_rings_runtime",
    "dma_rings_spill",
    "dma_rings_io",
    "dma_rings_collectives",
    "unknown",
)
# What the runtime holds on every HBM, the job's or not: the microcode (96 MiB per physical core,
# AWS's device-memory page; neuron-monitor's public trn1 sample shows 100,752,896 B on every core).
BASELINE = {"ucode_lib": 100752896, "dma_rings_runtime": 68 << 10, "generic": 2 * MIB}
INSTANCE = "i-0a1b2c3d4e5f60718"
START_NS = 1766072156592459482  # the schema's example first_ts_ns
SCHEMA = pa.schema(
    [("timestamp", pa.int64()), ("total_bytes", pa.int64())]
    + [(f"{c}_bytes", pa.int64()) for c in CATEGORIES]
    + [("device_idx", pa.int64()), ("hbm_idx", pa.int64()), ("instance_id", pa.string())]
)


@dataclass(frozen=True)
class Sample:
    """One moment: ``at`` seconds into the run; per NeuronCore (instance-wide), its bytes beyond the baseline."""

    at: float
    cores: dict[int, dict[str, int]] = field(default_factory=dict)


def hbm_rows(samples: list[Sample], devices: int = 16, hbms: int = 2, instance: str = INSTANCE) -> list[dict]:
    """SystemProfileHbmUsage rows: every HBM of the instance at every sample."""
    rows = []
    for sample in samples:
        for device in range(devices):
            for hbm in range(hbms):
                held = dict.fromkeys(CATEGORIES, 0) | BASELINE
                for name, value in sample.cores.get(device * hbms + hbm, {}).items():
                    held[name] += value
                rows.append(
                    {
                        "timestamp": START_NS + round(sample.at * 1e9),
                        "total_bytes": sum(held.values()),
                        **{f"{c}_bytes": held[c] for c in CATEGORIES},
                        "device_idx": device,
                        "hbm_idx": hbm,
                        "instance_id": instance,
                    }
                )
    return rows


def step_samples(scratchpad: int, tensors: int, cores: list[int], extra: dict[int, int] | None = None) -> list[Sample]:
    """A training run on ``cores``, two samples a phase: warm-up (the weights loaded, a small graph's
    scratchpad), forward (the step NEFF loaded: its scratchpad, which stays), the step's peak
    (``tensors``: weights, gradients and optimizer state), between steps (gradients freed).
    ``extra``: more tensors on some cores throughout (a rank that holds more)."""
    phases = [
        (64 * MIB, tensors // 3),
        (scratchpad, tensors * 2 // 3),
        (scratchpad, tensors),
        (scratchpad, tensors * 5 // 6),
    ]
    samples = []
    for k, (shared, held) in enumerate(phases):
        for half in (0.0, 0.25):
            samples.append(
                Sample(
                    0.5 * k + half,
                    {
                        core: {
                            "shared_scratchpad": shared,
                            "tensors": held + (extra or {}).get(core, 0),
                            "weights": 24 * MIB,
                            "io": 8 * MIB,
                            "tensor_instructions": 3 * MIB,
                            "vector_instructions": MIB,
                            "dram_spill": 2 * MIB,
                            "dma_rings_spill": 6 * MIB,
                            "dma_rings_io": 512 << 10,
                            "collectives": 32 * MIB,
                        }
                        for core in cores
                    },
                )
            )
    return samples


def write_table(root: Path, name: str, rows: list[dict], schema: pa.Schema | None = None, parts: int = 1) -> None:
    """``root/<name>.parquet``, or ``parts`` files ``<name>_0.parquet``, ... splitting the rows in order."""
    table = pa.Table.from_pylist(rows, schema=schema)
    if parts == 1:
        pq.write_table(table, root / f"{name}.parquet")
        return
    size = -(-len(rows) // parts)
    for k in range(parts):
        pq.write_table(table.slice(k * size, size), root / f"{name}_{k}.parquet")


def write_profile(
    root: Path,
    samples: list[Sample],
    *,
    schema_version: str | None = "7.4.0",
    parts: int = 3,
    devices: int = 16,
    hbms: int = 2,
    warnings: list[tuple[str, str]] = (),
) -> Path:
    """An ingested system profile: SystemProfileHbmUsage (split in ``parts``), SystemProfileMetadata,
    Metadata (unless ``schema_version`` is None), SchemaFields, and Warning when there are any."""
    root.mkdir(parents=True, exist_ok=True)
    write_table(root, "SystemProfileHbmUsage", hbm_rows(samples, devices, hbms), SCHEMA, parts)
    last = START_NS + round(max(s.at for s in samples) * 1e9)
    write_table(
        root,
        "SystemProfileMetadata",
        [
            {
                "first_ts": "2025-12-18 15:35:56.592459482 +0000 UTC",
                "last_ts": "2025-12-18 15:35:58.342459482 +0000 UTC",
                "first_ts_ns": str(START_NS),
                "last_ts_ns": str(last),
                "ntff_version": 5,
                "hbm_capacity_bytes": 16 << 30,
            }
        ],
    )
    if schema_version is not None:
        write_table(
            root,
            "Metadata",
            [
                {
                    "profile_schema_version": schema_version,
                    "ntff_version": 5,
                    "num_physical_cores": 1,
                    "vnc_enabled": False,
                }
            ],
            pa.schema(
                [
                    ("profile_schema_version", pa.string()),
                    ("ntff_version", pa.int32()),
                    ("num_physical_cores", pa.int32()),
                    ("vnc_enabled", pa.bool_()),
                ]
            ),
        )
    write_table(
        root,
        "SchemaFields",
        [
            {
                "table_name": "SystemProfileHbmUsage",
                "field_name": f.name,
                "field_type": str(f.type),
                "field_unit": "bytes" if f.name.endswith("_bytes") else "",
                "field_required": True,
            }
            for f in SCHEMA
        ],
    )
    if warnings:
        write_table(root, "Warning", [{"message": m, "category": c} for c, m in warnings])
    return root


def write_summary(root: Path, per_core: dict[tuple[int, int], dict[str, int]]) -> Path:
    """A device profile's HbmUsageSummaryByType: per (device, core on it), usage types in title case
    (``Shared Scratchpad``) and a ``Total`` row: the strings a third-party reader filters on."""
    root.mkdir(parents=True, exist_ok=True)
    rows = []
    for (device, core), values in per_core.items():
        for name, value in [*values.items(), ("total", sum(values.values()))]:
            usage = " ".join(w.upper() if w in ("io", "dma") else w.title() for w in name.split("_"))
            rows.append(
                {"neuron_device_idx": device, "neuroncore_idx": core, "usage_type": usage, "usage_bytes": value}
            )
    write_table(root, "HbmUsageSummaryByType", rows)
    return root
