"""Durable file writes: a file holds its old content or the new, never part of the new.

Used for every file a run relies on later (packed corpora and their stamps, checkpoint metadata
and digests, the ``latest`` pointer, HF export metadata, rewritten metrics).
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a rename or a new entry in directory ``path`` survive a crash."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to a temp file beside ``path``, fsync, and move it over ``path``.

    The temp file sits in the same directory (``os.replace`` is atomic only within one file
    system) under a unique name (concurrent writers do not collide); the directory is fsynced
    after the rename. Plain ``open`` rather than mkstemp, which creates mode 0600 files; this one
    follows the umask. A failure removes the temp file without hiding the error that caused it.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        with open(tmp, "xb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass  # e.g. the parent is not a directory: the error being raised says why
        raise
    fsync_dir(path.parent)
