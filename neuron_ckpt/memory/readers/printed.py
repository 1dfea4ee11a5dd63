"""Sizes as the Neuron runtime prints them in its memory reports: ``20.188GB``, ``192.102MB``, ``0.000B``.

Both runtime text reports (:mod:`.oom_table`, :mod:`.load_log`) print a number with three decimals
and a unit. The units are **binary** (KB = KiB, MB = MiB, GB = GiB): not stated by AWS, but a third
party matched the printed figures of a trn1 OOM table against the NEFFs' contents and found MiB and
GiB (``foxl-ai/kiln``, ``kiln/compile_farm.py``, 2026-10-04). A printed figure is off its true value
by at most half its last digit; :func:`printed_bytes` returns that digit's size too, the rounding a
comparison has to allow.
"""

from __future__ import annotations

import re

from . import ReadError

UNITS = {"B": 0, "KB": 1, "MB": 2, "GB": 3, "TB": 4}
SIZE = re.compile(r"(\d+)(?:\.(\d+))?(B|KB|MB|GB|TB)")


def printed_bytes(text: str, where: str) -> tuple[int, int]:
    """``text`` (e.g. ``20.188GB``) as (bytes, the size of its last printed digit in bytes)."""
    match = SIZE.fullmatch(text.strip())
    if not match:
        raise ReadError(f"{where}: {text.strip()!r} is not a size like 20.188GB")
    whole, decimals, unit = match.groups()
    scale = 1024 ** UNITS[unit]
    digits = len(decimals or "")
    value = (
        int(whole) * scale + (int(decimals) * scale * 2 + 10**digits) // (2 * 10**digits)
        if decimals
        else int(whole) * scale
    )
    return value, max(1, scale // 10**digits)


__all__ = ["SIZE", "UNITS", "printed_bytes"]
