"""Packed token files: the on-disk format, atomic writes, and `PackedDataset`, which validates a
file on open.

File format. A packed file is a safetensors file holding one tensor ``tokens`` of shape
``[num_blocks, block_len]`` (uint16 when every id fits, i.e. vocab_size <= 65536, else uint32)
and string metadata: ``format`` (the magic), ``version``, ``dtype``, ``block_len``,
``num_blocks``, ``vocab_size``, ``tokenizer``, ``eos_id`` and ``sha256`` of the payload bytes.
Safetensors rather than .npy plus a json sidecar because one file is one atomic
``os.replace`` (a sidecar can go stale or missing on its own), the header is plain JSON that
cannot execute code, and any safetensors reader can inspect the file. We read it back by
parsing that header ourselves and memory-mapping the payload: a corpus need not fit in RAM,
and a truncated or forged file gets an error naming the field instead of a parser panic.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..files import write_atomic

FORMAT_MAGIC = "neuron_ckpt.packed_tokens"
FORMAT_VERSION = 1
_TENSOR = "tokens"
_ST_DTYPES = {"U16": np.dtype("<u2"), "U32": np.dtype("<u4")}
_CHUNK_ROWS = 1 << 14  # rows per chunk when hashing / scanning a memory-mapped payload


# ----------------------------------------------------------------------------- file format


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest dtype holding ids 0..vocab_size-1: halves the file for Llama's 32k vocab."""
    if vocab_size < 1 or vocab_size > 2**32:
        raise ValueError(f"vocab_size must be in [1, 2**32], got {vocab_size}")
    return np.dtype("<u2") if vocab_size <= 2**16 else np.dtype("<u4")


def _sha256(rows: np.ndarray) -> str:
    """Hash the payload in chunks so a memory-mapped corpus is never copied whole."""
    h = hashlib.sha256()
    for start in range(0, rows.shape[0], _CHUNK_ROWS):
        h.update(np.ascontiguousarray(rows[start : start + _CHUNK_ROWS]).data)
    return h.hexdigest()


def _max_id(rows: np.ndarray) -> int:
    return max(int(rows[s : s + _CHUNK_ROWS].max()) for s in range(0, rows.shape[0], _CHUNK_ROWS))


def write_packed(
    path: str | os.PathLike,
    blocks: np.ndarray,
    *,
    vocab_size: int,
    tokenizer: str,
    eos_id: int | None = None,
) -> Path:
    """Write ``blocks`` [num_blocks, block_len] atomically as a packed file; return the path.

    Ids are range-checked here too, so a bad file is refused when written, not at train time.
    """
    from safetensors.numpy import save

    path = Path(path)
    blocks = np.asarray(blocks)
    if blocks.ndim != 2 or blocks.shape[0] < 1 or blocks.shape[1] < 1:
        raise ValueError(f"{path}: blocks must be [num_blocks>=1, block_len>=1], got shape {blocks.shape}")
    dtype = token_dtype(vocab_size)
    if blocks.min() < 0 or _max_id(blocks) >= vocab_size:
        raise ValueError(f"{path}: token ids must be in [0, {vocab_size}), got [{blocks.min()}, {blocks.max()}]")
    payload = np.ascontiguousarray(blocks, dtype=dtype)
    meta = {
        "format": FORMAT_MAGIC,
        "version": str(FORMAT_VERSION),
        "dtype": dtype.name,
        "block_len": str(payload.shape[1]),
        "num_blocks": str(payload.shape[0]),
        "vocab_size": str(vocab_size),
        "tokenizer": tokenizer,
        "eos_id": "" if eos_id is None else str(eos_id),
        "sha256": _sha256(payload),
    }
    write_atomic(path, save({_TENSOR: payload}, metadata=meta))
    return path


def _read_header(path: Path) -> tuple[dict, int, int]:
    """Return (safetensors header, payload start, file size); ValueError if not safetensors."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{path}: format: not a packed token file ({size} bytes, too short)")
        (header_len,) = struct.unpack("<Q", head)
        if header_len > min(size - 8, 100 << 20):
            raise ValueError(
                f"{path}: format: not a packed token file (header length {header_len} does not "
                f"fit in a {size}-byte file; truncated or not safetensors)"
            )
        raw = f.read(header_len)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: format: header is not safetensors JSON ({e})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: format: header is not a JSON object")
    return header, 8 + header_len, size


def _require(path: Path, field: str, got: object, expected: object) -> None:
    if got != expected:
        raise ValueError(f"{path}: {field} is {got!r}, expected {expected!r}")


def _int_field(path: Path, meta: dict, field: str) -> int:
    value = meta.get(field)
    try:
        return int(value)  # type: ignore[arg-type]  # None raises the TypeError caught below
    except (TypeError, ValueError):
        raise ValueError(f"{path}: metadata field {field!r} must be an integer, got {value!r}") from None


@dataclass(frozen=True)
class PackedInfo:
    """What a packed file's header says about it."""

    block_len: int
    num_blocks: int
    vocab_size: int
    dtype: str
    tokenizer: str
    eos_id: int | None
    sha256: str


