"""The training utilities and the tutorial's train.py: schedule, checkpoints, resume end to end.

The end-to-end checks run ``tutorials/llama2_7b_tp_zero1/train.py``'s ``main`` on a 4-rank
LocalWorld (TP 2 x DP 2, sequence parallel, selective recompute, ZeRO-1) with a tiny model and
a random packed corpus.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from neuron_ckpt.data import write_packed
from neuron_ckpt.train import CheckpointManager, LRSchedule, read_metrics

from .helpers import TINY, patched
from .tutorial_run import tiny_run_files, train_module
from .tutorial_run import train as _train
from .tutorial_run import train_error as _train_error


@pytest.fixture(scope="module")
def run_files(tmp_path_factory) -> tuple[Path, list[str]]:
    root = tmp_path_factory.mktemp("train")
    common = tiny_run_files(root) + [
        "--tp", "2", "--sequence-parallel", "--recompute", "selective", "--global-batch-size", "8",
        "--max-steps", "4", "--warmup-steps", "1", "--lr", "1e-2", "--checkpoint-every", "0",
    ]  # fmt: skip
    return root, common


def test_resume_continues_exactly(world, run_files):
    """Train 10, save, train 10 more; versus train 6, save, resume, train 14: the loss records of
    steps 7-20 are bit-identical (data order, RNG streams, optimizer and LR schedule all resume)."""
    root, common = run_files
    common = common + ["--max-steps", "20"]
    straight = world(4).run(_train, common + ["--checkpoint-dir", str(root / "a"), "--checkpoint-every", "10"])[0]
    ckpt = ["--checkpoint-dir", str(root / "b"), "--metrics-file", str(root / "m.jsonl")]
    first = world(4).run(_train, common + ckpt + ["--stop-at-step", "6"])[0]
    resumed = world(4).run(_train, common + ckpt + ["--resume", "latest"])[0]
    assert straight["losses"][0] > straight["losses"][-1]  # it learns
    assert len(straight["losses"]) == 20 and first["losses"] == straight["losses"][:6]
    assert resumed["start_step"] == 6 and resumed["losses"] == straight["losses"][6:]
    lines = read_metrics(root / "m.jsonl")["step"]
    assert [r["step"] for r in lines] == list(range(1, 21))
    assert {"loss", "lr", "grad_norm", "seq_per_s", "tokens_per_s", "mfu"} <= lines[0].keys()
    assert (root / "b" / "latest").read_text() == "step_00000020"
    assert (root / "a" / "step_00000010" / "meta.json").is_file()


def test_resume_at_other_tp_is_refused(world, run_files):
    root, common = run_files
    ckpt = ["--checkpoint-dir", str(root / "ckpt_tp"), "--stop-at-step", "1"]
    world(4).run(_train, common + ckpt)
    tp4 = [a if a != "2" or common[i - 1] != "--tp" else "4" for i, a in enumerate(common)]
    message = world(4).run(_train_error, tp4 + ckpt[:2] + ["--resume", "latest"])[0]
    assert "tp_size: checkpoint 2, this run 4" in message and "--init-hf" in message


def test_attention_defaults_to_flash_where_a_kernel_runs(world, run_files):
    """On CPU the default is flash (torch's SDPA kernel); --attention explicit runs the written-out
    softmax. Same weights and data: the first loss agrees to fp32 rounding (summation order),
    and both learn."""
    root, common = run_files
    flash = world(4).run(_train, common + ["--dtype", "fp32"])[0]
    explicit = world(4).run(_train, common + ["--dtype", "fp32", "--attention", "explicit"])[0]
    assert (flash["attention"], explicit["attention"]) == ("flash", "explicit")
    assert flash["losses"][0] == pytest.approx(explicit["losses"][0], rel=1e-5)
    assert flash["losses"][-1] < flash["losses"][0] and explicit["losses"][-1] < explicit["losses"][0]


def test_lr_schedule():
    s = LRSchedule(peak_lr=1.0, warmup_steps=4, total_steps=14, decay="cosine", min_lr_ratio=0.1)
    assert [s.lr(i) for i in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert s.lr(4) == 1.0 and math.isclose(s.lr(9), 0.55) and math.isclose(s.lr(14), 0.1)
    assert math.isclose(s.lr(100), 0.1)
    lin = LRSchedule(peak_lr=1.0, warmup_steps=0, total_steps=10, decay="linear", min_lr_ratio=0.0)
    assert math.isclose(lin.lr(5), 0.5)
    with pytest.raises(ValueError, match="decay"):
        LRSchedule(1.0, 0, 10, decay="step")


def test_checkpoints_are_atomic_and_pruned(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=2)
    assert mgr.resolve("latest") is None
    for step in (1, 2, 3):
        mgr.save(step, {"w": torch.full((2,), float(step))}, {"tp_size": 1})
    assert [p.name for p in mgr.complete()] == ["step_00000002", "step_00000003"]
    # A crash mid-save leaves a temp directory and the old pointer: never loaded.
    (tmp_path / ".tmp_step_00000004").mkdir()
    path = mgr.resolve("latest")
    state, meta = mgr.load(path, {"tp_size": 1})
    assert meta["step"] == 3 and torch.equal(state["w"], torch.full((2,), 3.0))
    with pytest.raises(ValueError, match="tp_size: checkpoint 1, this run 2"):
        mgr.load(path, {"tp_size": 2})


def _save_two(directory: str) -> None:
    """Child process: save step 1, then die (SIGKILL from the parent) in the middle of step 2."""
    import os
    import time

    mgr = CheckpointManager(directory, keep_last=3)
    mgr.save(1, {"w": torch.ones(4)}, {"tp_size": 1})

    def slow_save(obj, f):
        f.write(b"PK\x03\x04 half a shard")
        f.flush()
        Path(directory, "writing").touch()
        time.sleep(60)

    torch.save = slow_save
    mgr.save(2, {"w": torch.zeros(4)}, {"tp_size": 1})
    os._exit(0)


def test_killed_during_checkpoint_write_leaves_previous_loadable(tmp_path):
    import multiprocessing as mp
    import time

    proc = mp.get_context("spawn").Process(target=_save_two, args=(str(tmp_path),))
    proc.start()
    deadline = time.time() + 60
    while not (tmp_path / "writing").exists():
        assert proc.is_alive() and time.time() < deadline, "child never reached the second write"
        time.sleep(0.05)
    proc.kill()  # SIGKILL: no cleanup handlers run
    proc.join()
    mgr = CheckpointManager(tmp_path)
    assert [p.name for p in mgr.complete()] == ["step_00000001"]
    state, meta = mgr.load(mgr.resolve("latest"), {"tp_size": 1})
    assert meta["step"] == 1 and torch.equal(state["w"], torch.ones(4))


@pytest.mark.parametrize("damage", ["truncate", "flip", "meta", "missing"])
def test_corrupt_checkpoint_files_get_clear_errors(tmp_path, damage):
    mgr = CheckpointManager(tmp_path)
    path = mgr.save(1, {"w": torch.arange(1000.0)}, {"tp_size": 1})
    rank_file = path / "rank_00000.pt"
    data = rank_file.read_bytes()
    if damage == "truncate":
        rank_file.write_bytes(data[: len(data) // 2])
    elif damage == "flip":
        rank_file.write_bytes(data[:-100] + bytes([data[-100] ^ 0xFF]) + data[-99:])
    elif damage == "meta":
        (path / "meta.json").write_text("{not json")
    else:
        rank_file.unlink()
    needle = {
        "truncate": "truncated or corrupt",
        "flip": "truncated or corrupt",
        "meta": "meta.json",
        "missing": "missing",
    }
    with pytest.raises(ValueError, match=needle[damage]) as err:
        mgr.load(path, {"tp_size": 1})
    assert str(path) in str(err.value)


def test_metrics_go_to_jsonl_and_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from neuron_ckpt.train.metrics import MetricsWriter, make_record

    writer = MetricsWriter(tmp_path / "m.jsonl", tensorboard_dir=tmp_path / "tb")
    for step, loss in ((1, 5.0), (2, 4.0)):
        writer.write(make_record(step, loss, 1e-3, 0.5, 0.1, 8, 16, 1e6, 0.1, 4, 128 * step))
    writer.close()
    rows = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in rows] == [5.0, 4.0]
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(1, 5.0), (2, 4.0)]
    assert {"train/lr", "train/grad_norm", "train/tokens_per_s", "train/mfu"} <= set(events.Tags()["scalars"])


def test_recompute_auto_plans_per_layer_and_trains(world, run_files):
    """--recompute auto takes the planner's per-layer choice for the memory given, and trains
    exactly as the same choice given by hand would (here: a limit between all-selective and
    all-none, so the plan mixes options; explicit attention, where selective saves memory)."""
    from neuron_ckpt.memory import ModelShape, TrainingSetup
    from neuron_ckpt.memory.budget import GIB
    from neuron_ckpt.memory.planner import evaluate

    root, common = run_files
    shape = ModelShape.from_llama(SimpleNamespace(**TINY, head_dim=None))
    setup = TrainingSetup(seq_len=16, micro_batch=4, tp=2, dp=2, dtype="fp32")
    none = evaluate(shape, setup, "none", 1 << 40).budget.total_bytes
    selective = evaluate(shape, setup, "selective", 1 << 40).budget.total_bytes
    limit_gib = (none + selective) / 2 / GIB / 0.9  # the planner keeps 10% free
    auto = common + ["--recompute", "auto", "--device-memory", repr(limit_gib), "--dtype", "fp32",
                     "--micro-batch-size", "4", "--attention", "explicit"]  # fmt: skip
    out = world(4).run(_train, auto)[0]
    assert out["recompute_plan"] == {"none": 1, "selective": 1}
    assert out["losses"][0] > out["losses"][-1]
    message = world(4).run(_train_error, common + ["--recompute", "auto"])[0]
    assert "--device-memory" in message


def _open_and_count(path: str) -> int:
    """Child: open the corpus as train.py does; how many full checksum scans this rank ran."""
    from neuron_ckpt.data import packed
    from neuron_ckpt.distributed import runtime

    scans = []
    real = packed._sha256
    with patched(packed, "_sha256", lambda rows: scans.append(1) or real(rows)):
        try:
            train_module().open_dataset(path, runtime.get_runtime())
        except ValueError as e:
            return -1 if "checksum" in str(e) else -2
    return len(scans)


def test_corpus_is_scanned_by_one_rank_per_host(world, tmp_path):
    """Rank 0 (local rank 0) scans and stamps; the others skip. A corrupt corpus fails on every
    rank with the checksum error, none left waiting."""
    blocks = np.random.default_rng(1).integers(0, 128, size=(32, 16))
    good = write_packed(tmp_path / "good.safetensors", blocks, vocab_size=128, tokenizer="random")
    assert world(2).run(_open_and_count, str(good)) == [1, 0]
    assert world(2).run(_open_and_count, str(good)) == [0, 0]  # a later run: the stamp holds
    bad = write_packed(tmp_path / "bad.safetensors", blocks, vocab_size=128, tokenizer="random")
    raw = bytearray(bad.read_bytes())
    raw[-2] ^= 0x01
    bad.write_bytes(bytes(raw))
    assert world(2).run(_open_and_count, str(bad)) == [-1, -1]


def test_log_every_logs_the_interval_and_the_last_step(world, run_files):
    root, common = run_files
    out = world(4).run(
        _train, common + ["--max-steps", "7", "--log-every", "3", "--metrics-file", str(root / "l.jsonl")]
    )
    lines = read_metrics(root / "l.jsonl")["step"]
    assert [r["step"] for r in lines] == [3, 6, 7]
    assert all(r["step_time_s"] > 0 and r["tokens_seen"] == r["step"] * 8 * 16 for r in lines)
    every = world(4).run(_train, common + ["--max-steps", "7"])[0]
    assert out[0]["losses"] == [every["losses"][i] for i in (2, 5, 6)]  # same run, fewer records


def test_trn_device_kind_needs_the_xla_backend(world, run_files):
    root, common = run_files
    message = world(4).run(_train_error, common + ["--device-kind", "trn1"])[0]
    assert "--device-kind trn1 needs the xla backend" in message and "'gloo'" in message


# ---- checkpoint format 2: the model once per TP rank, streamed writes, writer rounds ------------


def _file_sizes(path: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in path.iterdir()}


def test_checkpoint_writes_model_once_per_tp_rank(world, run_files, tmp_path):
    """TP 2 x DP 2: only DP rank 0 of each TP rank (ranks 0 and 1) writes a model file; every rank
    writes its own optimizer slices. The bytes on disk versus the old layout (every rank one file
    with the model, optimizer, data order and RNG) are printed; the saving is the (DP - 1) extra
    model copies."""
    import io

    from safetensors import safe_open

    root, common = run_files
    world(4).run(_train, common + ["--checkpoint-dir", str(tmp_path), "--stop-at-step", "2"])
    path = tmp_path / "step_00000002"
    sizes = _file_sizes(path)
    ranks = [f"rank_{r:05d}{ext}" for r in range(4) for ext in (".pt", "-00001-of-00001.safetensors")]
    models = ["model_tp00000-00001-of-00001.safetensors", "model_tp00001-00001-of-00001.safetensors"]
    want = {"meta.json", *ranks, *models, *(f + ".sha256" for f in ranks + models)}
    assert set(sizes) == want, sorted(sizes)
    for tp, name in enumerate(models):
        with safe_open(str(path / name), "pt") as f:  # a standard safetensors file
            info = f.metadata()
            assert info["rank"] == str(tp) and info["tp_rank"] == str(tp) and info["dp_rank"] == "0", info
            assert "layers.0.mlp.down_proj.weight" in f.keys() and "lm_head.weight" in f.keys()
    meta = json.loads((path / "meta.json").read_text())
    assert meta["format"] == "neuron_ckpt.train.checkpoint/2" and meta["shared"] == {
        "model": ["model_tp00000", "model_tp00001"]
    }
    assert [f for prefix in meta["shared"]["model"] for f in meta["groups"][prefix]] == models
    assert {k: v for k, v in meta["files"].items()} == {k: v for k, v in sizes.items() if k != "meta.json"}

    # The old layout, rebuilt from this checkpoint: rank r's file held torch.save of its whole
    # state (model slice of its TP rank included), plus a .sha256 beside it, plus meta.json.
    old = sizes["meta.json"]
    for r in range(4):
        ps = SimpleNamespace(tp_rank=r % 2, tp_size=2, dp_rank=r // 2, dp_size=2)
        rank_state, _ = CheckpointManager(tmp_path, rank=r, world_size=4, parallel_state=ps).load(path, {})
        assert set(rank_state) == {"model", "optimizer", "data", "rng"}
        buf = io.BytesIO()
        torch.save(rank_state, buf)
        old += len(buf.getvalue()) + 64
    new = sum(sizes.values())
    model_bytes = sum(sizes[m] for m in models)
    print(
        f"\ncheckpoint bytes at TP 2 x DP 2: old layout {old}, new layout {new} ({new / old:.1%}); "
        f"model files {model_bytes}"
    )
    assert new < old
    assert old - new > 0.8 * model_bytes  # DP - 1 = 1 extra copy of every TP rank's model slice gone


def _save_in_rounds(directory: str, log: str, writers: int) -> tuple[int, int]:
    """Worker: TP 2 x DP 2 save; each file write appends "start <rank>" and "end <rank>" to
    ``log`` (appends from all ranks land in the order they happen). This rank's rounds."""
    import neuron_ckpt as nc
    from neuron_ckpt.distributed import runtime
    from neuron_ckpt.train import checkpoint as ck

    parallel = nc.initialize_model_parallel(2)
    rt = runtime.get_runtime()
    mgr = CheckpointManager(directory, 1, rt.rank, rt.world_size, parallel_state=parallel, writers=writers)
    real = ck.write_tensors

    def logged(*args, **kwargs):
        with open(log, "a") as f:
            f.write(f"start {rt.rank}\n")
        result = real(*args, **kwargs)
        with open(log, "a") as f:
            f.write(f"end {rt.rank}\n")
        return result

    with patched(ck, "write_tensors", logged):
        rank_state = {
            "model": {"w": torch.full((4,), float(parallel.tp_rank))},
            "opt": torch.full((3,), float(rt.rank)),
        }
        mgr.save(1, rank_state, {})
    return mgr.rounds()


def test_checkpoint_writers_per_host_are_limited(world, tmp_path):
    """Ranks write in rounds of ``writers`` local ranks (LocalWorld: local rank = rank), one round
    after the other: every write of round r ends before any write of round r + 1 starts."""
    for writers in (1, 2, 0):
        log = tmp_path / f"w{writers}.log"
        rounds = world(4).run(_save_in_rounds, str(tmp_path / f"w{writers}"), str(log), writers)
        count = -(-4 // writers) if writers else 1
        assert rounds == [(count, r // writers if writers else 0) for r in range(4)], rounds
        events = [line.split() for line in log.read_text().splitlines()]
        assert {int(r) for _, r in events} == {0, 1, 2, 3}, events  # every rank wrote
        if writers:
            order = [int(r) // writers for _, r in events]
            assert order == sorted(order), events
    loaded, _ = CheckpointManager(tmp_path / "w2").load(tmp_path / "w2" / "step_00000001", {"world_size": 4})
    assert torch.equal(loaded["model"]["w"], torch.zeros(4)) and torch.equal(loaded["opt"], torch.zeros(3))


@pytest.mark.parametrize("damage", ["truncate", "flip", "header", "missing"])
def test_corrupt_or_missing_model_file_is_named(tmp_path, damage):
    mgr = CheckpointManager(tmp_path)
    path = mgr.save(1, {"model": {"w": torch.arange(1000.0), "b": torch.ones(3)}, "step": 1}, {"tp_size": 1})
    model = path / "model_tp00000-00001-of-00001.safetensors"
    data = model.read_bytes()
    if damage == "truncate":
        model.write_bytes(data[: len(data) // 2])
    elif damage == "flip":
        model.write_bytes(data[:-100] + bytes([data[-100] ^ 0xFF]) + data[-99:])
    elif damage == "header":
        model.write_bytes(data[:20] + b"\x00" + data[21:])
    else:
        model.unlink()
    needle = "missing" if damage == "missing" else "truncated or corrupt"
    with pytest.raises(ValueError, match=needle) as err:
        mgr.load(path, {"tp_size": 1})
    assert str(model) in str(err.value)


def test_older_checkpoint_format_is_refused(tmp_path):
    mgr = CheckpointManager(tmp_path)
    path = mgr.save(1, {"w": torch.ones(2)}, {"tp_size": 1})
    meta = json.loads((path / "meta.json").read_text())
    (path / "meta.json").write_text(json.dumps({**meta, "format": "neuron_ckpt.train.checkpoint/1"}))
    with pytest.raises(ValueError, match="checkpoint format 'neuron_ckpt.train.checkpoint/1'") as err:
        mgr.load(path, {"tp_size": 1})
    assert "reads 'neuron_ckpt.train.checkpoint/2' only" in str(err.value) and "--init-hf" in str(err.value)


def test_checkpoint_tensors_reach_the_host_a_group_at_a_time(tmp_path, monkeypatch):
    """With chunk_mb = 16 KiB, tensors go to the host in groups of at most 16 KiB (a larger
    tensor alone), each group its own standard safetensors file; the nested state, dtypes and
    the log line come back right."""
    from safetensors import safe_open

    from neuron_ckpt.train import tensor_files

    groups = []
    real = tensor_files._to_host
    monkeypatch.setattr(
        tensor_files, "_to_host", lambda ts: groups.append([t.numel() * t.element_size() for t in ts]) or real(ts)
    )
    lines = []
    mgr = CheckpointManager(tmp_path, chunk_mb=16 / 1024, log=lines.append)
    model = {f"layer{i}.weight": torch.randn(32, 32) for i in range(6)}  # 4 KiB each
    model["embed.weight"] = torch.randn(64, 128)  # 32 KiB: a group of its own
    model["norm.weight"] = torch.ones(8, dtype=torch.bfloat16)
    rank_state = {
        "model": model,
        "optimizer": {"inner": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(5000)}},
                                "param_groups": [{"lr": 0.1, "betas": (0.9, 0.95), "params": [0]}]},
                      "master": [torch.randn(7, dtype=torch.float64)], "meta": {"shapes": [(2, 3)]}},
        "flags": torch.tensor([True, False]), "empty": torch.zeros(0, 3), "n": 5,
    }  # fmt: skip
    path = mgr.save(1, rank_state, {})
    limit = 16 * 1024
    assert len(groups) >= 4 and all(sum(g) <= limit or len(g) == 1 for g in groups), groups
    assert [32 * 1024] in groups
    in_files = []
    for name in sorted(f.name for f in path.glob("*.safetensors")):
        with safe_open(str(path / name), "pt") as f:
            in_files.append(sorted(f.get_tensor(k).numel() * f.get_tensor(k).element_size() for k in f.keys()))
    assert sorted(in_files) == sorted(sorted(g) for g in groups), (in_files, groups)
    assert (
        len(lines) == 1 and "checkpoint step_00000001:" in lines[0] and " KB on disk" in lines[0] and " s " in lines[0]
    )
    assert mgr.last_save.total_bytes == sum(p.stat().st_size for p in path.iterdir())
    loaded, _ = mgr.load(path, {})
    assert list(loaded["model"]) == list(model) and all(torch.equal(loaded["model"][k], v) for k, v in model.items())
    assert loaded["model"]["norm.weight"].dtype == torch.bfloat16
    opt = loaded["optimizer"]
    assert torch.equal(opt["inner"]["state"][0]["exp_avg"], rank_state["optimizer"]["inner"]["state"][0]["exp_avg"])
    assert opt["inner"]["param_groups"][0]["betas"] == (0.9, 0.95) and opt["meta"] == {"shapes": [(2, 3)]}
    assert (
        torch.equal(opt["master"][0], rank_state["optimizer"]["master"][0]) and opt["master"][0].dtype == torch.float64
    )
    assert torch.equal(loaded["flags"], rank_state["flags"]) and loaded["empty"].shape == (0, 3) and loaded["n"] == 5


def test_train_state_round_trip_restores_every_rng_stream(tmp_path):
    """TrainState: model, optimizer, batch order, the CPU generator and the tracker's streams, one
    state dict; after a load, the next draws and the next optimizer step repeat exactly."""
    from neuron_ckpt.distributed.random import RNGStatesTracker
    from neuron_ckpt.train import TrainState

    class Order:
        def __init__(self):
            self.step = 0

        def state_dict(self):
            return {"step": self.step}

        def load_state_dict(self, s):
            self.step = s["step"]

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    tracker = RNGStatesTracker()
    tracker.add("tp", 99)
    order = Order()
    ts = TrainState(model, opt, order, rng_tracker=tracker)

    def step():
        opt.zero_grad()
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        order.step += 1
        with tracker.fork("tp"):
            return torch.rand(3)

    step()
    ts.step = 1
    mgr = CheckpointManager(tmp_path)
    path = ts.save(mgr, {})
    after = [step(), torch.rand(2), model.weight.detach().clone(), order.step]
    ts.step = 2
    assert ts.resume(mgr, "latest", {})[1]["step"] == 1 and ts.step == 1 and order.step == 1
    again = [step(), torch.rand(2), model.weight.detach().clone(), order.step]
    assert all(torch.equal(a, b) for a, b in zip(after[:3], again[:3])) and after[3] == again[3] == 2
    assert set(ts.state_dict()) == {"model", "optimizer", "data", "rng"} and path.name == "step_00000001"


def _save_failing_on_rank_2(directory: str) -> str:
    """Worker: rank 2's write fails (disk full, say) in the second of 4 writer rounds."""
    import neuron_ckpt as nc
    from neuron_ckpt.distributed import runtime
    from neuron_ckpt.train import checkpoint as ck

    parallel = nc.initialize_model_parallel(2)
    rt = runtime.get_runtime()
    mgr = CheckpointManager(directory, 1, rt.rank, rt.world_size, parallel_state=parallel, writers=1)

    def full(path, obj):
        raise OSError(28, "No space left on device")

    with patched(ck, "write_structure", full if rt.rank == 2 else ck.write_structure):
        try:
            mgr.save(1, {"model": {"w": torch.ones(2)}, "x": torch.ones(1)}, {})
        except (OSError, RuntimeError) as e:
            return f"{type(e).__name__}: {e}"
    return "saved"


def test_a_failed_write_on_one_rank_fails_the_save_everywhere(world, tmp_path):
    """No rank is left waiting in a writer round or commits: all raise, ``latest`` is not written."""
    out = world(4).run(_save_failing_on_rank_2, str(tmp_path))
    assert out[2] == "OSError: [Errno 28] No space left on device", out
    assert all(
        o.startswith("RuntimeError: writing checkpoint") and "another rank" in o for i, o in enumerate(out) if i != 2
    ), out
    assert not (tmp_path / "latest").exists() and CheckpointManager(tmp_path).complete() == []


def test_export_hf_then_init_hf_at_another_tp(world, run_files, tmp_path):
    """--export-hf writes a directory transformers loads; --init-hf reads it back at TP 4 with no
    --model-config (its config.json is used), and with a step too small to move any fp32 weight
    (lr 1e-30: AdamW moves each weight by about lr, far below half an ulp of weights ~1e-2) the
    weights come out bit-identical."""
    import transformers
    from safetensors.torch import load_file

    root, common = run_files
    world(4).run(_train, common + ["--max-steps", "2", "--export-hf", str(tmp_path / "a")])
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "a")
    assert hf.config.num_hidden_layers == TINY["num_hidden_layers"]
    argv = [a for a in common if a not in ("--model-config", str(root / "tiny.json"))]
    tp4 = [a if a != "2" or argv[i - 1] != "--tp" else "4" for i, a in enumerate(argv)]
    out = world(4).run(
        _train,
        tp4
        + [
            "--max-steps",
            "1",
            "--lr",
            "1e-30",
            "--weight-decay",
            "0",
            "--init-hf",
            str(tmp_path / "a"),
            "--export-hf",
            str(tmp_path / "b"),
        ],
    )
    assert out[0]["steps"] == 1
    before, after = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert hf.state_dict()["lm_head.weight"].equal(before["lm_head.weight"])


def _train_os_error(argv: list[str]) -> str:
    return _train_error(argv, OSError)


def test_unwritable_export_fails_before_training(world, run_files, tmp_path):
    root, common = run_files
    (tmp_path / "file").write_text("not a directory")
    message = world(4).run(
        _train_os_error,
        common + ["--export-hf", str(tmp_path / "file" / "hf"), "--metrics-file", str(tmp_path / "m.jsonl")],
    )[0]
    assert "cannot write the HF checkpoint" in message
    assert not (tmp_path / "m.jsonl").exists()  # no step ran


# ---- issue #24: NxD's recipe, the compile-only run, the header and summary of the metrics file ---


def _train_with_env(argv: list[str], env: dict[str, str], nan: bool = False):
    """``main(argv)`` with ``env`` set (and, with ``nan``, every step's loss a NaN, as a compile-only
    run's placeholders may be); returns the summary, or the NonFiniteError's message."""
    import os
    from unittest import mock

    from neuron_ckpt.train import NonFiniteError, loop

    real = loop.train_step
    step = (lambda *a: tuple(t * float("nan") for t in real(*a))) if nan else real
    with patched(loop, "train_step", step), mock.patch.dict(os.environ, env):
        try:
            return _train(argv)
        except NonFiniteError as e:
            return str(e)


def test_graphs_only_run_skips_the_nan_check_metrics_and_checkpoints(world, run_files, tmp_path):
    root, common = run_files
    out = ["--metrics-file", str(tmp_path / "m.jsonl"), "--checkpoint-dir", str(tmp_path / "ckpt"), "--max-steps", "2"]
    failed = world(4).run(_train_with_env, common + out, {}, True)[0]
    assert isinstance(failed, str) and "step 1" in failed  # a real run stops at the NaN
    (tmp_path / "m.jsonl").unlink()
    compiled = world(4).run(_train_with_env, common + out, {"NEURON_EXTRACT_GRAPHS_ONLY": "1"}, True)[0]
    assert compiled["steps"] == 0
    assert not (tmp_path / "m.jsonl").exists() and not list((tmp_path / "ckpt").glob("step_*"))


def test_metrics_file_has_a_header_steps_and_nxd_summary(world, run_files, tmp_path):
    """The header holds the NEURON*/XLA* environment and the resolved options (--recipe nxd's
    values); the summary has NxD's fields, the average skipping ceil(10 / log_every) records."""
    root, common = run_files
    argv = common + [
        "--recipe",
        "nxd",
        "--max-steps",
        "8",
        "--log-every",
        "2",
        "--attention",
        "explicit",
        "--metrics-file",
        str(tmp_path / "m.jsonl"),
    ]  # explicit: a recompute the planner models
    env = {"NEURON_RT_STOCHASTIC_ROUNDING_EN": "0", "XLA_FLAGS": "--xla_dump_to=x", "OTHER_VAR": "1"}
    summary = world(4).run(_train_with_env, argv, env)[0]
    kinds = read_metrics(tmp_path / "m.jsonl")
    lines = (tmp_path / "m.jsonl").read_text().splitlines()
    assert json.loads(lines[0])["kind"] == "header" and json.loads(lines[-1])["kind"] == "summary"
    (header,), steps, (written,) = kinds["header"], kinds["step"], kinds["summary"]
    assert {"NEURON_RT_STOCHASTIC_ROUNDING_EN": "0", "XLA_FLAGS": "--xla_dump_to=x"}.items() <= header["env"].items()
    assert "OTHER_VAR" not in header["env"]
    assert {k: header["config"][k] for k in ("recipe", "decay", "beta2", "seed", "data_order")} == {
        "recipe": "nxd",
        "decay": "linear",
        "beta2": 0.999,
        "seed": 12349,
        "data_order": "sequential",
    }
    assert [r["step"] for r in steps] == [2, 4, 6, 8]
    # warmup 1 from zero: step 1 ran at 0, step 2 at the peak, then linear to 0 at step 8
    assert steps[0]["lr"] == 1e-2 and steps[1]["lr"] == pytest.approx(1e-2 * 5 / 7)
    assert steps[0]["device_peak_bytes"] is None and steps[0]["predicted_peak_bytes"] > 0  # CPU: no device peak
    after = steps[5:] or steps  # ceil(10 / 2) = 5 records skipped; fewer here: all of them
    assert written["final_loss"] == steps[-1]["loss"] == summary["final_loss"]
    assert written["average_throughput_seq_per_s"] == pytest.approx(sum(r["seq_per_s"] for r in after) / len(after))
    assert written["peak_throughput_seq_per_s"] == max(r["seq_per_s"] for r in after)
    assert 0 < written["time_to_train_s"] <= written["wall_s"]
