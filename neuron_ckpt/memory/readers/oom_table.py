"""The device-memory table the Neuron runtime prints when an allocation fails: no profiler needed.

**Documented** (AWS, ``neuron-runtime/explore/device-memory.rst``, "Out-of-memory (OOM) Errors",
page dated 2025-10-16): on an OOM the runtime logs ``TDRV:log_dev_mem_usage_table`` and a table
whose header cells are stacked over two lines, then ``NEFF id to name mapping:``::

                 |          |  Model   |  Model   |          |  Shared  |          |          |DMA Rings | ...
                 |  TOTAL   |   Code   |Constants | Tensors  |Scratchpad|Scratchpad| Runtime  |    IO    | ...
   ND 0 Overall  | 20.188GB |192.102MB | 82.344KB | 20.000GB |  0.000B  |  0.000B  |350.125KB |179.000KB | ...
   \\_NC 4        | 20.094GB | 96.065MB | 58.344KB | 20.000GB |  0.000B  |  0.000B  |229.062KB |118.000KB | ...
     \\_NEFF 1001 |263.906KB | 28.562KB | 34.344KB |   n/a    |   n/a    |  0.000B  |108.000KB | 57.000KB | ...

14 columns (TOTAL, Model Code, Model Constants, Tensors, Shared Scratchpad, Scratchpad, Runtime, DMA
Rings IO / Spill / Collectives / Runtime, Collectives, XT CC, Profiler Buffers); rows per device
(``ND 0 Overall``, or ``ND 0 HBM 0`` "with recent changes"), per NeuronCore (``\\_NC 4``) and per
loaded NEFF (``\\_NEFF 1001``, ``n/a`` in the columns a NEFF does not own). The **Scratchpad** column
of an NC row is the non-shared scratchpad ("non-shared scratchpad allocations"). The table is also
written to ``/tmp/neuron_mem_table_device_<device_id>_hbm_<hbm_idx>.log`` "in case this OOM message is
truncated".

**Observed, not documented**: files named ``/tmp/neuron_mem_table_device_12_nc_1.log`` (trn1) and
``..._device_0_nc_2.log`` (trn2) in public logs; the units are binary (:mod:`.printed`).
**Inferred**: the ``NC`` index is the core's index on its device (the trn1 file of device 12 is
``nc_1``), so instance-wide indices need ``cores_per_device`` (2 on trn1 and inf2; trn2 has 4 logical
cores per device at LNC=2, 8 at LNC=1); a NEFF row's Scratchpad is that NEFF's scratchpad need (a
third party matched it on trn1 to the compiler's "Peak scratchpad usage"), kept as
``neff_scratchpad`` (the largest over the core's NEFFs) beside the NC's own figures.

:func:`read` takes the table file or a whole log holding one or more tables: per NeuronCore and
category, the largest figure over the tables. Categories are the headers in snake case
(``shared_scratchpad``, ``scratchpad``, ``tensors``, ``model_code``, ...), and ``neff_<column>`` for
the NEFF rows. The figures are current values when the allocation failed, not peaks.
"""

from __future__ import annotations

import re
from pathlib import Path

from . import MemoryReading, ReadError, read_lines, scratchpad_page
from .printed import printed_bytes

REQUIRED = ("total", "tensors", "shared_scratchpad", "scratchpad")
_ROW = re.compile(r"(ND (\d+) (?:Overall|HBM \d+)|\\_NC (\d+)|\\_NEFF (\d+))")


def snake(name: str) -> str:
    """A report's category name in snake case: ``DMA Rings IO`` -> ``dma_rings_io``."""
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.rstrip().rstrip("|").split("|")]


def _header(lines: list[str], at: int) -> list[str] | None:
    """The column names if ``lines[at]`` is the header line that starts with TOTAL (joined with the
    line above it when that one has as many cells: the stacked form)."""
    cells = _cells(lines[at])
    if len(cells) < 2 or cells[1] != "TOTAL":
        return None
    above = _cells(lines[at - 1]) if at > 0 else []
    if len(above) == len(cells) and not above[0]:
        return [snake(f"{a} {b}") for a, b in zip(above[1:], cells[1:])]
    return [snake(c) for c in cells[1:]]


def read(path: str | Path, cores_per_device: int = 2) -> MemoryReading:
    """Read every OOM table in ``path``. ``cores_per_device``: NeuronCores per device (2: trn1)."""
    path = Path(path)
    lines = read_lines(path, lenient=True)
    cores: dict[int, dict[str, int]] = {}
    shared: list[tuple[int, int]] = []  # (figure, its print rounding)
    tables = 0
    for at in range(len(lines)):
        columns = _header(lines, at)
        if columns is None:
            continue
        missing = [c for c in REQUIRED if c not in columns]
        if missing:
            raise ReadError(
                f"{path}: line {at + 1}: an OOM table without {', '.join(missing)} (columns: {', '.join(columns)}); "
                f"this reader knows the 14-column table of AWS's device-memory page"
            )
        tables += 1
        device = core = None
        for number in range(at + 1, len(lines)):
            cells = _cells(lines[number])
            match = _ROW.fullmatch(cells[0])
            if not match or len(cells) != len(columns) + 1:
                break
            where = f"{path}: line {number + 1}"
            if match.group(2) is not None:
                device, core = int(match.group(2)), None
                continue
            if device is None:
                raise ReadError(f"{where}: {cells[0]!r} comes before any 'ND <d>' row")
            if match.group(3) is not None:
                nc = int(match.group(3))
                if nc >= cores_per_device:
                    raise ReadError(
                        f"{where}: NC {nc} on ND {device}, but cores_per_device is {cores_per_device} "
                        f"(2 on trn1; trn2: 4 at LNC=2, 8 at LNC=1)"
                    )
                core = device * cores_per_device + nc
                values = cores.setdefault(core, {})
                for name, cell in zip(columns, cells[1:]):
                    if cell == "n/a":
                        raise ReadError(f"{where}: NC {nc}'s {name} is n/a (only NEFF rows may lack a figure)")
                    value, digit = printed_bytes(cell, f"{where}: {name}")
                    values[name] = max(values.get(name, 0), value)
                    if name == "shared_scratchpad":
                        shared.append((value, digit))
            else:
                if core is None:
                    raise ReadError(f"{where}: {cells[0]!r} comes before any '\\_NC <n>' row")
                for name, cell in zip(columns, cells[1:]):
                    if cell != "n/a":
                        value = printed_bytes(cell, f"{where}: {name}")[0]
                        cores[core][f"neff_{name}"] = max(cores[core].get(f"neff_{name}", 0), value)
    if not cores:
        raise ReadError(
            f"{path}: no OOM table with NeuronCore rows (a header line starting with TOTAL, then "
            f"'ND <d> Overall' and '\\_NC <n>' rows)"
        )
    page, note = scratchpad_page((v for v, _ in shared), max((d for _, d in shared), default=0))
    what = (
        f"the runtime's OOM table ({tables} in the file): current values when an allocation failed, the largest "
        f"per category over the tables; figures printed to 3 decimals in binary units"
    )
    notes = [what, note] if note else [what]
    return MemoryReading(
        "neuron-oom-table", str(path), "current", dict(sorted(cores.items())), tables, page, tuple(notes)
    )


__all__ = ["REQUIRED", "read", "snake"]
