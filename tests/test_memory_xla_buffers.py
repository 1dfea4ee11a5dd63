"""The reader of XLA's buffer-assignment dump, on a trimmed copy of a real XLA:CPU dump.

tests/fixtures/memory/xla_cpu_buffer_assignment.txt was captured with scripts/xla_memory_slope.py
(torch-xla 2.9, XLA:CPU; its origin and what was trimmed are in XLA_FIXTURE.md beside it). The
figures below are what the untrimmed dump gives too. The errors are one line naming the file.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from neuron_ckpt.memory.readers import ReadError, xla_buffers
from neuron_ckpt.memory.readers.detect import read_any, source_of

FIXTURE = Path(__file__).parent / "fixtures" / "memory" / "xla_cpu_buffer_assignment.txt"
TEXT = FIXTURE.read_text(encoding="utf-8")
EXPECTED = {
    "temp": 103961600,
    "parameters": 16821088,
    "outputs": 25314208,
    "constants": 28,
    "thread_local": 434,
    "live_at_peak": 122014580,
}


def _one_line_error(read, path, message: str) -> None:
    """``read(path)`` raises one line that names ``path`` and contains ``message``."""
    with pytest.raises(ReadError) as exc:
        read(path)
    text = str(exc.value)
    assert message in text and str(path) in text and "\n" not in text, text


def _write(tmp_path, text: str, name: str = "buffer-assignment.txt") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def test_the_real_dump_reads_by_category():
    reading = xla_buffers.read(FIXTURE)
    assert (reading.source, reading.kind, reading.quantum) == ("xla-buffer-assignment", "peak", None)
    assert reading.cores == {0: EXPECTED}
    assert reading.notes == ()
    # The categories partition the allocations: they sum to XLA's own total.
    assert sum(v for k, v in EXPECTED.items() if k != "live_at_peak") == 146097358
    assert reading.bytes_of("temp") == 103961600  # the one preallocated-temp allocation (allocation 149)


def test_a_parameter_that_is_also_live_out_counts_as_a_parameter(tmp_path):
    # A parameter passed through to an output aliases it: its bytes are the parameter's, once.
    text = (
        "BufferAssignment:\nallocation 0: size 100, parameter 0, shape |f32[25]| at ShapeIndex {}, "
        "maybe-live-out:\nallocation 1: size 8, output shape is |(f32[25])|, maybe-live-out:\n"
        "allocation 2: size 40, preallocated-temp:\nTotal bytes used: 148 (148B)\n"
    )
    reading = xla_buffers.read(_write(tmp_path, text))
    assert reading.cores == {0: {"temp": 40, "parameters": 100, "outputs": 8, "constants": 0, "thread_local": 0}}
    assert "no live ranges" in reading.notes[0]  # no live_at_peak then, rather than a zero


def test_the_detector_picks_this_reader():
    assert source_of(FIXTURE) == "xla_buffers"
    assert read_any(FIXTURE).cores == {0: EXPECTED}


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda t: json.dumps({"var": {}}), "not an XLA buffer assignment"),
        (
            lambda t: "Total bytes used: 152433234 (145.37MiB)\n\nAllocations sorted by size:\n",
            "not an XLA buffer assignment",
        ),  # the memory-usage report, not the assignment
        (lambda t: "BufferAssignment:\nTotal bytes used: 0 (0B)\n", "no 'allocation N: size S' lines"),
        (lambda t: t[: t.index("allocation 40:")], "no 'Total bytes used' line after 40 allocations (truncated?)"),
        (lambda t: t[: t.index("    convert_divide_fusion{}")], "without 'Stack trace breakdown for peak usage'"),
        (lambda t: t.replace("allocation 5: size", "allocation 7: size"), "expected 'allocation 5: size N...:'"),
        (
            lambda t: t.replace("allocation 149: size 103961600,", "allocation 149: size 103961601,"),
            "the 150 allocations sum to 146097359 bytes, but 'Total bytes used' says 146097358",
        ),
        (
            lambda t: t.replace("(cumulative: 122014580 bytes)", "(cumulative: 122014000 bytes)"),
            "peak usage 122014580 bytes, but the live values at the peak sum to 122014000",
        ),
    ],
    ids=[
        "json",
        "usage_report",
        "no_allocations",
        "truncated_allocations",
        "truncated_peak",
        "missing_allocation",
        "wrong_total",
        "peak_mismatch",
    ],
)
def test_bad_dumps_are_one_line_errors(tmp_path, make, message):
    _one_line_error(xla_buffers.read, _write(tmp_path, make(TEXT)), message)


def test_missing_and_unreadable_files(tmp_path):
    _one_line_error(xla_buffers.read, tmp_path / "absent.txt", "no such file")
    binary = tmp_path / "binary.txt"
    binary.write_bytes(b"\xff\xfe\x00BufferAssignment")
    _one_line_error(xla_buffers.read, binary, "cannot read it as text")


def test_without_live_ranges_the_peak_is_left_out_with_a_note(tmp_path):
    text = TEXT[: TEXT.index("HloLiveRange")]
    reading = xla_buffers.read(_write(tmp_path, text))
    assert "live_at_peak" not in reading.cores[0]
    assert reading.cores[0]["temp"] == EXPECTED["temp"]
    assert reading.notes == (
        f"{tmp_path / 'buffer-assignment.txt'}: no live ranges (HloLiveRange) in the dump, so no live_at_peak",
    )
