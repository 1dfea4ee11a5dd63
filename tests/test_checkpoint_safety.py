"""Nothing lost: pruning keeps what this run wrote, a fresh start never lands on an old run's
checkpoints, removal is atomic, ``latest`` falls back to the newest complete checkpoint, and a
resumed run's metrics list each step once.

The end-to-end checks run ``tutorials/llama2_7b_tp_zero1/train.py``'s ``main`` on a 4-rank
LocalWorld (TP 2 x DP 2) with a tiny model and a random packed corpus, as tests/test_train.py.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch

from neuron_ckpt.train import CheckpointManager
from neuron_ckpt.train.metrics import MetricsWriter, drop_after_step, make_record, read_metrics

from .tutorial_run import tiny_run_files
from .tutorial_run import train as _train
from .tutorial_run import train_error as _train_error


@pytest.fixture(scope="module")
def run_files(tmp_path_factory) -> tuple[Path, list[str]]:
    root = tmp_path_factory.mktemp("safety")
    common = tiny_run_files(root) + [
        "--tp", "2", "--global-batch-size", "8", "--max-steps", "12", "--warmup-steps", "1",
        "--lr", "1e-2",
    ]  # fmt: skip
    return root, common


def _names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def _steps(directory: Path) -> list[str]:
    return [p.name for p in CheckpointManager(directory).complete()]


# ---- a fresh start into a directory with checkpoints ------------------------------------------


def test_fresh_start_into_a_directory_with_checkpoints_is_refused(world, run_files):
    root, common = run_files
    ckpt = root / "fresh"
    world(4).run(_train, common + ["--checkpoint-dir", str(ckpt), "--checkpoint-every", "4", "--stop-at-step", "8"])
    before = {p.name: sorted(q.name for q in p.iterdir()) if p.is_dir() else p.read_text() for p in ckpt.iterdir()}
    assert _steps(ckpt) == ["step_00000004", "step_00000008"]
    # A new run (no --resume) that would write steps 1..2 there. --data points nowhere: the
    # refusal must come before any work (opening the corpus, building the model).
    fresh = [a if a != str(root / "train.safetensors") else str(root / "absent.safetensors") for a in common]
    messages = world(4).run(_train_error, fresh + ["--checkpoint-dir", str(ckpt), "--stop-at-step", "2"])
    assert all(messages), messages  # every rank refuses (no rank left waiting in a collective)
    assert "step_00000008" in messages[0] and str(ckpt) in messages[0]
    for m in messages:
        assert "--resume latest" in m and "new --checkpoint-dir" in m
    after = {p.name: sorted(q.name for q in p.iterdir()) if p.is_dir() else p.read_text() for p in ckpt.iterdir()}
    assert after == before  # nothing written, nothing pruned


def test_fresh_start_is_allowed_where_there_is_no_complete_checkpoint(tmp_path):
    CheckpointManager(tmp_path / "absent").check_fresh_start()
    (tmp_path / ".tmp_step_00000004").mkdir()  # a killed save
    (tmp_path / ".deleting_step_00000002").mkdir()  # a killed removal
    (tmp_path / ".deleting_step_00000002" / "meta.json").write_text("{}")
    (tmp_path / "latest").write_text("step_00000002")
    CheckpointManager(tmp_path).check_fresh_start()
    CheckpointManager(tmp_path).save(1, {"w": torch.ones(2)}, {})
    with pytest.raises(ValueError, match="--resume latest"):
        CheckpointManager(tmp_path).check_fresh_start()


# ---- pruning keeps what this run wrote --------------------------------------------------------


def test_pruning_never_removes_what_this_manager_saved(tmp_path):
    """Another run left steps 10, 20, 30; this one resumed from 10 and saves 15, then 18."""
    old = CheckpointManager(tmp_path, keep_last=3)
    for step in (10, 20, 30):
        old.save(step, {"w": torch.full((2,), float(step))}, {})
    log: list[str] = []
    mgr = CheckpointManager(tmp_path, keep_last=2, log=log.append)
    mgr.save(15, {"w": torch.full((2,), 15.0)}, {})
    # Kept: the one just written (the highest steps are the other run's), 10 (keep_last 2), and
    # the other run's later 20, 30 (not this run's to delete); latest names an existing one.
    assert _steps(tmp_path) == ["step_00000010", "step_00000015", "step_00000020", "step_00000030"]
    assert (tmp_path / "latest").read_text() == "step_00000015"
    assert mgr.resolve("latest") == tmp_path / "step_00000015"
    assert any("step_00000020, step_00000030" in m and "another run" in m for m in log)
    mgr.save(18, {"w": torch.full((2,), 18.0)}, {})
    assert _steps(tmp_path) == ["step_00000015", "step_00000018", "step_00000020", "step_00000030"]
    # 25: beyond keep_last 2 now are this run's 15 and the other run's 20 (older than 25, and
    # ranked below this run's saves); 30 is still later than what this run wrote.
    mgr.save(25, {"w": torch.full((2,), 25.0)}, {})
    assert _steps(tmp_path) == ["step_00000018", "step_00000025", "step_00000030"]
    assert not [n for n in _names(tmp_path) if n.startswith(".")]
    state, meta = mgr.load(mgr.resolve("latest"), {})
    assert meta["step"] == 25 and torch.equal(state["w"], torch.full((2,), 25.0))


def test_resume_latest_and_pruning_keep_what_this_run_wrote(world, run_files):
    root, common = run_files
    ckpt = root / "prune"
    every = ["--checkpoint-dir", str(ckpt), "--checkpoint-every", "4"]
    world(4).run(_train, common + every + ["--keep-last", "3"])  # run A: steps 4, 8, 12
    assert _steps(ckpt) == ["step_00000004", "step_00000008", "step_00000012"]
    # Run B goes back to step 4 and stops at 6: its step 6 (the lowest but one) is kept, and
    # so are run A's later steps.
    resume_b = ["--keep-last", "2", "--resume", str(ckpt / "step_00000004"), "--stop-at-step", "6"]
    b = world(4).run(_train, common + every + resume_b)[0]
    assert b["start_step"] == 4
    assert _steps(ckpt) == ["step_00000004", "step_00000006", "step_00000008", "step_00000012"]
    assert (ckpt / "latest").read_text() == "step_00000006"
    # Run C: --resume latest (B's step 6), saves 8 (replacing A's) and 10. Pruning to the
    # newest 2 keeps C's 8 and 10 (not A's higher 12 in their place); A's 12 stays.
    c = world(4).run(_train, common + every + ["--keep-last", "2", "--resume", "latest", "--stop-at-step", "10"])[0]
    assert c["start_step"] == 6 and c["steps"] == 4
    assert _steps(ckpt) == ["step_00000008", "step_00000010", "step_00000012"]
    assert (ckpt / "latest").read_text() == "step_00000010"
    for name, stop in (("step_00000008", 10), ("step_00000010", 10), ("step_00000012", None)):
        meta = json.loads((ckpt / name / "meta.json").read_text())
        assert meta["train_config"]["stop_at_step"] == stop, name  # 8 and 10: run C's
    assert not [n for n in _names(ckpt) if n.startswith(".")]


# ---- latest missing or dangling ---------------------------------------------------------------


def test_latest_missing_or_dangling_falls_back_to_the_newest_complete(tmp_path):
    log: list[str] = []
    mgr = CheckpointManager(tmp_path, keep_last=3, log=log.append)
    for step in (1, 2, 3):
        mgr.save(step, {"w": torch.full((2,), float(step))}, {})
    (tmp_path / "step_00000003" / "meta.json").unlink()  # 3 is no longer complete
    log.clear()
    (tmp_path / "latest").unlink()
    assert mgr.resolve("latest") == tmp_path / "step_00000002"
    assert len(log) == 1 and "latest is missing" in log[0] and "step_00000002" in log[0]

    (tmp_path / "latest").write_text("step_00000003")  # names an incomplete checkpoint
    assert mgr.resolve("latest") == tmp_path / "step_00000002"
    assert "names step_00000003" in log[1] and "step_00000002" in log[1]
    state, meta = mgr.load(mgr.resolve("latest"), {})
    assert meta["step"] == 2 and torch.equal(state["w"], torch.full((2,), 2.0))

    (tmp_path / "latest").write_text("step_00000099")  # names one that is not there at all
    quiet = CheckpointManager(tmp_path)  # no log: a warning
    with pytest.warns(UserWarning, match="names step_00000099.*step_00000002"):
        assert quiet.resolve("latest") == tmp_path / "step_00000002"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        (tmp_path / "latest").write_text("step_00000002")
        assert quiet.resolve("latest") == tmp_path / "step_00000002"  # a good pointer: silent


def test_latest_dangling_with_nothing_complete_is_an_error_not_a_fresh_start(tmp_path):
    mgr = CheckpointManager(tmp_path)
    assert mgr.resolve("latest") is None  # nothing at all yet: a fresh start
    (tmp_path / "latest").write_text("step_00000005")
    with pytest.raises(FileNotFoundError, match="step_00000005"):
        mgr.resolve("latest")


# ---- a kill between the rename and the delete -------------------------------------------------


def _save_and_die_while_pruning(directory: str) -> None:
    """Child process: save step 1, then save step 2, whose prune of step 1 hangs (killed by the
    parent) after the rename, in the delete."""
    import os
    import time

    import neuron_ckpt.train.checkpoint as checkpoint

    mgr = CheckpointManager(directory, keep_last=1)
    mgr.save(1, {"w": torch.ones(4)}, {})
    real_rmtree = checkpoint.shutil.rmtree

    def slow_rmtree(path, *args, **kwargs):
        if Path(path).name.startswith(".deleting_"):
            Path(directory, "deleting").touch()
            time.sleep(60)
        return real_rmtree(path, *args, **kwargs)

    checkpoint.shutil.rmtree = slow_rmtree
    mgr.save(2, {"w": torch.full((4,), 2.0)}, {})
    os._exit(0)


def test_a_kill_during_removal_leaves_nothing_that_looks_complete(tmp_path):
    import multiprocessing as mp
    import time

    proc = mp.get_context("spawn").Process(target=_save_and_die_while_pruning, args=(str(tmp_path),))
    proc.start()
    deadline = time.time() + 120
    while not (tmp_path / "deleting").exists():
        assert proc.is_alive() and time.time() < deadline, "child never reached the removal"
        time.sleep(0.05)
    proc.kill()  # SIGKILL: no cleanup handlers run
    proc.join()
    leftover = tmp_path / ".deleting_step_00000001"
    assert not (tmp_path / "step_00000001").exists() and (leftover / "meta.json").is_file()
    (leftover / "rank_00000.pt").unlink()  # as if the delete had got part-way
    mgr = CheckpointManager(tmp_path, keep_last=1)
    assert _steps(tmp_path) == ["step_00000002"]
    state, meta = mgr.load(mgr.resolve("latest"), {})
    assert meta["step"] == 2 and torch.equal(state["w"], torch.full((4,), 2.0))
    (tmp_path / "latest").unlink()  # even without the pointer, the leftover is never taken
    with pytest.warns(UserWarning, match="step_00000002"):
        assert mgr.resolve("latest") == tmp_path / "step_00000002"
    # The next save's prune deletes the leftover.
    mgr.save(3, {"w": torch.full((4,), 3.0)}, {})
    assert _names(tmp_path) == ["deleting", "latest", "step_00000003"]


def test_replacing_a_step_renames_the_old_one_away(tmp_path, monkeypatch):
    """Saving a step that exists (after a resume) never leaves that step half-deleted: the old
    directory is renamed away before the new one is renamed into place."""
    import neuron_ckpt.train.checkpoint as checkpoint

    mgr = CheckpointManager(tmp_path, keep_last=3)
    mgr.save(4, {"w": torch.ones(2)}, {})
    seen = []
    real_replace = checkpoint.os.replace

    def spy(src, dst):
        seen.append((Path(src).name, Path(dst).name))
        return real_replace(src, dst)

    monkeypatch.setattr(checkpoint.os, "replace", spy)
    CheckpointManager(tmp_path, keep_last=3).save(4, {"w": torch.zeros(2)}, {})
    renames = [s for s in seen if s[0].startswith("step_") or s[1].startswith("step_")]
    assert renames == [("step_00000004", ".deleting_step_00000004"), (".tmp_step_00000004", "step_00000004")]
    assert _names(tmp_path) == ["latest", "step_00000004"]
    assert torch.equal(mgr.load(tmp_path / "step_00000004", {})[0]["w"], torch.zeros(2))


# ---- metrics after a resume -------------------------------------------------------------------


def test_metrics_list_each_step_once_after_a_resume(world, run_files):
    """Stop at 6 with a checkpoint every 4; the step-6 checkpoint is lost (as when the run is
    killed after step 6 but before saving it), so the resume starts at 4: steps 5 and 6 of the
    first run are dropped from metrics.jsonl, the resumed run's follow, each step once."""
    root, common = run_files
    ckpt, metrics = root / "metrics_ckpt", root / "metrics.jsonl"
    args = common + ["--checkpoint-dir", str(ckpt), "--checkpoint-every", "4", "--metrics-file", str(metrics)]
    first = world(4).run(_train, args + ["--stop-at-step", "6"])[0]
    assert [r["step"] for r in read_metrics(metrics)["step"]] == [1, 2, 3, 4, 5, 6]
    shutil.rmtree(ckpt / "step_00000006")
    (ckpt / "latest").write_text("step_00000004")
    resumed = world(4).run(_train, args + ["--resume", "latest", "--stop-at-step", "9"])[0]
    assert resumed["start_step"] == 4
    records = read_metrics(metrics)
    lines = records["step"]
    assert [r["step"] for r in lines] == list(range(1, 10))
    assert len(records["header"]) == 2  # one per run
    assert [(r["start_step"], r["steps"]) for r in records["summary"]] == [(4, 5)]  # the first run's is stale
    assert [r["loss"] for r in lines[:4]] == first["losses"][:4]
    assert [r["loss"] for r in lines[4:]] == resumed["losses"]  # steps 5.. are the resumed run's


def test_drop_after_step_rewrites_the_file(tmp_path):
    path = tmp_path / "m.jsonl"
    rows = [json.dumps({"step": s, "loss": 1.0 / s}) for s in range(1, 8)]
    path.write_text("\n".join(rows[:5]) + "\n# a note\n" + "\n".join(rows[5:]) + '\n{"step": 8, "lo')
    assert drop_after_step(path, 4) == 4  # steps 5, 6, 7 and the torn line
    assert path.read_text() == "\n".join(rows[:4]) + "\n# a note\n"
    assert drop_after_step(path, 4) == 0 and drop_after_step(tmp_path / "absent.jsonl", 4) == 0
    writer = MetricsWriter(path, append=True, resume_step=2)
    writer.write(make_record(3, 0.5, 1e-3, 0.5, 0.1, 8, 16, 1e6, 0.1, 4, 384))
    writer.close()
    steps = [json.loads(x)["step"] for x in path.read_text().splitlines() if x.startswith("{")]
    assert steps == [1, 2, 3] and writer.dropped == 2
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp file left
