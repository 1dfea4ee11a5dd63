"""Bytes on the wire, as ``scripts/bench_zero1.py`` counts them, for a layout worked out by hand.

The tiny model (57 fp32 parameters, one group) with 64-byte buckets at dp 2 is padded to 58
elements and cut into buckets of 16, 16, 16 and 10; at dp 4, 60 elements: 16, 16, 16, 12.
ZeRO-1 on gloo reduce-scatters each bucket with one all-to-all and gathers it with dp
broadcasts of its 1/dp; the gradient norm is one 4-byte all-reduce over DP (the TP group has one
rank: no call). Each rank sends (p-1)/p of every bucket twice, as the minimum (2(p-1)/p of the
228 parameter bytes) plus the padding and the norm. Torch's DDP + ZeroRedundancyOptimizer
all-reduces every gradient and broadcasts every parameter from its owner: 1.5x the minimum at dp 2.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from torch import nn

import neuron_ckpt as nc
from neuron_ckpt.distributed.parallel_state import Group, ParallelState
from neuron_ckpt.optim import Zero1Optimizer

from .test_zero1 import LR, TINY_CAP_MB, _data, _mlp, _mse

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_zero1.py"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_zero1", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _counted_steps() -> dict[str, dict[str, list[float]]]:
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    bench = _bench()
    ps = nc.initialize_model_parallel(1)
    x, y = _data(0, ps.dp_rank)
    model = _mlp()
    opt = Zero1Optimizer(model.parameters(), lr=LR, bucket_cap_mb=TINY_CAP_MB)
    _mse(model, x, y).backward()
    with bench.WireCount().counting() as ours:
        opt.step()
    theirs = bench.WireCount()
    ddp = DistributedDataParallel(_mlp())
    ddp.register_comm_hook(None, allreduce_hook)
    zero = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, lr=LR)
    with theirs.counting():
        _mse(ddp, x, y).backward()
        zero.step()
    return {"ours": dict(ours.by_op), "torch": dict(theirs.by_op), "buckets": [b.end - b.start for b in opt.buckets]}


@pytest.mark.parametrize("p", [2, 4])
def test_bytes_per_step_for_a_known_bucket_layout(world, p):
    padded = 58 if p == 2 else 60
    cuts = [16, 16, 16, padded - 48]
    share = (p - 1) / p
    for r in world(p).run(_counted_steps):
        assert r["buckets"] == cuts
        assert r["ours"] == {  # {collective: [calls, payload bytes, bytes sent]}
            "all_to_all": [4, 4 * padded, share * 4 * padded],  # one per bucket, its whole input
            "all_reduce": [1, 4, 2 * share * 4],  # the squared norm over DP
            "broadcast": [4 * p, 4 * padded, share * 4 * padded],  # p per bucket, 1/p of it each
        }
        if p == 2:
            # DDP: one bucket of all 57 gradients; ZeRO: one broadcast per parameter (4).
            assert r["torch"] == {"all_reduce": [1, 228, 228.0], "broadcast": [4, 228, 114.0]}


def test_conventions_and_table():
    bench = _bench()
    fractions = {p: {op: f(p) for op, f in bench.SENT_FRACTION.items()} for p in (2, 4)}
    assert fractions[2] == {"all_reduce": 1.0, "reduce_scatter": 0.5, "all_gather": 0.5, "all_to_all": 0.5,
                            "broadcast": 0.5, "reduce": 0.75}  # fmt: skip
    assert fractions[4] == {"all_reduce": 1.5, "reduce_scatter": 0.75, "all_gather": 0.75, "all_to_all": 0.75,
                            "broadcast": 0.75, "reduce": 15 / 16}  # fmt: skip
    count = bench.WireCount()
    count.add("all_to_all", torch.zeros(2**18), 2)  # 1 MiB
    count.add("broadcast", torch.zeros(2**17), 2)  # two halves of it
    count.add("broadcast", torch.zeros(2**17), 2)
    count.add("all_reduce", torch.zeros(2**18), 1)  # one rank: no bytes, not a call
    assert dict(count.by_op) == {"all_to_all": [1, 2**20, 2**19], "broadcast": [2, 2**20, 2**19]}
    table = bench.wire_table({"ours": dict(count.by_op), "torch": {"all_reduce": [1, 2**20, 2**20]}}, 2**20, 2)
    assert "= 1.0 = 1.000 x minimum" in table.splitlines()[1]
    assert table.splitlines()[2].endswith("all_reduce 1.0 (1 call) = 1.0 = 1.000 x minimum")


def test_bucket_pieces_are_named():
    one = Group(None, (0,), ((0,),), 0)  # a single process: no process group needed
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3))
    opt = Zero1Optimizer(model.parameters(), parallel_state=ParallelState(one, one), bucket_cap_mb=64 / 2**20)
    first, second = opt.buckets[:2]  # 16 elements each: weight 0 (30) spans both
    assert first.pieces[0]._asdict() == {"index": 0, "first": 0, "last": 16, "offset": 0}
    assert second.pieces[0]._asdict() == {"index": 0, "first": 16, "last": 30, "offset": 0}
    assert second.pieces[1]._asdict() == {"index": 1, "first": 0, "last": 2, "offset": 14}
    # dp 1: this rank's slice is the whole bucket; one segment per run of equal norm weight (TP 1: 1).
    assert [s._asdict() for s in second.norm_segments] == [{"start": 0, "end": 16, "weight": 1.0}]
