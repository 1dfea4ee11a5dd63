"""The files of a checkpoint: tensors in safetensors files, a group at a time, the structure around
them in a ``.pt``, and a sha256 beside every file.

Tensors are written by ``safetensors.torch.save_file`` in groups of at most ``chunk_bytes`` (a
larger tensor alone), one file per group (``{prefix}-00001-of-00003.safetensors``, as Hugging
Face numbers shards): each group is copied to host memory, written and dropped before the next
is copied, so a save holds one group on the host, not the rank's whole state. A group is whole
tensors: on XLA slicing a device tensor would run a graph. The ``-of-`` count lets the commit
tell a complete set of groups from a partial one by the names alone.

Nested state (an optimizer's dicts, lists and tuples around its tensors) is :func:`split` into
its tensors, named by their path in the state (``optimizer/inner/state/0/exp_avg``), and the
structure with a :class:`TensorRef` in place of each tensor, which goes to a ``.pt`` read back
with ``torch.load(weights_only=True)`` (plain containers and :data:`SAFE_GLOBALS` only, no code).

Every file is written under a temporary name, hashed, fsynced and renamed into place, then its
``.sha256`` is written beside it. A reader compares the file with that digest before handing it
to safetensors or ``torch.load``, so a missing, truncated or bit-flipped file is a ``ValueError``
naming the file, never a parser's own error about a damaged header.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, BinaryIO

import torch
from safetensors.torch import load_file, save_file

from ..distributed.random import RNGState
from ..files import write_atomic

_GROUP = re.compile(r"^(.+)-(\d{5})-of-(\d{5})\.safetensors$")


@dataclass(frozen=True)
class TensorRef:
    """Stands in a ``.pt`` structure for the tensor stored under ``key`` in the safetensors files."""

    key: str


SAFE_GLOBALS: list[Any] = [RNGState, TensorRef]  # the only non-container classes a ``.pt`` file holds


# ---- files and digests -------------------------------------------------------------------------


def _sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _sha256(f: BinaryIO) -> str:
    digest = hashlib.sha256()
    while block := f.read(1 << 24):
        digest.update(block)
    return digest.hexdigest()


def _write_checked(path: Path, write: Callable[[Path], None]) -> None:
    """``write(tmp)`` creates the file under a temporary name; it is hashed (as it is on disk),
    fsynced and renamed to ``path``, then its ``.sha256`` is written beside it."""
    tmp = path.with_name(f".{path.name}.tmp")
    write(tmp)
    with open(tmp, "rb") as f:
        digest = _sha256(f)
        os.fsync(f.fileno())
    os.replace(tmp, path)
    write_atomic(_sidecar(path), digest.encode())


def _corrupt(path: Path, why: str) -> ValueError:
    return ValueError(f"{path}: {why}: the file is truncated or corrupt; resume from an earlier checkpoint")


def _check(path: Path) -> None:
    """Compare ``path`` with the sha256 recorded beside it; nothing has parsed it yet."""
    try:
        want = _sidecar(path).read_text().strip()
        with open(path, "rb") as f:
            got = _sha256(f)
    except OSError as e:
        raise ValueError(f"{path}: missing or unreadable checkpoint file ({e})") from None
    if got != want:
        raise _corrupt(path, f"sha256 {got[:12]}... does not match the {want[:12]}... recorded when it was written")


# ---- tensors: groups of safetensors files ------------------------------------------------------


def _group_file(prefix: str, index: int, count: int) -> str:
    """The name of group ``index`` (from 1) of ``count``."""
    return f"{prefix}-{index:05d}-of-{count:05d}.safetensors"


def group_files(names: Iterable[str], prefix: str) -> list[str] | None:
    """The group files of ``prefix`` among ``names``, in order; None unless all are there."""
    found = sorted(n for n in names if (m := _GROUP.match(n)) and m.group(1) == prefix)
    if not found:
        return None
    count = int(_GROUP.match(found[0]).group(3))  # type: ignore[union-attr]  # found: the names _GROUP matched
    want = [_group_file(prefix, i, count) for i in range(1, count + 1)]
    return want if found == want else None


def _groups(tensors: list[tuple[str, torch.Tensor]], limit: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Consecutive runs of tensors of at most ``limit`` bytes (a larger tensor forms its own)."""
    group: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in tensors:
        n = t.numel() * t.element_size()
        if group and size + n > limit:
            yield group
            group, size = [], 0
        group.append((name, t))
        size += n
    if group:
        yield group