def _parse_info(path: Path, header: dict) -> tuple[PackedInfo, dict]:
    meta = header.get("__metadata__") or {}
    _require(path, "metadata field 'format' (magic)", meta.get("format"), FORMAT_MAGIC)
    _require(path, "metadata field 'version'", meta.get("version"), str(FORMAT_VERSION))
    info = PackedInfo(
        block_len=_int_field(path, meta, "block_len"),
        num_blocks=_int_field(path, meta, "num_blocks"),
        vocab_size=_int_field(path, meta, "vocab_size"),
        dtype=meta.get("dtype", ""),
        tokenizer=meta.get("tokenizer", ""),
        eos_id=int(meta["eos_id"]) if meta.get("eos_id") else None,
        sha256=meta.get("sha256", ""),
    )
    tensor = header.get(_TENSOR)
    if not isinstance(tensor, dict):
        raise ValueError(f"{path}: format: no tensor named {_TENSOR!r} in the file")
    if not 1 <= info.vocab_size <= 2**32:
        raise ValueError(f"{path}: vocab_size must be in [1, 2**32], got {info.vocab_size}")
    _require(path, "dtype", info.dtype, token_dtype(info.vocab_size).name)
    st_dtype = _ST_DTYPES.get(str(tensor.get("dtype")))
    _require(path, f"tensor {_TENSOR!r} dtype", st_dtype, np.dtype(info.dtype))
    shape = [info.num_blocks, info.block_len]
    _require(path, f"tensor {_TENSOR!r} shape", tensor.get("shape"), shape)
    if min(shape) < 1:
        raise ValueError(f"{path}: num_blocks and block_len must be >= 1, got {shape}")
    return info, tensor


def _data_offsets(path: Path, tensor: dict) -> tuple[int, int]:
    offsets = tensor.get("data_offsets")
    if not (isinstance(offsets, list) and len(offsets) == 2):
        raise ValueError(f"{path}: format: data_offsets must be [begin, end], got {offsets!r}")
    return int(offsets[0]), int(offsets[1])


def _open_payload(path: Path) -> tuple[PackedInfo, np.ndarray]:
    """Check the header against the bytes on disk and memory-map the token payload."""
    if not path.is_file():
        raise ValueError(f"{path}: packed token file does not exist")
    header, data_start, size = _read_header(path)
    info, tensor = _parse_info(path, header)
    begin, end = _data_offsets(path, tensor)
    nbytes = info.num_blocks * info.block_len * np.dtype(info.dtype).itemsize
    _require(path, "payload byte length", end - begin, nbytes)
    if size < data_start + end:
        raise ValueError(f"{path}: truncated payload: file has {size} bytes, header needs {data_start + end}")
    _require(path, "file size (trailing bytes after the payload)", size, data_start + end)
    shape = (info.num_blocks, info.block_len)
    tokens = np.memmap(path, dtype=info.dtype, mode="r", offset=data_start + begin, shape=shape)
    return info, tokens


def _stamp_path(path: Path) -> Path:
    return path.with_name(path.name + ".verified")


def _stamp(path: Path, info: PackedInfo) -> dict:
    """What identifies this version of the file: a rewrite (new inode, size or mtime) or another
    header checksum makes an old stamp stale."""
    st = path.stat()
    return {"sha256": info.sha256, "vocab_size": info.vocab_size, "size": st.st_size,
            "inode": st.st_ino, "mtime_ns": st.st_mtime_ns}  # fmt: skip


def _read_stamp(path: Path) -> dict | None:
    try:
        return json.loads(_stamp_path(path).read_text())
    except (OSError, ValueError):
        return None


class PackedDataset(torch.utils.data.Dataset):
    """Fixed-length token blocks from a packed file, validated when opened.

    Every check raises ValueError naming the file, the field and what was expected, because a
    silently wrong corpus (truncated copy, other tokenizer, other sequence length) costs a
    training run, not a crash. ``verify_checksum=False`` skips hashing for very large files.

    The two full scans (sha256 of the payload, largest token id) run once per version of the
    file: when they pass, a stamp ``<file>.verified`` (the checksum, size, inode and mtime) is
    written beside it, and an open that finds a matching stamp skips them. So 32 ranks opening
    a corpus do not each read all of it (the tutorial scans on one rank per host first). The
    header checks above run on every open.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        expected_seq_len: int | None = None,
        expected_vocab_size: int | None = None,
        verify_checksum: bool = True,
    ) -> None:
        self.path = Path(path)
        self.info, self.tokens = _open_payload(self.path)
        if expected_seq_len is not None:
            _require(self.path, "block_len (sequence length)", self.block_len, expected_seq_len)
        if expected_vocab_size is not None:
            _require(self.path, "vocab_size", self.info.vocab_size, expected_vocab_size)
        stamp = _stamp(self.path, self.info)
        if verify_checksum and _read_stamp(self.path) == stamp:
            return  # this very file passed both scans before
        if verify_checksum:
            _require(self.path, "payload sha256 (checksum)", _sha256(self.tokens), self.info.sha256)
        if (top := _max_id(self.tokens)) >= self.info.vocab_size:
            raise ValueError(
                f"{self.path}: token id {top} out of range: ids must be < vocab_size {self.info.vocab_size}"
            )
        if verify_checksum:
            try:
                write_atomic(_stamp_path(self.path), json.dumps(stamp).encode())
            except OSError:
                pass  # a read-only data directory: scan again next time

    @property
    def block_len(self) -> int:
        return self.info.block_len

    def __len__(self) -> int:
        return self.info.num_blocks

    def __getitem__(self, index: int) -> torch.Tensor:
        if not -len(self) <= index < len(self):
            raise IndexError(f"block {index} out of range for {len(self)} blocks in {self.path}")
        return torch.from_numpy(self.tokens[index].astype(np.int64))

    def get_blocks(self, indices: Sequence[int] | np.ndarray) -> torch.Tensor:
        """Blocks at ``indices`` as one LongTensor [len(indices), block_len] (one gather)."""
        return torch.from_numpy(self.tokens[np.asarray(indices)].astype(np.int64))
