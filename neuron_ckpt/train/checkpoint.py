"""Sharded training checkpoints: the model once per TP rank, the rest per rank, committed atomically.

Layout (format 2) under ``directory`` (a filesystem every rank sees, e.g. FSx on a cluster)::

    step_00000100/
        meta.json                                 format, step, layout, the files; written last (rank 0)
        model_tp00000-00001-of-00003.safetensors  TP rank 0's model slice, group 1 of 3, written by
        ...                                       DP rank 0 of that TP rank only: every group of
                                                  every TP rank (the model is the same on every DP rank)
        rank_00000-00001-of-00002.safetensors     rank 0's own tensors: its ZeRO-1 optimizer slices
        rank_00000.pt                             rank 0's structure around its tensors, data order, RNG
        ...                                       the same for every rank
        <every file>.sha256                       sha256 of the file beside it
    latest                                        text: the name of the newest complete checkpoint

Which entries of the saved state are the same on every DP rank is ``shared_keys`` (default:
``"model"`` and ``"experts"``): their tensors are written once per TP rank (per pipeline stage and TP rank under
pipeline parallelism: ``model_pp00001_tp00000-...``, :mod:`~.placement`), by its DP rank 0, under their state
dict names (a standard safetensors state dict); every rank reads those of its own TP rank back,
whatever its DP rank. ``"experts"`` (expert parallelism) goes by EP rank instead, written by
expert-DP rank 0. Everything else is the rank's own. :mod:`~neuron_ckpt.train.tensor_files`
says how tensors are grouped (one group of at most ``chunk_mb`` on the host at a time while
writing), named and checked; :mod:`~neuron_ckpt.train.rounds` how ranks take turns writing and
reading (``writers`` per host) and how one rank's failure fails every rank;
:mod:`~.checkpoint_commit` the atomic commit and the pruning below; :mod:`~.checkpoint_read` the
names, the format and the readers.

A save never leaves something that looks complete but is not: every rank writes into
``.tmp_step_...``, all ranks agree that every write succeeded, then rank 0 checks that every
rank's and TP rank's files are all there, writes ``meta.json``, fsyncs and renames the
directory to ``step_...`` and only then replaces ``latest``. A crash at any point leaves
``latest`` on the previous complete checkpoint.

Nothing a run needs is deleted (:meth:`CheckpointManager._prune`). After each save, checkpoints
beyond the newest ``keep_last`` are deleted, where "newest" ranks the checkpoints this manager
saved above every other one: the checkpoint just written is always kept, and one this run wrote
is never deleted in favour of an older run's checkpoint with a higher step. Another run's
checkpoints with a higher step than the one just written (e.g. after ``--resume`` of an earlier
path) are not this run's to delete and are kept. A directory is removed by renaming it to
``.deleting_step_...`` first, then deleting that: a kill part-way leaves either the complete
checkpoint or a ``.deleting_`` leftover, which :meth:`~CheckpointManager.complete` ignores and
the next prune deletes, never a ``step_...`` with ``meta.json`` but a rank's file gone.
:meth:`~CheckpointManager.check_fresh_start` refuses to start a new run in a directory that
already holds complete checkpoints; :meth:`~CheckpointManager.resolve` falls back to the newest
complete checkpoint when ``latest`` is missing or names one that is not there, and says so.

Loading checks before deserialising anything: ``meta.json`` must parse, have this format and
match the run's layout, and each file must match its sha256. A rank's files hold only its
tensor-parallel slice of the model and its ZeRO-1 slice of the optimizer, so it loads only at
the tensor- and data-parallel sizes it was saved at; :meth:`CheckpointManager.load` refuses any
other layout, saying what differs and how to move the weights (through a ``transformers`` state
dict).
"""

from __future__ import annotations

import os
import shutil
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..distributed.host import agree, all_max
from .checkpoint_commit import commit, prune
from .checkpoint_read import FORMAT, FORMAT_VERSION, LATEST, complete, load_rank_state, rank_prefix, read_meta
from .placement import Placement
from .rounds import DEFAULT_WRITERS, WriterRounds
from .tensor_files import split, write_structure, write_tensors

__all__ = ["DEFAULT_CHUNK_MB", "FORMAT", "FORMAT_VERSION", "LATEST", "CheckpointManager", "SaveReport", "rank_prefix"]

DEFAULT_CHUNK_MB = 256.0


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB"):
        if n < 1000:
            return f"{n:.0f} B" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n:.2f} GB"


@dataclass
class SaveReport:
    """What one :meth:`CheckpointManager.save` wrote (sizes known on rank 0 only)."""

    path: Path
    step: int
    seconds: float
    total_bytes: int = 0
    shared_bytes: int = 0
    files: int = 0
    rounds: int = 1

    def describe(self) -> str:
        return (
            f"checkpoint {self.path.name}: {_human(self.total_bytes)} on disk in {self.files} files "
            f"(model {_human(self.shared_bytes)}, per-rank {_human(self.total_bytes - self.shared_bytes)}), "
            f"saved in {self.seconds:.2f} s ({self.rounds} writer round{'s' * (self.rounds > 1)})"
        )


