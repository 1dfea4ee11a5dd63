"""Reading a sharded checkpoint back (:mod:`~neuron_ckpt.train.checkpoint` says the layout): the
names, which checkpoints are complete, ``meta.json`` checked before anything is deserialised, and
one rank's state put back together from its own files and its TP rank's model files."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

from .placement import Placement, saved
from .tensor_files import join, read_structure, read_tensors

LATEST = "latest"
STEP_DIR = re.compile(r"^step_(\d{8,})$")
DELETING = ".deleting_"
FORMAT_NAME = "neuron_ckpt.train.checkpoint"
FORMAT_VERSION = 2
FORMAT = f"{FORMAT_NAME}/{FORMAT_VERSION}"


def step_of(path: Path) -> int:
    return int(STEP_DIR.match(path.name).group(1))  # type: ignore[union-attr]  # only for names it matched


def rank_prefix(rank: int) -> str:
    return f"rank_{rank:05d}"


def complete(directory: Path) -> list[Path]:
    """Complete checkpoints under ``directory`` (``step_...`` directories with ``meta.json``),
    lowest step first; temporary and half-removed directories are not listed."""
    if not directory.is_dir():
        return []
    found = [p for p in directory.iterdir() if STEP_DIR.match(p.name) and (p / "meta.json").is_file()]
    return sorted(found, key=step_of)


def read_meta(path: Path) -> dict[str, Any]:
    """``meta.json`` of the checkpoint at ``path``, refused unless it is this format."""
    try:
        meta = json.loads((path / "meta.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path / 'meta.json'}: unreadable checkpoint metadata ({e})") from None
    got = meta.get("format") if isinstance(meta, dict) else meta
    if got == FORMAT:
        return meta
    if isinstance(got, str) and got.startswith(FORMAT_NAME + "/"):
        raise ValueError(
            f"{path / 'meta.json'}: checkpoint format {got!r}, but this version of neuron_ckpt reads "
            f"{FORMAT!r} only (format 1 stored the whole model slice in every rank's file; format 2 "
            "stores it once per TP rank, in model_tp*.safetensors). Continue that run with the "
            "neuron_ckpt version that wrote it, or export its weights there (train.py --export-hf "
            "hf_weights/ --max-steps <its step> --resume <it>) and start from them here with "
            "--init-hf hf_weights/ (optimizer state starts fresh)."
        )
    raise ValueError(f"{path / 'meta.json'}: format must be {FORMAT!r}, got {got!r}")


def load_rank_state(
    path: Path, rank: int, world_size: int, place: Placement, expect: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(rank_state, meta)`` of ``rank``; ``expect`` fields (tp_size, dp_size, ...) must match meta.

    ``rank_state`` has the rank's own entries and the shared ones (the model) from the files of its
    TP rank (``place``)."""
    meta = read_meta(path)
    expect = {"world_size": world_size, "ep_size": place.ep_size, **expect}
    diffs = {k: (saved(meta, k), v) for k, v in expect.items() if saved(meta, k) != v}
    if diffs:
        said = ", ".join(f"{k}: checkpoint {a!r}, this run {b!r}" for k, (a, b) in diffs.items())
        raise ValueError(
            f"cannot resume from {path}: {said}. A sharded checkpoint holds per-rank tensor-parallel "
            "weight slices (of its pipeline stage) and ZeRO-1 optimizer slices, so it loads only at the layout "
            "it was saved with. To change the layout, export the weights at the old layout (train.py --export-hf "
            "hf_weights/ --max-steps <the checkpoint's step> --resume latest) and start the new run "
            "from them with --init-hf hf_weights/ (optimizer state starts fresh)."
        )

    def tensors_of(prefix: str) -> dict[str, torch.Tensor]:
        files = meta.get("groups", {}).get(prefix)
        if not files:
            raise ValueError(f"{path / 'meta.json'}: no files listed for {prefix!r}")
        return read_tensors(path, files)

    structure_file = path / f"{rank_prefix(rank)}.pt"
    structure = read_structure(structure_file)
    own = tensors_of(rank_prefix(rank))
    rank_state = {}
    for key, value in structure.items():
        if key in meta["shared"]:
            prefix = place.shared_prefix(key)
            rank_state[key] = join(value, tensors_of(prefix), path / f"{prefix}-*.safetensors")
        else:
            rank_state[key] = join(value, own, structure_file)
    return rank_state, meta
