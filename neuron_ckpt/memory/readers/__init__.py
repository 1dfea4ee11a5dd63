"""Readers of what device-memory tools report, each into the same small record.

One module per format (issue #23; formats and sources in docs/memory.md, "Checking the model
against a device"): :mod:`.neuron_monitor` (neuron-monitor's JSON lines), :mod:`.prometheus`
(the same metrics from its Prometheus exporter), :mod:`.sysfs` (the Neuron driver's
``device_mem`` counters), :mod:`.neff` (the scratchpad a compiled NEFF's ``def.json`` fixes),
:mod:`.xla_buffers` (XLA's buffer assignment of a compiled graph), :mod:`.cuda_stats`
(``torch.accelerator.memory_stats()`` saved as JSON), :mod:`.cuda_snapshot` (the allocator's
snapshot pickle), :mod:`.recorder` (what our :class:`~neuron_ckpt.memory.SavedTensorRecorder`
counted), and from Neuron's own reports of device memory: :mod:`.explorer` (the Parquet tables of
an ingested Neuron Explorer profile: HBM per category over the run), :mod:`.oom_table` (the
table the runtime prints when an allocation fails) and :mod:`.load_log` (the per-NEFF breakdown it
logs at each load with ``NEURON_RT_LOG_LEVEL_TDRV=info``). :func:`.detect.read_any` picks the
reader from the file. Every reader is strict: a
file of the wrong kind, a truncated line, a missing category or a NeuronCore that is not there
raises :class:`ReadError`, one line naming the file and what is wrong; never a silent zero.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

# The per-NeuronCore categories neuron-monitor reports (sysfs has these and more).
NEURON_CATEGORIES = ("constants", "model_code", "model_shared_scratchpad", "runtime_memory", "tensors")
SCRATCHPAD_PAGE_BYTES = 512 << 20  # the scratchpad's page on Neuron Runtime 2.30 (SDK 2.28, the trn1 pin)
# The contiguous shared scratchpad of Neuron Runtime 2.33+ (SDK 2.31+, trn1 included, driver 2.24+)
# grows in 64 MB pages (AWS's device-memory page; a third party's trn1 OOM table showed MiB).
CONTIGUOUS_PAGE_BYTES = 64 << 20


class ReadError(ValueError):
    """A report that cannot be read as the format it claims; the message is one line."""


def read_lines(path: Path, lenient: bool = False) -> list[str]:
    """The lines of the UTF-8 text file ``path`` (``lenient``: undecodable bytes replaced, for
    logs a tool may have cut mid-character), or a one-line :class:`ReadError`."""
    try:
        return path.read_text(encoding="utf-8", errors="replace" if lenient else "strict").splitlines()
    except FileNotFoundError:
        raise ReadError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ReadError(f"{path}: cannot read it as text ({exc})") from None


def byte_count(record: object, key: str, where: str) -> int:
    """``record[key]`` as a byte count (a non-negative int), or a :class:`ReadError` naming ``where``."""
    value = record.get(key) if isinstance(record, dict) else None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        got = repr(value) if isinstance(record, dict) and key in record else "missing"
        raise ReadError(f"{where}: {key!r} is {got}, not a byte count")
    return value


def scratchpad_page(figures: Iterable[int], tolerance: int = 0) -> tuple[int, str | None]:
    """The page a report's shared-scratchpad ``figures`` are rounded up to, and a note when it is not
    the 512 MiB default: 64 MiB (the contiguous scratchpad) when some figure is a multiple of 64 MiB
    but not of 512 MiB. Such reports (Neuron Explorer's, the OOM table) do not say which runtime
    wrote them. ``tolerance``: how far a printed figure may be off its true value."""
    figures = list(figures)

    def fits(page: int) -> bool:
        return all(min(v % page, page - v % page) <= tolerance for v in figures)

    if fits(SCRATCHPAD_PAGE_BYTES):
        return SCRATCHPAD_PAGE_BYTES, None
    if fits(CONTIGUOUS_PAGE_BYTES):
        return CONTIGUOUS_PAGE_BYTES, (
            "shared scratchpad in 64 MiB pages: a figure is no multiple of 512 MiB (the contiguous "
            "scratchpad of Neuron Runtime 2.33+)"
        )
    return (
        SCRATCHPAD_PAGE_BYTES,
        "a shared scratchpad figure is no multiple of 64 MiB: its page is unknown, 512 MiB assumed",
    )


@dataclass(frozen=True)
class MemoryReading:
    """Device memory as one report gives it.

    source: the format ("neuron-monitor", "prometheus", "sysfs", "neff", "neuron-explorer",
        "neuron-oom-table", "neuron-load-log", "xla-buffer-assignment", "cuda-memory-stats",
        "cuda-snapshot", "recorder"). path: the file or directory read.
    kind: "peak" (the largest value seen: over samples, or a peak counter) or "current".
    cores: bytes per NeuronCore (instance-wide index) or CUDA device, and category.
    samples: reports combined (1 for a snapshot).
    quantum: the page size the scratchpad figure is rounded to, where there is one.
    """

    source: str
    path: str
    kind: str
    cores: dict[int, dict[str, int]]
    samples: int = 1
    quantum: int | None = None
    notes: tuple[str, ...] = field(default=())

    def bytes_of(self, category: str, core: int | None = None) -> int:
        """One category's bytes on ``core``, or the largest over the cores when None."""
        if core is not None:
            return self.core(core)[category]
        return max(c[category] for c in self.cores.values())

    def core(self, index: int) -> dict[str, int]:
        if index not in self.cores:
            raise ReadError(
                f"{self.path}: NeuronCore {index} is not in the report "
                f"(cores: {', '.join(map(str, sorted(self.cores))) or 'none'})"
            )
        return self.cores[index]


__all__ = [
    "CONTIGUOUS_PAGE_BYTES",
    "MemoryReading",
    "NEURON_CATEGORIES",
    "ReadError",
    "SCRATCHPAD_PAGE_BYTES",
    "byte_count",
    "scratchpad_page",
]
