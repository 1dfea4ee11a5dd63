"""The scratchpad one compiled graph needs, as the Neuron compiler fixed it in the NEFF.

AWS's neuron-runtime "device memory" page (appendix "NEFF format for scratchpad variables"): an
unpacked NEFF's ``sg00/def.json`` (and ``sg01/def.json`` at trn2 logical-core size 2) has a
``"var"`` object of entries like ``{"backing_variable_off": 17108992, "size": 131072, "type":
"virtual", "var_id": 2349}``; ``virtual`` vars are scratchpad, and the runtime's need is
max(``backing_variable_off`` + ``size``) over them (they overlap: the compiler packs by
liveness). A ``.neff`` file is a 1024-byte header and a tarball (``work-with-neff-files``), read
here whether or not it is compressed. :func:`read` takes a ``def.json``, an unpacked NEFF directory or a
``.neff``; the figures are exact (no page; the runtime rounds the scratchpad up to its page).

Per subgraph (``sg<NN>`` gives the index): ``model_shared_scratchpad``, the extent of the
``main`` area; ``scratchpad_<area>`` for a virtual var whose ``fabric_path`` (else ``backing_buf``)
names another area (``sharded``, ``alt``: third-party analyses, not AWS; how the runtime
allocates those areas is unconfirmed, and a note says so); ``inputs`` and ``outputs``, the summed
sizes of ``input`` / ``output`` vars (informational: their mapping to NRT's ``tensors`` is
unconfirmed). A def.json with no virtual var reads as a scratchpad of 0 with a note, not as an
error: a graph whose intermediates all stay on chip needs none, and a file of the wrong kind is
still caught (no ``"var"`` object).
"""

from __future__ import annotations

import io
import json
import re
import tarfile
import zlib
from pathlib import Path

from . import MemoryReading, ReadError, byte_count

HEADER_BYTES = 1024
MAIN = "model_shared_scratchpad"
_SUBGRAPH = re.compile(r"sg(\d+)")
_MEMBER = re.compile(r"(?:\./)?sg(\d+)/def\.json")


def _subgraph(data: bytes, where: str, notes: list[str]) -> dict[str, int]:
    try:
        definition = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ReadError(f"{where}: not JSON ({exc})") from None
    if not isinstance(definition, dict) or not isinstance(definition.get("var"), dict):
        raise ReadError(f"{where}: not a NEFF def.json (no 'var' object)")
    extents: dict[str, int] = {}
    sums = {"inputs": 0, "outputs": 0}
    for name, entry in definition["var"].items():
        if not isinstance(entry, dict):
            raise ReadError(f"{where}: var {name!r} is {entry!r}, not an object")
        kind = entry.get("type")
        if kind == "virtual":
            area = entry.get("fabric_path", entry.get("backing_buf", "main"))
            if not isinstance(area, str) or not area:
                raise ReadError(f"{where}: virtual var {name!r} names its area {area!r}, not a string")
            end = byte_count(entry, "backing_variable_off", f"{where}: virtual var {name!r}")
            end += byte_count(entry, "size", f"{where}: virtual var {name!r}")
            category = MAIN if area == "main" else f"scratchpad_{area}"
            extents[category] = max(extents.get(category, 0), end)
        elif kind in ("input", "output"):
            sums[f"{kind}s"] += byte_count(entry, "size", f"{where}: {kind} var {name!r}")
    if not extents:
        notes.append(f"{where}: no virtual var, so no scratchpad (0 bytes)")
    for category in sorted(set(extents) - {MAIN}):
        notes.append(
            f"{where}: virtual vars in area {category[len('scratchpad_') :]!r} are kept apart as "
            f"{category!r}; how the runtime allocates that area is unconfirmed"
        )
    return {MAIN: extents.pop(MAIN, 0), **extents, **sums}


def _read_bytes(file: Path) -> bytes:
    try:
        return file.read_bytes()
    except OSError as exc:
        raise ReadError(f"{file}: cannot read it ({exc})") from None


def _from_neff(path: Path) -> dict[int, tuple[str, bytes]]:
    payload = io.BytesIO(_read_bytes(path)[HEADER_BYTES:])
    try:
        with tarfile.open(fileobj=payload, mode="r:*") as archive:
            found = {}
            for member in archive.getmembers():
                match = _MEMBER.fullmatch(member.name)
                if match and member.isfile():
                    found[int(match.group(1))] = (member.name, archive.extractfile(member).read())  # type: ignore[union-attr]  # a file member: never None
    except (tarfile.TarError, EOFError, OSError, zlib.error) as exc:  # tarfile's message has several lines
        raise ReadError(
            f"{path}: not a NEFF (no tar archive after a {HEADER_BYTES}-byte header: {' '.join(str(exc).split())})"
        ) from None
    return found


def _from_directory(path: Path) -> dict[int, tuple[str, bytes]]:
    found = {}
    for file in path.glob("sg*/def.json"):
        match = _SUBGRAPH.fullmatch(file.parent.name)
        if match:
            found[int(match.group(1))] = (str(file.relative_to(path)), _read_bytes(file))
    return found


def read(path: str | Path) -> MemoryReading:
    """Read the scratchpad extent of every subgraph in a ``def.json``, an unpacked NEFF
    directory or a ``.neff`` file; cores are subgraph indices (``sg00`` is 0)."""
    path = Path(path)
    if not path.exists():
        raise ReadError(f"{path}: no such file or directory")
    if path.is_dir() or path.suffix == ".neff":
        found = _from_directory(path) if path.is_dir() else _from_neff(path)
        if 0 not in found:
            raise ReadError(f"{path}: no sg00/def.json in it (not an unpacked NEFF, or not a NEFF)")
        found = {index: (f"{path}: {name}", data) for index, (name, data) in found.items()}
    else:
        match = _SUBGRAPH.fullmatch(path.parent.name)
        found = {int(match.group(1)) if match else 0: (str(path), _read_bytes(path))}
    notes: list[str] = []
    cores = {index: _subgraph(data, where, notes) for index, (where, data) in sorted(found.items())}
    return MemoryReading("neff", str(path), "peak", cores, notes=tuple(notes))


__all__ = ["HEADER_BYTES", "read"]