class CheckpointManager:
    """Save / find / load the sharded checkpoints of one run. Every rank constructs one.

    ``parallel_state`` (anything with ``tp_rank``, ``tp_size``, ``dp_rank``, ``dp_size``, and
    ``pp_rank``, ``pp_size`` under pipeline parallelism, ``cp_rank``, ``cp_size`` under context
    parallelism; default: the initialised model parallel state, or a single rank) says which rank
    writes the model files of which (stage,) TP rank
    (:mod:`~.placement`). ``local_rank`` (default: the runtime's) picks the writer round;
    ``writers`` ranks per host write at a time (0: all). ``chunk_mb``: the most tensor data a
    rank holds on the host at once while writing. ``log(message)`` (rank 0) gets one line per
    save: its size on disk and time.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        keep_last: int = 3,
        rank: int = 0,
        world_size: int = 1,
        *,
        parallel_state: Any = None,
        local_rank: int | None = None,
        writers: int = DEFAULT_WRITERS,
        chunk_mb: float = DEFAULT_CHUNK_MB,
        shared_keys: tuple[str, ...] = ("model", "experts"),
        log: Callable[[str], None] | None = None,
    ):
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {keep_last}")
        if chunk_mb <= 0:
            raise ValueError(f"chunk_mb must be > 0, got {chunk_mb}")
        self.directory = Path(directory)
        self.keep_last, self.rank, self.world_size = keep_last, rank, world_size
        if parallel_state is None and world_size > 1:
            from ..distributed.parallel_state import get_parallel_state

            try:
                parallel_state = get_parallel_state()
            except (RuntimeError, ValueError):
                raise ValueError(
                    f"CheckpointManager at world size {world_size} needs parallel_state= (or an initialised "
                    "model parallel state): it decides which rank writes the model files of each TP rank"
                ) from None
        self.place = place = Placement.of(parallel_state) if parallel_state is not None else Placement()
        self.tp_rank, self.tp_size, self.dp_rank, self.dp_size = (
            place.tp_rank,
            place.tp_size,
            place.dp_rank,
            place.dp_size,
        )
        if place.world_size != world_size:
            pp = f" x PP {place.pp_size}" if place.pp_size > 1 else ""
            cp = f" x CP {place.cp_size}" if place.cp_size > 1 else ""
            raise ValueError(f"TP {self.tp_size}{cp} x DP {self.dp_size}{pp} != world size {world_size}")
        self._rounds = WriterRounds(local_rank, writers)
        self.chunk_bytes = max(1, int(chunk_mb * 2**20))
        self.shared_keys = tuple(shared_keys)
        self.log = log
        self.last_save: SaveReport | None = None
        self.saved: list[str] = []
        """Names (``step_...``) of the checkpoints this manager saved, in order: never pruned in
        favour of another run's checkpoints."""
        self._reported: set[str] = set()  # another run's later checkpoints, said to be kept

    def complete(self) -> list[Path]:
        """Complete checkpoints (``step_...`` directories with ``meta.json``), lowest step first.

        Temporary (``.tmp_step_...``) and half-removed (``.deleting_step_...``) directories are
        not listed."""
        return complete(self.directory)

    def check_fresh_start(self) -> None:
        """A collective: refuse (ValueError, on every rank) to start a new run here when the
        directory already holds complete checkpoints.

        A new run's checkpoints would mix with the old run's (its ``latest`` replaced, its later
        steps left beside the new run's). Call it at start-up, before any work, when not resuming.
        """
        found = self.complete() if self.rank == 0 else []
        if not all_max(1 if found else 0):
            return
        ways = (
            "To continue that run, pass --resume latest (or --resume <one of them>); to start a new run, "
            "pass a new --checkpoint-dir (or delete the old checkpoints yourself)."
        )
        if self.rank != 0:
            raise ValueError(f"{self.directory} already holds complete checkpoints (rank 0 names them). {ways}")
        names = ", ".join(p.name for p in found[-4:])
        raise ValueError(
            f"{self.directory} already holds {len(found)} complete checkpoint{'s' * (len(found) > 1)} "
            f"(newest: {names}); a new run there would mix its checkpoints with them. {ways}"
        )

    def rounds(self) -> tuple[int, int]:
        """``(number of writer rounds, this rank's round)``. The first call is a collective."""
        return self._rounds.rounds()

    def save(self, step: int, rank_state: dict[str, Any], meta: dict[str, Any]) -> Path:
        """Write this rank's ``rank_state``; rank 0 also writes ``meta``. A collective: all ranks call it.

        The tensors of ``rank_state[k]`` for ``k`` in ``shared_keys`` (the model) are written by DP
        rank 0 only, to the files of this TP rank (``"experts"``: by expert-DP rank 0, to the files
        of this EP rank); the rest by every rank.
        """
        start = time.perf_counter()
        name = f"step_{step:08d}"
        final, tmp = self.directory / name, self.directory / f".tmp_{name}"
        shared = [k for k in self.shared_keys if k in rank_state]
        error: BaseException | None = None
        if self.rank == 0:
            try:
                self.directory.mkdir(parents=True, exist_ok=True)
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir()
            except OSError as e:
                error = e
        agree(error, f"creating {tmp}")

        def write() -> None:
            info = self.place.info(self.rank)
            structure: dict[str, Any] = {}
            own: dict[str, torch.Tensor] = {}
            for key, value in rank_state.items():
                if key in shared:
                    tensors: dict[str, torch.Tensor] = {}
                    structure[key] = split(value, "", tensors)  # the state dict's own names
                    if self.place.writes(key):
                        write_tensors(
                            tmp, self.place.shared_prefix(key), tensors, {"key": key, **info}, self.chunk_bytes
                        )
                else:
                    structure[key] = split(value, str(key), own)
            write_tensors(tmp, rank_prefix(self.rank), own, info, self.chunk_bytes)
            write_structure(tmp / f"{rank_prefix(self.rank)}.pt", structure)

        self._rounds.run(write, f"writing checkpoint {tmp}")
        report, error = SaveReport(final, step, 0.0, rounds=self.rounds()[0]), None
        if self.rank == 0:
            try:
                self._commit(tmp, final, step, meta, shared, report)
            except BaseException as e:  # noqa: BLE001  re-raised by agree
                error = e
        agree(error, f"committing checkpoint {tmp}")
        report.seconds = time.perf_counter() - start
        self.last_save = report
        if name in self.saved:
            self.saved.remove(name)
        self.saved.append(name)
        if self.rank == 0 and self.log is not None:
            self.log(report.describe())
        return final

    def _commit(
        self, tmp: Path, final: Path, step: int, meta: dict[str, Any], shared: list[str], report: SaveReport
    ) -> None:
        args = (self.directory, tmp, final, step, self.world_size, self.place, meta, shared, self._prune)
        report.total_bytes, report.shared_bytes, report.files = commit(*args)

    def _prune(self, just_saved: str) -> None:
        """Delete checkpoints beyond the newest ``keep_last`` (:func:`~.checkpoint_commit.prune`)."""
        prune(self.directory, self.saved, just_saved, self.keep_last, self._reported, self.log)

    def resolve(self, which: str) -> Path | None:
        """``"latest"`` -> the checkpoint ``latest`` names (None if there is no checkpoint yet);
        else the path ``which``.

        When ``latest`` is missing, or names a checkpoint that is not complete, the newest
        complete checkpoint (highest step) is taken instead and rank 0 says so (``log``, else a
        warning). Not a collective: every rank reads the same directory.
        """
        if which == LATEST:
            pointer = self.directory / LATEST
            named = pointer.read_text().strip() if pointer.is_file() else None
            if named and (self.directory / named / "meta.json").is_file():
                return self.directory / named
            found = self.complete()
            if not found:
                if named:
                    raise FileNotFoundError(
                        f"{pointer} names {named}, which is not a complete checkpoint (no "
                        f"{self.directory / named / 'meta.json'}), and {self.directory} holds no other"
                    )
                return None
            path = found[-1]
            why = f"names {named}, which is not a complete checkpoint" if named else "is missing"
            self._say(
                f"{pointer} {why}; resuming from the newest complete checkpoint under "
                f"{self.directory} instead: {path.name}"
            )
            return path
        path = Path(which)
        if not (path / "meta.json").is_file():
            raise FileNotFoundError(f"{path} is not a complete checkpoint (no meta.json)")
        return path

    def _say(self, message: str) -> None:
        if self.rank != 0:
            return
        if self.log is not None:
            self.log(message)
        else:
            warnings.warn(message, stacklevel=3)

    def read_meta(self, path: Path) -> dict[str, Any]:
        """``meta.json`` of the checkpoint at ``path``, refused unless it is this format."""
        return read_meta(path)

    def load(self, path: Path, expect: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """``(rank_state, meta)`` of this rank; ``expect`` fields (tp_size, dp_size, ...) must match meta.

        ``rank_state`` has this rank's own entries and the shared ones (the model) from the files of
        this rank's TP rank. Not a collective; :meth:`restore` reads in writer rounds.
        """
        return load_rank_state(path, self.rank, self.world_size, self.place, expect)

    def restore(self, path: Path, expect: dict[str, Any], apply: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
        """A collective: :meth:`load` this rank's state and ``apply(rank_state)`` it, in writer rounds
        (at most ``writers`` ranks per host hold one on the host at once). Returns meta."""
        out: dict[str, Any] = {}

        def read() -> None:
            rank_state, out["meta"] = self.load(path, expect)
            apply(rank_state)

        self._rounds.run(read, f"restoring checkpoint {path}")
        return out["meta"]
