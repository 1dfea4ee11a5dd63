"""Bad input is refused loudly, early, and on every rank.

* Token ids outside the vocabulary raise in ``VocabParallelEmbedding`` at every TP size (at
  TP > 1 they used to embed silently as zeros and give a finite loss).
* Output locations (``--metrics-file``, ``--checkpoint-dir``, ``--tensorboard-dir`` of the
  tutorial's train.py, ``--output`` of prepare_data.py) are checked before any work.
"""

from __future__ import annotations

import errno
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import neuron_ckpt as nc
from neuron_ckpt.parallel import VocabParallelEmbedding
from neuron_ckpt.paths import check_output_paths

from .helpers import run_prepare_data
from .tutorial_run import TUTORIAL, tiny_run_files
from .tutorial_run import train_error as _train_error

# ---- token ids outside the vocabulary -----------------------------------------------------------


def _embed_bad_id(t: int, bad: int) -> list[str]:
    """On every rank: the messages of a bad-id lookup (plain and sequence parallel), then a good
    lookup still works (no rank was left inside a collective)."""
    st = nc.initialize_model_parallel(t)
    messages = []
    for sp in (False, True):
        torch.manual_seed(0)
        layer = VocabParallelEmbedding(32000, 8, sequence_parallel=sp)
        ids = torch.randint(0, 32000, (8, 2), generator=torch.Generator().manual_seed(1))
        ids[5, 1] = bad
        try:
            out = layer(ids)
            messages.append(f"no error: finite={bool(torch.isfinite(out).all())}")
        except ValueError as e:
            messages.append(str(e))
        ok = layer(ids.clamp(0, 31999))
        assert ok.shape == ((8 // st.tp_size) if sp else 8, 2, 8)
    return messages


@pytest.mark.parametrize("t", [1, 2, 4])
@pytest.mark.parametrize("bad", [40000, -5])
def test_out_of_range_token_id_raises_on_every_rank(world, t, bad):
    per_rank = world(4).run(_embed_bad_id, t, bad)
    assert len(per_rank) == 4
    for messages in per_rank:
        for m in messages:
            assert f"token id {bad} " in m and "vocab size 32000" in m, m


# ---- check_output_paths, one process ------------------------------------------------------------


def test_check_output_paths_accepts_creatable_paths_and_leaves_no_probe(tmp_path):
    check_output_paths(
        files={"--metrics-file": tmp_path / "new" / "m.jsonl", "--unused": None},
        dirs={"--checkpoint-dir": tmp_path / "a" / "b", "--tensorboard-dir": None},
    )
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == ["a", "a/b", "new"]


@pytest.mark.parametrize(
    "kind, option, where, reason",
    [
        ("file", "--metrics-file", "file/m.jsonl", "exists and is not a directory"),
        ("file", "--metrics-file", "dir", "is a directory, expected a file path"),
        ("dir", "--checkpoint-dir", "file", "exists and is not a directory"),
        ("dir", "--checkpoint-dir", "file/ckpt", "exists and is not a directory"),
        ("dir", "--tensorboard-dir", "file/deeper/tb", "exists and is not a directory"),
    ],
)
def test_check_output_paths_names_the_option_and_reason(tmp_path, kind, option, where, reason):
    (tmp_path / "file").write_text("a regular file")
    (tmp_path / "dir").mkdir()
    path = tmp_path / where
    with pytest.raises(ValueError) as e:
        check_output_paths(**{"files" if kind == "file" else "dirs": {option: path}})
    assert str(e.value).startswith(f"{option} {path}: cannot write there:") and reason in str(e.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir", "file"]  # nothing created


# ---- train.py: every output option, before step 1 -----------------------------------------------


@pytest.fixture(scope="module")
def train_files(tmp_path_factory) -> tuple[Path, list[str]]:
    root = tmp_path_factory.mktemp("bad_out")
    common = tiny_run_files(root, np.random.default_rng(0).integers(0, 128, size=(32, 16))) + [
        "--tp", "2", "--global-batch-size", "4", "--max-steps", "2", "--warmup-steps", "1",
    ]  # fmt: skip
    return root, common


BAD_OUTPUTS = [
    ("--metrics-file", "file/m.jsonl", "exists and is not a directory"),
    ("--metrics-file", "dir", "is a directory, expected a file path"),
    ("--checkpoint-dir", "file", "exists and is not a directory"),
    ("--checkpoint-dir", "file/ckpt", "exists and is not a directory"),
    ("--tensorboard-dir", "file", "exists and is not a directory"),
    ("--tensorboard-dir", "file/tb", "exists and is not a directory"),
]


@pytest.mark.parametrize("option, where, reason", BAD_OUTPUTS)
def test_unwritable_output_fails_before_step_1_on_every_rank(world, train_files, tmp_path, option, where, reason):
    _, common = train_files
    (tmp_path / "file").write_text("a regular file")
    (tmp_path / "dir").mkdir()
    bad = str(tmp_path / where)
    good = {"--metrics-file": str(tmp_path / "ok" / "m.jsonl"), "--checkpoint-dir": str(tmp_path / "ok" / "ckpt")}
    good.pop(option, None)
    argv = common + [option, bad, "--checkpoint-every", "1"] + [a for kv in good.items() for a in kv]
    start = time.perf_counter()
    messages = world(4).run(_train_error, argv)
    assert time.perf_counter() - start < 60
    for m in messages:
        assert m.startswith(f"{option} {bad}: cannot write there:") and reason in m, m
    assert not (tmp_path / "ok" / "m.jsonl").exists()  # no step logged
    ckpt = tmp_path / "ok" / "ckpt"
    assert not ckpt.exists() or not any(ckpt.iterdir())  # no checkpoint written
    assert (tmp_path / "file").read_text() == "a regular file"


# ---- prepare_data.py --output -------------------------------------------------------------------


def test_prepare_data_unwritable_output_fails_before_tokenising(tmp_path):
    (tmp_path / "file").write_text("a regular file")
    out = tmp_path / "file" / "train.bin"
    start = time.perf_counter()
    done = run_prepare_data("--seq-len", "128", "--output", out)  # the default corpus: seconds to tokenise
    assert done.returncode == 2, done.stderr
    assert done.stdout == ""  # no tokenising summary
    assert done.stderr.strip().splitlines() == [
        (
            f"prepare_data.py: error: argument --output: cannot write {out}: its parent directory "
            f"{tmp_path / 'file'} cannot be created: {tmp_path / 'file'} exists and is not a directory"
        )
    ]
    assert time.perf_counter() - start < 60
    # Checked even before the inputs are read: a missing input is not reached.
    done = run_prepare_data("--input", tmp_path / "missing.txt", "--seq-len", "8", "--output", out)
    assert done.returncode == 2 and "argument --output" in done.stderr, done.stderr


def test_prepare_data_val_file_path_is_checked_too(tmp_path):
    (tmp_path / "train.val.bin").mkdir()
    done = run_prepare_data("--seq-len", "8", "--val-fraction", "0.1", "--output", tmp_path / "train.bin")
    assert done.returncode == 2 and done.stdout == ""
    assert "train.val.bin is a directory, expected a file path" in done.stderr
    assert not (tmp_path / "train.bin").exists()


def test_prepare_data_failed_write_shows_the_real_error_and_removes_partial_output(tmp_path, monkeypatch, capsys):
    from neuron_ckpt import data

    if str(TUTORIAL) not in sys.path:
        sys.path.insert(0, str(TUTORIAL))
    import prepare_data

    (tmp_path / "in.txt").write_text("the quick brown fox jumps over the lazy dog " * 20)
    real_write = data.write_packed

    def write_packed_full_disk(path, blocks, **meta):
        if ".val" in Path(path).name:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real_write(path, blocks, **meta)

    def unlink_fails(self, missing_ok=False):
        raise PermissionError(errno.EACCES, "Permission denied", str(self))

    monkeypatch.setattr(data, "write_packed", write_packed_full_disk)
    out = tmp_path / "train.bin"
    argv = ["--input", str(tmp_path / "in.txt"), "--seq-len", "4", "--val-fraction", "0.5", "--output", str(out)]
    argv.append("--no-progress")
    assert prepare_data.main(argv) == 1
    err = capsys.readouterr().err
    assert "No space left on device" in err and "train.val.bin" in err, err
    assert not out.exists()  # the train file written before the failure is removed

    monkeypatch.setattr(Path, "unlink", unlink_fails)  # and a failing cleanup does not hide it
    assert prepare_data.main(argv) == 1
    err = capsys.readouterr().err
    assert "No space left on device" in err and "could not remove the partial output" in err, err
