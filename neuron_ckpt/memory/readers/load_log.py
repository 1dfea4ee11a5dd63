"""What the Neuron runtime logs of each NEFF it loads, with ``NEURON_RT_LOG_LEVEL_TDRV=info``: no profiler, no OOM.

**Documented** (AWS, ``neuron-runtime/explore/device-memory.rst``, "Per-NEFF INFO logs", page dated
2025-10-16; one sample, reproduced in the tests): at each model load the runtime logs::

    2025-May-15 07:41:15.014997 2198754:2198754  INFO  TDRV:dml_log_dev_neff_mem
    [ND 0:NC 0] Current Usage Total: 96.543MB
            shared scratchpad: 0.000B
    Per NEFF memory usage breakdown for [out-test0_meta_concat3]:
            Total: 230.562KB
            * model code: 30.562KB
            * model constants: 24.000KB
            * scratchpad: 0.000B
            * runtime: 95.000KB
            * dma rings io: 61.000KB
            * dma rings spill: 16.000KB
            * dma rings collectives: 0.000B
            * dma rings runtime: 4.000KB
            * collectives: 0.000B

**Inferred, not documented**: the units are binary (:mod:`.printed`); ``NC`` is the core's index on
its device (as in the OOM table's files), so ``cores_per_device`` makes it instance-wide; the
breakdown's ``scratchpad`` is the NEFF's own scratchpad need: the breakdown lists exactly the
columns a NEFF row of the OOM table fills (:mod:`.oom_table`), whose Scratchpad a third party
matched on trn1 to the compiler's "Peak scratchpad usage". Whether ``Current Usage Total`` and
``shared scratchpad`` are taken before or after the load is not said.

:func:`read` returns per NeuronCore: ``current_total`` and ``shared_scratchpad`` (the largest
logged), and ``neff_<item>`` (``neff_total``, ``neff_scratchpad``, ``neff_model_code``, ...): the
largest over the NEFFs loaded on that core. ``neff_scratchpad`` is what ``compare`` compares: for
a training step it is the step graph's scratchpad, exact but for the print's rounding. The lines of
one block must not be interleaved with another process's (give each rank its own log).
"""

from __future__ import annotations

import re
from pathlib import Path

from . import MemoryReading, ReadError, read_lines
from .oom_table import snake
from .printed import printed_bytes

_CORE = re.compile(r"\[ND (\d+):NC (\d+)\] Current Usage Total: (\S+)")
_SHARED = re.compile(r"\s*shared scratchpad: (\S+)\s*")
_NEFF = re.compile(r".*Per NEFF memory usage breakdown for \[(.*)\]:\s*")
_ITEM = re.compile(r"\s*(?:\* )?([A-Za-z][A-Za-z ]*): (\S+)\s*")
REQUIRED = ("neff_total", "neff_scratchpad")


def read(path: str | Path, cores_per_device: int = 2) -> MemoryReading:
    """Read the per-NEFF load blocks in the log ``path``. ``cores_per_device``: 2 on trn1."""
    path = Path(path)
    lines = read_lines(path, lenient=True)
    cores: dict[int, dict[str, int]] = {}
    resolution: dict[int, int] = {}  # per core: the print rounding of its largest neff_scratchpad
    block: dict | None = None  # the load being read: its core and what it has so far
    loads = 0

    def close(number: int) -> None:
        nonlocal block, loads
        if block is None:
            return
        missing = [k for k in ("shared_scratchpad", *REQUIRED) if k not in block["values"]]
        if missing:
            raise ReadError(
                f"{path}: line {block['line']}: the load block of NC {block['nc']} lacks "
                f"{', '.join(missing)} before line {number} (cut short, or interleaved with another process's lines?)"
            )
        values = cores.setdefault(block["core"], {})
        if block["values"]["neff_scratchpad"] >= values.get("neff_scratchpad", -1):
            resolution[block["core"]] = block["digit"]
        for name, value in block["values"].items():
            values[name] = max(values.get(name, 0), value)
        block, loads = None, loads + 1

    for number, line in enumerate(lines, 1):
        where = f"{path}: line {number}"
        if match := _CORE.search(line):
            close(number)
            device, nc = int(match.group(1)), int(match.group(2))
            if nc >= cores_per_device:
                raise ReadError(
                    f"{where}: NC {nc} on ND {device}, but cores_per_device is {cores_per_device} "
                    f"(2 on trn1; trn2: 4 at LNC=2, 8 at LNC=1)"
                )
            total = printed_bytes(match.group(3), f"{where}: Current Usage Total")[0]
            core = device * cores_per_device + nc
            block = {
                "core": core,
                "nc": nc,
                "line": number,
                "neff": False,
                "digit": 1,
                "values": {"current_total": total},
            }
        elif block is None:
            if _NEFF.fullmatch(line):
                raise ReadError(
                    f"{where}: a per-NEFF breakdown with no '[ND <d>:NC <n>] Current Usage Total' line before it"
                )
        elif match := _SHARED.fullmatch(line):
            block["values"]["shared_scratchpad"] = printed_bytes(match.group(1), f"{where}: shared scratchpad")[0]
        elif _NEFF.fullmatch(line):
            block["neff"] = True
        elif block["neff"] and (match := _ITEM.fullmatch(line)):
            name = f"neff_{snake(match.group(1))}"
            value, digit = printed_bytes(match.group(2), f"{where}: {match.group(1)}")
            block["values"][name] = value
            if name == "neff_scratchpad":
                block["digit"] = digit
        elif block["neff"]:
            close(number)
    close(len(lines) + 1)
    if not cores:
        raise ReadError(
            f"{path}: no per-NEFF load block ('[ND <d>:NC <n>] Current Usage Total' ... 'Per NEFF memory usage "
            f"breakdown for [...]'); the runtime logs them with NEURON_RT_LOG_LEVEL_TDRV=info"
        )
    note = (
        f"the runtime's per-NEFF log of {loads} loads: neff_* is the largest over a core's NEFFs (its scratchpad: "
        f"the NEFF's own need), printed to 3 decimals in binary units"
    )
    return MemoryReading(
        "neuron-load-log", str(path), "peak", dict(sorted(cores.items())), loads, max(resolution.values()), (note,)
    )


__all__ = ["REQUIRED", "read"]
