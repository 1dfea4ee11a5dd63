"""Check output locations at start-up, before any work, instead of when they are first written.

:func:`check_output_paths` takes the file paths and directory paths a run will write, keyed by
the option that named them (``--metrics-file``, ``--checkpoint-dir``, ...), and raises one
``ValueError`` naming the option and the reason if one cannot be written. Each location is
probed for real: missing parent directories are created (the run would create them anyway) and
a temporary file is created in the directory that will hold the output, then removed.

Called with torch.distributed initialised, it is a collective: each rank checks the paths it
will write (``rank0_only`` options, such as the metrics file that only rank 0 writes, are
checked on global rank 0 only), then the ranks share their findings, so every rank raises the
same error and none is left waiting in a later collective for a rank that failed
(:func:`neuron_ckpt.distributed.host.first_problem`, which the HF export uses for its own checks
too).
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Collection, Mapping
from pathlib import Path

from .distributed import host

PathLike = str | os.PathLike


def file_problem(path: PathLike) -> str | None:
    """Why the file ``path`` cannot be created or overwritten; None when it can."""
    raw, path = os.fspath(path), Path(path)
    if path.is_dir():
        return f"{path} is a directory, expected a file path"
    if raw.endswith(os.sep) or (os.altsep and raw.endswith(os.altsep)):
        return f"{raw} ends with a path separator, expected a file path"
    if path.exists() and not os.access(path, os.W_OK):
        return f"{path} exists and is not writable"
    return _dir_problem(path.absolute().parent, what="its parent directory")


def dir_problem(path: PathLike) -> str | None:
    """Why the directory ``path`` cannot be created or written in; None when it can.

    A URL (``s3://...``, which TensorBoard's writer accepts) is not checked: None.
    """
    if "://" in os.fspath(path):
        return None
    return _dir_problem(Path(path).absolute(), what="")


def _dir_problem(directory: Path, what: str) -> str | None:
    label = f"{what} {directory}".strip()
    existing = directory
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():  # a regular file where a directory should be
        return f"{label} cannot be created: {existing} exists and is not a directory"
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        return f"{label} cannot be created: {e.strerror or e}"
    probe = directory / f".write-probe-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        with open(probe, "xb") as f:
            f.write(b"ok")
    except OSError as e:
        return f"{label} is not writable: {e.strerror or e}"
    finally:
        try:
            probe.unlink()
        except OSError:
            pass  # never created (the error above says why), or already gone
    return None


def check_output_paths(
    files: Mapping[str, PathLike | None] | None = None,
    dirs: Mapping[str, PathLike | None] | None = None,
    *,
    rank0_only: Collection[str] = (),
) -> None:
    """Raise ``ValueError("<option> <path>: <reason>")`` if an output location cannot be written.

    ``files`` maps an option name to a file path the run will write (it must not be a directory;
    its parent directory must exist or be creatable, and be writable); ``dirs`` maps an option
    name to a directory (it must exist as a directory or be creatable, and be writable). ``None``
    values (options not given) are skipped. Options named in ``rank0_only`` are checked on
    global rank 0 only: the ranks that never write them may not see the same file system.

    A collective when torch.distributed runs with more than one rank: call it on every rank. The
    first problem found (lowest rank, then the order given) is raised on every rank; a problem
    found on another rank says which rank found it.
    """
    rank = host.rank()
    problem = None
    for kind, table in (("file", files or {}), ("dir", dirs or {})):
        for option, path in table.items():
            if path is None or (option in rank0_only and rank != 0):
                continue
            reason = file_problem(path) if kind == "file" else dir_problem(path)
            if reason is not None:
                problem = f"{option} {path}: cannot write there: {reason}"
                break
        if problem is not None:
            break
    problem = host.first_problem(problem)
    if problem is not None:
        raise ValueError(problem)
