"""Committing a sharded checkpoint atomically, and removing old ones (rank 0, after every rank wrote).

:func:`commit` checks that every rank's and TP rank's files are in the temporary directory,
writes ``meta.json``, fsyncs, renames the directory to ``step_...`` and only then replaces
``latest``: a crash at any point leaves ``latest`` on the previous complete checkpoint. A
checkpoint is removed by renaming it to ``.deleting_step_...`` first (:func:`rename_away`), then
deleting that, so a kill part-way never leaves a ``step_...`` with ``meta.json`` but a file gone.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..files import fsync_dir, write_atomic
from .checkpoint_read import DELETING, FORMAT, LATEST, complete, rank_prefix, step_of
from .placement import Placement
from .tensor_files import group_files


def commit(
    directory: Path,
    tmp: Path,
    final: Path,
    step: int,
    world_size: int,
    place: Placement,
    meta: dict[str, Any],
    shared: list[str],
    prune: Callable[[str], None],
) -> tuple[int, int, int]:
    """Turn ``tmp`` into the checkpoint ``final`` and point ``latest`` at it, then ``prune(name)``.
    Returns ``(bytes on disk, bytes of the model files, files)``."""
    names = {p.name for p in tmp.iterdir()}
    prefixes = [rank_prefix(r) for r in range(world_size)]
    shared_prefixes = {key: place.shared_prefixes(key) for key in shared}
    groups = {p: group_files(names, p) for p in prefixes + [p for ps in shared_prefixes.values() for p in ps]}
    missing = [f"{p}-*.safetensors" for p, files in groups.items() if files is None]
    expected = [f for files in groups.values() for f in files or ()] + [f"{p}.pt" for p in prefixes]
    missing += [f for f in expected if f"{f}.sha256" not in names]
    if missing:
        raise RuntimeError(f"checkpoint {tmp}: {len(missing)} files not written: {', '.join(missing[:8])}")
    files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir())}
    full_meta = {
        "format": FORMAT, "step": step, "world_size": world_size, **place.meta(), **meta,
        "shared": shared_prefixes, "groups": groups, "files": files,
    }  # fmt: skip
    write_atomic(tmp / "meta.json", json.dumps(full_meta, indent=1).encode())
    fsync_dir(tmp)
    replaced = None
    if final.exists():  # the same step saved again (e.g. after a resume): replace it
        replaced = rename_away(directory, final)
    os.replace(tmp, final)
    write_atomic(directory / LATEST, final.name.encode())
    fsync_dir(directory)
    if replaced is not None:
        shutil.rmtree(replaced, ignore_errors=True)
    prune(final.name)
    model_files = [f for ps in shared_prefixes.values() for p in ps for f in groups[p] or ()]  # all there
    total_bytes = sum(files.values()) + (final / "meta.json").stat().st_size
    shared_bytes = sum(files[f] + files[f + ".sha256"] for f in model_files)
    return total_bytes, shared_bytes, len(files) + 1


def rename_away(directory: Path, path: Path) -> Path:
    """Rename ``path`` to ``.deleting_<name>`` (atomic): from here on no reader sees it."""
    away = directory / f"{DELETING}{path.name}"
    if away.exists():
        shutil.rmtree(away)
    os.replace(path, away)
    fsync_dir(directory)
    return away


def remove(directory: Path, path: Path) -> None:
    """Delete a checkpoint: renamed away first, so a kill part-way never leaves a ``step_...``
    directory that has ``meta.json`` but not all of its files."""
    shutil.rmtree(rename_away(directory, path), ignore_errors=True)


def prune(
    directory: Path,
    saved: list[str],
    just_saved: str,
    keep_last: int,
    reported: set[str],
    log: Callable[[str], None] | None,
) -> None:
    """Delete checkpoints beyond the newest ``keep_last`` (rank 0, after a save).

    Newest: ``saved`` (this manager's saves, in the order saved, ``just_saved`` last), then the
    others by step. Others with a step above ``just_saved``'s are another run's later state: kept,
    not counted, and said once (``reported`` holds those said). Leftovers of an interrupted removal
    (``.deleting_step_...``) are deleted here. A failure to delete is reported (``log``), not
    raised: the checkpoint is already saved.
    """
    try:
        for leftover in directory.glob(f"{DELETING}step_*"):
            shutil.rmtree(leftover, ignore_errors=True)
        mine = [n for n in saved if n != just_saved and (directory / n / "meta.json").is_file()]
        mine.append(just_saved)
        step = step_of(Path(just_saved))
        others = [p.name for p in complete(directory) if p.name not in mine]
        older = [n for n in others if step_of(Path(n)) < step]
        later = [n for n in others if step_of(Path(n)) > step and n not in reported]
        ranked = older + mine  # oldest first
        for name in ranked[: max(0, len(ranked) - keep_last)]:
            if name != just_saved and (directory / name).is_dir():
                remove(directory, directory / name)
        reported.update(later)
        if later and log is not None:
            log(
                f"keeping {', '.join(later)} under {directory}: later steps than {just_saved}, "
                "written by another run (not pruned; delete them yourself if they are not wanted)"
            )
    except OSError as e:
        if log is not None:
            log(f"pruning old checkpoints under {directory} failed: {e}")
        else:
            # stacklevel 3: the save that committed, as when this was the manager's own method.
            warnings.warn(f"pruning old checkpoints under {directory} failed: {e}", stacklevel=3)
