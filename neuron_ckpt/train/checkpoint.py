"""Sharded training checkpoints: one file per rank, committed atomically, last K kept.

Layout under ``directory`` (a filesystem every rank sees, e.g. FSx on a cluster)::

    step_00000100/rank_00000.pt ... rank_{world-1}.pt, rank_*.pt.sha256, meta.json
    latest                        # text: the name of the newest complete checkpoint

A save never leaves something that looks complete but is not: every rank writes its shard into
``.tmp_step_...`` (temp file, fsync, rename), all ranks meet at a barrier, then rank 0 writes
``meta.json``, renames the directory to ``step_...`` and only then replaces ``latest`` (temp
file + fsync + ``os.replace`` + directory fsync). A crash at any point leaves ``latest`` on the
previous complete checkpoint. Then checkpoints beyond the newest ``keep_last`` are deleted.

Loading checks before unpickling anything: ``meta.json`` must parse and match the run's layout,
and each shard must match the sha256 written beside it, so a truncated or bit-flipped file is a
``ValueError`` naming the file rather than an unpickling error deep inside torch. Shards are
read with ``torch.load(weights_only=True)``: tensors and plain containers only, no code.

A shard holds only this rank's tensor-parallel slice of the model and its ZeRO-1 slice of the
optimizer, so a checkpoint loads only at the tensor- and data-parallel sizes it was saved at;
:meth:`CheckpointManager.load` refuses any other layout with a message saying what differs and
how to move weights to another layout (through a ``transformers`` state dict).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from ..distributed import runtime
from ..distributed.random import RNGState

LATEST = "latest"
_STEP_DIR = re.compile(r"^step_(\d{8,})$")
FORMAT = "neuron_ckpt.train.checkpoint/1"
SAFE_GLOBALS = [RNGState]  # the only non-container class a shard holds (RNG tracker snapshots)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: Path, write) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()


def to_cpu(obj: Any) -> Any:
    """Tensors (device or XLA) copied to CPU inside nested dicts/lists, so torch.save is portable."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(v) for v in obj)
    return obj


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


class CheckpointManager:
    """Save / find / load the sharded checkpoints of one run. Every rank constructs one."""

    def __init__(self, directory: str | os.PathLike, keep_last: int = 3, rank: int = 0, world_size: int = 1):
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {keep_last}")
        self.directory = Path(directory)
        self.keep_last, self.rank, self.world_size = keep_last, rank, world_size

    def _shard_name(self, rank: int) -> str:
        return f"rank_{rank:05d}.pt"

    def complete(self) -> list[Path]:
        """Complete checkpoints (directories with ``meta.json``), oldest first."""
        if not self.directory.is_dir():
            return []
        found = [p for p in self.directory.iterdir() if _STEP_DIR.match(p.name) and (p / "meta.json").is_file()]
        return sorted(found, key=lambda p: int(_STEP_DIR.match(p.name).group(1)))

    def save(self, step: int, shard: dict[str, Any], meta: dict[str, Any]) -> Path:
        """Write this rank's ``shard``; rank 0 also writes ``meta``. A collective: all ranks call it."""
        name = step_dir_name(step)
        final, tmp = self.directory / name, self.directory / f".tmp_{name}"
        if self.rank == 0:
            self.directory.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
        runtime.barrier()
        cpu_shard = to_cpu(shard)
        shard_path = tmp / self._shard_name(self.rank)
        _write_atomic(shard_path, lambda f: torch.save(cpu_shard, f))
        digest = _sha256(shard_path)
        _write_atomic(shard_path.with_name(shard_path.name + ".sha256"), lambda f: f.write(digest.encode()))
        runtime.barrier()
        if self.rank == 0:
            present = sorted(p.name for p in tmp.glob("rank_*.pt.sha256"))
            if len(present) != self.world_size:
                raise RuntimeError(f"checkpoint {tmp}: {len(present)} shards written, expected {self.world_size}")
            full_meta = {"format": FORMAT, "step": step, "world_size": self.world_size, **meta}
            _write_atomic(tmp / "meta.json", lambda f: f.write(json.dumps(full_meta, indent=1).encode()))
            _fsync_dir(tmp)
            if final.exists():  # the same step saved again (e.g. after a resume): replace it
                shutil.rmtree(final)
            os.replace(tmp, final)
            _write_atomic(self.directory / LATEST, lambda f: f.write(name.encode()))
            _fsync_dir(self.directory)
            self._prune()
        runtime.barrier()
        return final

    def _prune(self) -> None:
        keep = self.complete()[-self.keep_last :]
        for path in self.complete():
            if path not in keep:
                shutil.rmtree(path, ignore_errors=True)

    def resolve(self, which: str) -> Path | None:
        """``"latest"`` -> the checkpoint ``latest`` names (None if there is none yet); else a path."""
        if which == LATEST:
            pointer = self.directory / LATEST
            if not pointer.is_file():
                return None
            path = self.directory / pointer.read_text().strip()
        else:
            path = Path(which)
        if not (path / "meta.json").is_file():
            raise FileNotFoundError(f"{path} is not a complete checkpoint (no meta.json)")
        return path

    def load(self, path: Path, expect: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """``(shard, meta)`` of this rank; ``expect`` fields (tp_size, dp_size, ...) must match meta."""
        try:
            meta = json.loads((path / "meta.json").read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{path / 'meta.json'}: unreadable checkpoint metadata ({e})") from None
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise ValueError(f"{path / 'meta.json'}: format must be {FORMAT!r}, got {meta.get('format') if isinstance(meta, dict) else meta!r}")
        expect = {"world_size": self.world_size, **expect}
        diffs = {k: (meta.get(k), v) for k, v in expect.items() if meta.get(k) != v}
        if diffs:
            said = ", ".join(f"{k}: checkpoint {a!r}, this run {b!r}" for k, (a, b) in diffs.items())
            raise ValueError(
                f"cannot resume from {path}: {said}. A sharded checkpoint holds per-rank tensor-parallel "
                "weight slices and ZeRO-1 optimizer slices, so it loads only at the layout it was saved "
                "with. To change the layout, export the weights at the old layout (train.py --export-hf "
                "weights.safetensors --max-steps <the checkpoint's step> --resume latest) and start the new "
                "run from them with --init-hf weights.safetensors (optimizer state starts fresh)."
            )
        shard_path = path / self._shard_name(self.rank)
        try:
            want = shard_path.with_name(shard_path.name + ".sha256").read_text().strip()
            got = _sha256(shard_path)
        except OSError as e:
            raise ValueError(f"{shard_path}: missing or unreadable checkpoint shard ({e})") from None
        if got != want:
            raise ValueError(
                f"{shard_path}: sha256 {got[:12]}... does not match the {want[:12]}... recorded when it was "
                "written: the file is truncated or corrupt; resume from an earlier checkpoint"
            )
        with torch.serialization.safe_globals(SAFE_GLOBALS):
            shard = torch.load(shard_path, map_location="cpu", weights_only=True)
        return shard, meta