def _to_host(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """One group copied to host memory, contiguous. CPU tensors are copied too: safetensors
    refuses tensors that overlap in memory, and the copy is what the file holds even if the
    training state changes while it is written."""
    return [t.detach().to("cpu", copy=True, memory_format=torch.contiguous_format) for t in tensors]


def write_tensors(
    directory: Path, prefix: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str], chunk_bytes: int
) -> None:
    """``tensors`` (device or CPU) as ``{prefix}-*-of-*.safetensors`` in ``directory``, one group
    of at most ``chunk_bytes`` per file. At least one file, so that "no tensors" has a file too."""
    groups = list(_groups(list(tensors.items()), chunk_bytes)) or [[]]
    metadata = {"format": "pt", **metadata}
    for index, group in enumerate(groups, 1):
        host = dict(zip([name for name, _ in group], _to_host([t for _, t in group])))
        _write_checked(directory / _group_file(prefix, index, len(groups)), partial(save_file, host, metadata=metadata))
        del host  # before the next group reaches the host


def read_tensors(directory: Path, names: list[str]) -> dict[str, torch.Tensor]:
    """The tensors of the files ``names`` in ``directory``, each checked against its digest first.

    Copied out of the file mapping ``load_file`` returns: a torch optimizer keeps same-device state
    it is given, and restored state must not depend on a checkpoint file that pruning may delete.
    """
    tensors: dict[str, torch.Tensor] = {}
    for name in names:
        _check(directory / name)
        tensors.update({k: v.clone() for k, v in load_file(directory / name).items()})
    return tensors


# ---- structure: a weights_only .pt -------------------------------------------------------------


def write_structure(path: Path, obj: Any) -> None:
    def save(tmp: Path) -> None:
        with open(tmp, "wb") as f:
            torch.save(obj, f)

    _write_checked(path, save)


def read_structure(path: Path) -> Any:
    _check(path)
    with torch.serialization.safe_globals(SAFE_GLOBALS):
        return torch.load(path, map_location="cpu", weights_only=True)


def split(obj: Any, path: str, out: dict[str, torch.Tensor]) -> Any:
    """``obj`` with every tensor inside dicts/lists/tuples moved into ``out`` under its path
    below ``path`` (a state dict's own names when ``path`` is ""), a TensorRef left in its place."""
    if isinstance(obj, torch.Tensor):
        key = path or "tensor"
        while key in out:
            key += "'"
        out[key] = obj
        return TensorRef(key)
    if isinstance(obj, dict):
        items = {k: split(v, f"{path}/{k}" if path else str(k), out) for k, v in obj.items()}
        return OrderedDict(items) if isinstance(obj, OrderedDict) else items
    if isinstance(obj, (list, tuple)):
        return type(obj)(split(v, f"{path}/{i}" if path else str(i), out) for i, v in enumerate(obj))
    return obj


def join(obj: Any, tensors: dict[str, torch.Tensor], source: Path) -> Any:
    """The inverse of :func:`split`; a reference missing from ``tensors`` is an error naming ``source``."""
    if isinstance(obj, TensorRef):
        if obj.key not in tensors:
            raise _corrupt(source, f"no tensor {obj.key!r}")
        return tensors[obj.key]
    if isinstance(obj, dict):
        items = {k: join(v, tensors, source) for k, v in obj.items()}
        return OrderedDict(items) if isinstance(obj, OrderedDict) else items
    if isinstance(obj, (list, tuple)):
        return type(obj)(join(v, tensors, source) for v in obj)
    return obj
