"""Already tokenized datasets, packed as they are: a saved HF dataset (``save_to_disk``) whose rows
hold ``input_ids`` of one block each, such as NxD's ``wikicorpus_llama2_tokenized_4k``
(``get_dataset.py``: BOS-separated documents cut into 4096-token blocks; its ``attention_mask``
and ``labels`` columns are all ones and a copy of the ids, so they are not read).

Rows are not re-packed: every row must already be ``seq_len`` long (a different length means the
dataset was cut for another block size, which a concatenate-and-cut would hide), and every id
must be in ``[0, vocab_size)``. Either problem is one ``ValueError`` naming the row.
"""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import numpy as np

from .corpus import PackResult
from .packed import token_dtype

COLUMN = "input_ids"
_ROWS = 1024  # rows read at a time


def _load(path: Path):
    if importlib.util.find_spec("datasets") is None:
        raise ValueError(f"input {path}: a saved HF dataset needs the `datasets` package (not installed)")
    import datasets

    ds = datasets.load_from_disk(str(path))
    return list(ds.values()) if isinstance(ds, datasets.DatasetDict) else [ds]


def is_tokenized_dataset(path: str | Path) -> bool:
    """A saved HF dataset directory whose (first) split has an ``input_ids`` column."""
    path = Path(path)
    if not path.is_dir() or not ((path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists()):
        return False
    return COLUMN in _load(path)[0].column_names


def pack_tokenized_dataset(path: str | Path, seq_len: int, vocab_size: int) -> PackResult:
    """The rows of every split of the saved dataset at ``path``, in order, as ``[rows, seq_len]``
    blocks of the smallest dtype holding ``vocab_size`` ids."""
    path, t0 = Path(path), time.perf_counter()
    dtype = token_dtype(vocab_size)
    parts, row0 = [], 0
    for split in _load(path):
        if COLUMN not in split.column_names:
            raise ValueError(f"input {path}: no column {COLUMN!r}; columns are {split.column_names}")
        blocks = np.empty((len(split), seq_len), dtype=dtype)
        for start in range(0, len(split), _ROWS):
            rows = split[start : start + _ROWS][COLUMN]
            for i, row in enumerate(rows):
                if len(row) != seq_len:
                    raise ValueError(
                        f"input {path}: row {row0 + start + i} has {len(row)} tokens, not --seq-len {seq_len} "
                        f"(tokenized rows are packed as they are: pass --seq-len {len(row)}, or tokenize for {seq_len})"
                    )
            ids = np.asarray(rows, dtype=np.int64)
            bad = (ids < 0) | (ids >= vocab_size)
            if bad.any():
                r, c = map(int, np.argwhere(bad)[0])
                raise ValueError(
                    f"input {path}: row {row0 + start + r} has id {int(ids[r, c])} outside the vocabulary "
                    f"[0, {vocab_size}) (--vocab-size / --tokenizer must be the one that tokenized it)"
                )
            blocks[start : start + len(rows)] = ids
        parts.append(blocks)
        row0 += len(split)
    if row0 == 0:
        raise ValueError(f"input {path}: the dataset has no rows")
    blocks = np.concatenate(parts)
    return PackResult(blocks, len(blocks), blocks.size, 0, time.perf_counter() - t0)
