"""ZeRO-1 optimizer: the same training trajectory as dense AdamW + clip_grad_norm_, with 1/dp state,
bucketed or not, with or without fp32 gradient accumulation.

Each check runs on gloo worker processes and computes its dense reference in the same worker.
Tolerances: fp32 AdamW with clipping, ZeRO-1 against dense, differ only in summation order (the
DP reduction, the norm summed per slice and segment), a few ulps per step; 1e-6 absolute on
parameters of size ~0.5 after 5 steps and 1e-5 relative on norms leave ~10x margin and are far
below what a wrong slice, a missed bucket or a double-counted gradient gives (> 1e-3).
"""

from __future__ import annotations

import copy
import io
import math
import re
import weakref

import pytest
import torch
from torch import nn

import neuron_ckpt as nc
from neuron_ckpt.distributed.collectives import all_reduce
from neuron_ckpt.distributed.parallel_state import Group, ParallelState
from neuron_ckpt.optim import Zero1Optimizer
from neuron_ckpt.parallel.params import set_tensor_parallel_attributes

from .helpers import rel_norm

LR, WD = 1e-2, 0.1
CLIP = 0.05  # small enough that every step clips (norms here are ~0.3-1)
# 64 bytes: 16 fp32 elements per bucket at dp 2 and 4, so _mlp's 30-element weight is split over
# buckets and most buckets hold pieces of two parameters.
TINY_CAP_MB = 64 / 2**20


def _mlp(dtype: torch.dtype = torch.float32) -> nn.Module:
    # 30 + 6 + 18 + 3 = 57 trainable values: odd, so dp=2 pads.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3)).to(dtype)
    return model


def _data(step: int, rank: int, batch: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(batch, 5, generator=g), torch.randn(batch, 3, generator=g)


def _mse(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (model(x.to(next(model.parameters()).dtype)).float() - y).pow(2).mean()


def _train_zero1(model: nn.Module, opt: Zero1Optimizer, steps: range, dp_rank: int) -> list[float]:
    norms = []
    for step in steps:
        opt.zero_grad()
        _mse(model, *_data(step, dp_rank)).backward()
        norms.append(float(opt.step()))
    return norms


def _groups(model: nn.Module, grouped: bool) -> list[dict]:
    """One group, or biases in their own group without weight decay (as for norms and biases)."""
    if not grouped:
        return [{"params": list(model.parameters())}]
    named = list(model.named_parameters())
    return [
        {"params": [p for n, p in named if not n.endswith("bias")]},
        {"params": [p for n, p in named if n.endswith("bias")], "weight_decay": 0.0},
    ]


def _dense(steps: int, grouped: bool, dp_size: int) -> tuple[nn.Module, list[float]]:
    """Single-process AdamW + clip_grad_norm_ on the concatenation of every DP rank's batch."""
    ref = _mlp()
    ref_opt = torch.optim.AdamW(_groups(ref, grouped), lr=LR, weight_decay=WD)
    ref_norms = []
    for step in range(steps):
        ref_opt.zero_grad()
        batches = [_data(step, r) for r in range(dp_size)]
        x, y = (torch.cat(t) for t in zip(*batches))
        _mse(ref, x, y).backward()
        ref_norms.append(float(nn.utils.clip_grad_norm_(ref.parameters(), CLIP)))
        ref_opt.step()
    return ref, ref_norms


def _max_diff(a: nn.Module, b: nn.Module) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a.parameters(), b.parameters()))


def _dp_matches_dense(steps: int, grouped: bool) -> tuple[float, list[float], list[float]]:
    ps = nc.initialize_model_parallel(1)
    model = _mlp()
    groups = _groups(model, grouped)
    opt = Zero1Optimizer(groups, torch.optim.AdamW, grad_clip_norm=CLIP, lr=LR, weight_decay=WD)
    norms = _train_zero1(model, opt, range(steps), ps.dp_rank)
    ref, ref_norms = _dense(steps, grouped, ps.dp_size)
    return _max_diff(model, ref), norms, ref_norms


@pytest.mark.parametrize("grouped", [False, True], ids=["one_group", "no_decay_biases"])
def test_dp2_matches_dense_adamw_with_clipping(world, grouped):
    for err, norms, ref_norms in world(2).run(_dp_matches_dense, 5, grouped):
        assert err < 1e-6
        assert norms == pytest.approx(ref_norms, rel=1e-5)
        assert min(norms) > CLIP  # clipping happened every step


# ---- buckets: several per (group, dtype), parameters split across them ----------------------

VARIANTS = {  # name: Zero1Optimizer options
    "unbucketed": {"bucket_cap_mb": None},
    "bucketed": {"bucket_cap_mb": TINY_CAP_MB},
    "bucketed_fp32_hooks": {"bucket_cap_mb": TINY_CAP_MB, "accumulate_fp32": True},
}


def _bucket_variants(steps: int) -> dict:
    """Each variant against dense AdamW and against the unbucketed one, plus its bucket sizes."""
    ps = nc.initialize_model_parallel(1)
    ref, ref_norms = _dense(steps, True, ps.dp_size)
    out, models = {"ref_norms": ref_norms}, {}
    for name, options in VARIANTS.items():
        model = _mlp()
        opt = Zero1Optimizer(_groups(model, True), grad_clip_norm=CLIP, lr=LR, weight_decay=WD, **options)
        norms = _train_zero1(model, opt, range(steps), ps.dp_rank)
        models[name] = model
        largest = max(p.numel() for p in model.parameters())
        out[name] = {
            "err": _max_diff(model, ref),
            "vs_unbucketed": _max_diff(model, models["unbucketed"]),
            "norms": norms,
            "bucket_numels": [b.end - b.start for b in opt.buckets],
            "largest_param": largest,
            "grads_cleared": all(p.grad is None for p in model.parameters()),
        }
    return out


@pytest.mark.parametrize("dp", [2, 4])
def test_bucketed_equals_unbucketed_equals_dense_adamw(world, dp):
    for res in world(dp).run(_bucket_variants, 5):
        assert min(res["ref_norms"]) > CLIP  # clipping is active every step
        for name in VARIANTS:
            r = res[name]
            assert r["err"] < 1e-6, name
            assert r["vs_unbucketed"] < 1e-6, name
            assert r["norms"] == pytest.approx(res["ref_norms"], rel=1e-5), name
            assert all(n % dp == 0 for n in r["bucket_numels"]), name
        cut = res["bucketed"]["bucket_numels"]
        assert len(cut) >= 4  # weights 30 + 18 -> 3 buckets of 16, biases 6 + 3 (+ padding) -> 1
        assert max(cut) * 4 <= TINY_CAP_MB * 2**20 < res["bucketed"]["largest_param"] * 4  # a param over the cap
        assert len(res["unbucketed"]["bucket_numels"]) == 2  # one per param group
        # The hooks move p.grad into the fp32 buffers; without them p.grad stays as torch leaves it.
        assert [res[n]["grads_cleared"] for n in VARIANTS] == [False, False, True]


# ---- TP x DP: a column-sharded weight and a replicated vector, no parallel layers ------------


def _tp_full_params() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return torch.randn(6, 5, generator=g), torch.randn(5, generator=g)  # W rows split over TP; b replicated


def _tp_loss(w: torch.Tensor, b: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Separable over the rows of ``w``: the sum of TP ranks' losses on their row blocks (each
    with the whole ``b`` term) has the dense model's gradients, with no collective in forward."""
    return torch.tanh(x @ w.t()).pow(2).sum(-1).mean() + (torch.tanh(x @ b) - 0.5).pow(2).mean()


def _tp_data(step: int, dp_rank: int) -> torch.Tensor:
    return torch.randn(4, 5, generator=torch.Generator().manual_seed(100 * step + dp_rank))


def _tp_dp_matches_dense(steps: int, options: dict) -> tuple[float, list[float], list[float]]:
    ps = nc.initialize_model_parallel(2)
    w_full, b_full = _tp_full_params()
    w = nn.Parameter(w_full.chunk(ps.tp_size, 0)[ps.tp_rank].clone())
    set_tensor_parallel_attributes(w, partition_dim=0)
    b = nn.Parameter(b_full.clone())
    opt = Zero1Optimizer([w, b], grad_clip_norm=CLIP, lr=LR, weight_decay=WD, **options)

    rw, rb = nn.Parameter(w_full.clone()), nn.Parameter(b_full.clone())
    ref_opt = torch.optim.AdamW([rw, rb], lr=LR, weight_decay=WD)
    norms, ref_norms = [], []
    for step in range(steps):
        opt.zero_grad()
        # Only the row block's term differs between TP ranks; the b term is the full one.
        _tp_loss(w, b, _tp_data(step, ps.dp_rank)).backward()
        norms.append(float(opt.step()))

        ref_opt.zero_grad()
        x = torch.cat([_tp_data(step, r) for r in range(ps.dp_size)])
        _tp_loss(rw, rb, x).backward()
        ref_norms.append(float(nn.utils.clip_grad_norm_([rw, rb], CLIP)))
        ref_opt.step()
    mine = rw.detach().chunk(ps.tp_size, 0)[ps.tp_rank]
    err = max((w - mine).abs().max().item(), (b - rb).abs().max().item())
    return err, norms, ref_norms


@pytest.mark.parametrize(
    "options",
    # 32 bytes = 8 fp32 elements: w (15 per TP rank) spans buckets [0, 8) and [8, 16), and the
    # middle bucket holds w (norm weight 1) and b (weight 1/2) side by side.
    [{"bucket_cap_mb": None}, {"bucket_cap_mb": 32 / 2**20}, {"bucket_cap_mb": 32 / 2**20, "accumulate_fp32": True}],
    ids=["unbucketed", "bucketed", "bucketed_fp32_hooks"],
)
def test_tp2_dp2_grad_norm_and_steps_match_dense(world, options):
    for err, norms, ref_norms in world(4).run(_tp_dp_matches_dense, 5, options):
        assert norms == pytest.approx(ref_norms, rel=1e-5)
        assert min(norms) > CLIP
        assert err < 1e-6


# ---- state: 1/dp per rank, checkpoint round trip, mismatch errors ---------------------------


def _state_numel(opt: Zero1Optimizer) -> int:
    sd = opt.state_dict()
    inner = sum(t.numel() for s in sd["inner"]["state"].values() for t in s.values() if t.dim() > 0)
    return inner + sum(m.numel() for m in sd["master"])


def _state_is_sharded(cap_mb: float | None) -> tuple[int, int, int]:
    ps = nc.initialize_model_parallel(1)
    model = _mlp()
    opt = Zero1Optimizer(model.parameters(), lr=LR, bucket_cap_mb=cap_mb)
    _train_zero1(model, opt, range(1), ps.dp_rank)
    full = sum(p.numel() for p in model.parameters())
    return _state_numel(opt), full, ps.dp_size


@pytest.mark.parametrize("cap_mb", [None, TINY_CAP_MB], ids=["unbucketed", "bucketed"])
def test_per_rank_state_is_one_dp_th(world, cap_mb):
    for numel, full, dp in world(2).run(_state_is_sharded, cap_mb):
        # master + exp_avg + exp_avg_sq, each ceil(full / dp): buckets add no padding but the last
        assert numel == 3 * -(-full // dp)


def _saved_after(steps: int, dtype: torch.dtype, ps, **options) -> dict:
    """``{"model", "optim"}`` of an MLP and its Zero1Optimizer(``**options``) trained ``steps``
    steps, written with torch.save and read back."""
    model = _mlp(dtype)
    opt = Zero1Optimizer(model.parameters(), **options)
    _train_zero1(model, opt, range(steps), ps.dp_rank)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, buf)
    buf.seek(0)
    return torch.load(buf)


def _resume_matches(total: int, split: int, dtype: torch.dtype, cap_mb: float | None) -> bool:
    """Train ``total`` steps straight, and ``split`` steps + save + load into a fresh model and
    optimizer + the rest; the parameters must be bit-identical."""
    ps = nc.initialize_model_parallel(1)
    options = {"grad_clip_norm": CLIP, "lr": LR, "weight_decay": WD, "bucket_cap_mb": cap_mb}
    straight = _mlp(dtype)
    opt = Zero1Optimizer(straight.parameters(), **options)
    _train_zero1(straight, opt, range(total), ps.dp_rank)

    ckpt = _saved_after(split, dtype, ps, **options)
    resumed = _mlp(dtype)
    resumed.load_state_dict(ckpt["model"])
    opt = Zero1Optimizer(resumed.parameters(), **options)
    opt.load_state_dict(ckpt["optim"])
    _train_zero1(resumed, opt, range(split, total), ps.dp_rank)
    return all(torch.equal(a, b) for a, b in zip(straight.parameters(), resumed.parameters()))


@pytest.mark.parametrize(
    "dtype, cap_mb",
    # bf16 also proves the fp32 master weights are restored (they differ from the bf16 params);
    # bf16 with a tiny cap is several buckets with fp32 accumulation hooks.
    [(torch.float32, None), (torch.float32, TINY_CAP_MB), (torch.bfloat16, None), (torch.bfloat16, TINY_CAP_MB)],
    ids=["fp32", "fp32_bucketed", "bf16", "bf16_bucketed_fp32_accum"],
)
def test_state_dict_round_trip_continues_identically(world, dtype, cap_mb):
    assert all(world(2).run(_resume_matches, 5, 3, dtype, cap_mb))


def _as_v1(opt: Zero1Optimizer) -> dict:
    """What the unbucketed optimizer saved in development versions before bucketing (layout
    version 1): no "version" key, one "buffers" entry per (param group, dtype)."""
    sd = opt.state_dict()
    assert all(len(f["buckets"]) == 1 for f in sd["meta"]["flats"])
    buffers = [
        {"group": f["group"], "dtype": f["dtype"], "shapes": f["shapes"],
         "numels": [torch.Size(s).numel() for s in f["shapes"]], "padding": f["padding"], "shard_numel": m.numel()}
        for f, m in zip(sd["meta"]["flats"], sd["master"])
    ]  # fmt: skip
    meta = {k: sd["meta"][k] for k in ("dp_size", "dp_rank", "tp_size", "tp_rank")}
    return {"inner": sd["inner"], "master": sd["master"], "meta": {**meta, "buffers": buffers}}


def _saved_state(cap_mb: float | None = 128, v1: bool = False) -> dict:
    ps = nc.initialize_model_parallel(1)
    model = _mlp()
    opt = Zero1Optimizer(model.parameters(), lr=LR, bucket_cap_mb=cap_mb)
    _train_zero1(model, opt, range(1), ps.dp_rank)
    return _as_v1(opt) if v1 else opt.state_dict()


def _load_error(sd: dict, tp: int, out_features: int, cap_mb: float | None = 128) -> str:
    nc.initialize_model_parallel(tp)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, out_features))
    opt = Zero1Optimizer(model.parameters(), lr=LR, bucket_cap_mb=cap_mb)
    before = [t.clone() for t in opt.state_dict()["master"]]
    try:
        opt.load_state_dict(sd)
    except ValueError as e:
        untouched = all(torch.equal(a, b) for a, b in zip(before, opt.state_dict()["master"]))
        return str(e) if untouched and not opt.state else "state was modified before the error"
    return "no error"


def test_load_state_dict_rejects_other_layouts(world):
    w2 = world(2)
    saved = w2.run(_saved_state)[0]  # dp=2, rank 0
    msg = w2.run(_load_error, saved, 2, 3)[0]  # tp=2 -> dp=1
    assert "dp_size: checkpoint 2, here 1" in msg
    assert "tp_size: checkpoint 1, here 2" in msg
    msg = w2.run(_load_error, saved, 1, 4)[0]  # same dp, last layer 6->4
    assert "parameter 2 shape: checkpoint (3, 6), here (4, 6)" in msg


def test_load_state_dict_rejects_another_bucket_cap(world):
    w2 = world(2)
    saved = w2.run(_saved_state, TINY_CAP_MB)[0]  # 4 buckets of at most 16 elements
    msg = w2.run(_load_error, saved, 1, 3, None)[0]  # the same model, unbucketed
    assert "flats[0].buckets: checkpoint 4 (bucket_cap_mb=6.1" in msg
    assert "here 1 (bucket_cap_mb=None" in msg
    assert "first difference at bucket 0: checkpoint (0, 16), here (0, 58)" in msg


def test_load_state_dict_reads_version_2_only(world):
    """Version 1 (before bucketing) is refused, even where its layout would match (unbucketed, the
    same model), in one line that names the field, what is read and what to do."""
    w2 = world(2)
    v1 = w2.run(_saved_state, None, True)[0]
    for cap_mb in (None, TINY_CAP_MB):
        msg = w2.run(_load_error, v1, 1, 3, cap_mb)[0]
        assert msg == (
            "Zero1Optimizer.load_state_dict: version: checkpoint 1 (before bucketing), this optimizer reads 2 "
            "only: start the optimizer state fresh, or load it with the neuron_ckpt version that wrote it"
        )
    v2 = w2.run(_saved_state, None)[0]
    msg = w2.run(_load_error, {**v2, "version": 3}, 1, 3, None)[0]
    assert msg.startswith("Zero1Optimizer.load_state_dict: version: checkpoint 3, this optimizer reads 2 only: ")
    assert "\n" not in msg


# ---- dtypes, frozen and unused parameters, LR scheduler ------------------------------------


def _bf16_trains() -> tuple[list[torch.dtype], list[torch.dtype], float, float, bool]:
    ps = nc.initialize_model_parallel(1)
    model = _mlp(torch.bfloat16)
    opt = Zero1Optimizer(model.parameters(), lr=1e-1)
    x, y = _data(0, ps.dp_rank, batch=16)
    first = float(_mse(model, x, y))
    for _ in range(10):
        opt.zero_grad()
        _mse(model, x, y).backward()
        opt.step()
    last = float(_mse(model, x, y))
    gathered = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    (bucket,) = opt.buckets  # 57 elements: one bucket under the default cap
    mine = gathered[ps.dp_rank * bucket.master.numel() :][: bucket.master.numel()]
    in_sync = torch.equal(mine, bucket.master[: mine.numel()].to(torch.bfloat16))
    return [b.master.dtype for b in opt.buckets], [p.dtype for p in model.parameters()], first, last, in_sync


def test_bf16_params_keep_fp32_master_weights(world):
    for masters, params, first, last, in_sync in world(2).run(_bf16_trains):
        assert masters == [torch.float32]
        assert set(params) == {torch.bfloat16}
        assert last < first
        assert in_sync


def _frozen_and_unused() -> tuple[bool, bool, float, float, int]:
    ps = nc.initialize_model_parallel(1)
    torch.manual_seed(0)
    used, unused, frozen = nn.Linear(5, 3), nn.Linear(5, 3), nn.Linear(5, 3)
    frozen.requires_grad_(False)
    params = [*used.parameters(), *unused.parameters(), *frozen.parameters()]
    frozen_before = [p.clone() for p in frozen.parameters()]
    unused_before = [p.clone() for p in unused.parameters()]
    opt = Zero1Optimizer(params, lr=LR, weight_decay=0.0)
    x, y = _data(0, ps.dp_rank)
    (used(x) + frozen(x) - y).pow(2).mean().backward()
    norm = float(opt.step())
    frozen_same = all(torch.equal(a, b) for a, b in zip(frozen_before, frozen.parameters()))
    unused_same = all(torch.equal(a, b) for a, b in zip(unused_before, unused.parameters()))
    n_flat = sum(len(f["shapes"]) for f in opt.state_dict()["meta"]["flats"])
    return frozen_same, unused_same, norm, _local_norm(used), n_flat


def _local_norm(module: nn.Module) -> float:
    """Norm of the DP-mean gradient of ``module`` (world size 2, TP 1)."""
    g = torch.cat([p.grad.reshape(-1) for p in module.parameters()]) / 2
    g = all_reduce(g, nc.get_parallel_state().dp)
    return float(g.norm())


def test_frozen_skipped_and_missing_grad_counts_as_zero(world):
    for frozen_same, unused_same, norm, ref, n_flat in world(2).run(_frozen_and_unused):
        assert frozen_same and unused_same  # zero grad, no weight decay: Adam moves it by 0
        assert n_flat == 4  # used + unused weight and bias; frozen ones are not flattened
        assert norm == pytest.approx(ref, rel=1e-5)


def _scheduler_sets_lr() -> list[float]:
    ps = nc.initialize_model_parallel(1)
    model = _mlp()
    opt = Zero1Optimizer(model.parameters(), lr=1.0)
    assert isinstance(opt, torch.optim.Optimizer)  # what torch's schedulers require
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.1 * (step + 1))
    lrs = []
    for step in range(3):
        lrs.append(opt.inner.param_groups[0]["lr"])
        _mse(model, *_data(step, ps.dp_rank)).backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    return lrs


def test_lambda_lr_scheduler_drives_the_inner_optimizer(world):
    for lrs in world(2).run(_scheduler_sets_lr):
        assert lrs == pytest.approx([0.1, 0.2, 0.3])


def _scheduler_survives_load_state_dict() -> tuple[list[float], bool]:
    ps = nc.initialize_model_parallel(1)
    torch.manual_seed(0)
    model = _mlp()
    opt = Zero1Optimizer(model.parameters(), torch.optim.AdamW, lr=1.0)
    _mse(model, *_data(0, ps.dp_rank)).backward()
    opt.step()
    saved = copy.deepcopy(opt.state_dict())
    opt.load_state_dict(saved)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5 ** (step + 1))
    lrs = []
    for _ in range(2):
        sched.step()
        lrs.append(opt.inner.param_groups[0]["lr"])
    shared = opt.param_groups is opt.inner.param_groups and opt.state is opt.inner.state
    return lrs, shared and opt.defaults is opt.inner.defaults


def test_scheduler_still_drives_the_inner_optimizer_after_load_state_dict(world):
    """torch's load_state_dict replaces param_groups; the wrapper's are the inner's, read through."""
    for lrs, shared in world(2).run(_scheduler_survives_load_state_dict):
        assert lrs == pytest.approx([0.25, 0.125])
        assert shared


# ---- fp32 gradient accumulation of bf16 parameters -----------------------------------------

MICRO = 64  # micro-batches per step, as in 1/4 of the tutorial's global batch 1024 on one node


def _wide_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 8)).to(torch.bfloat16)


def _micro(i: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 * rank + i)
    return torch.randn(8, 64, generator=g).to(torch.bfloat16), torch.randn(8, 8, generator=g)


def _flat64(tensors) -> torch.Tensor:
    return torch.cat([t.detach().double().reshape(-1) for t in tensors])


def _accumulation_errors() -> dict:
    """64 micro-batches (loss scaled 1/64, as the training loop does) three ways on one rank:
    Zero1Optimizer's fp32 buffers, torch's own accumulation into bf16 ``p.grad``, and the exact
    (fp64) sum of the very same bf16 micro-batch gradients, collected one at a time. The
    reference isolates accumulation: the bf16 forward/backward itself differs from an fp32 model
    (reported as ``bf16_compute``), identically with and without fp32 accumulation."""
    ps = nc.initialize_model_parallel(1)
    model, plain, fp32 = _wide_mlp(), _wide_mlp(), _wide_mlp().float()
    opt = Zero1Optimizer(model.parameters(), lr=LR)  # bf16 parameters: accumulate_fp32 is on
    exact = [torch.zeros(p.shape, dtype=torch.float64) for p in model.parameters()]
    bf16_sum = [torch.zeros(p.shape, dtype=torch.bfloat16) for p in model.parameters()]
    grads_after_backward = []
    for i in range(MICRO):
        x, y = _micro(i, ps.dp_rank)
        ((model(x).float() - y).pow(2).mean() / MICRO).backward()
        grads_after_backward += [p.grad for p in model.parameters()]
        ((plain(x).float() - y).pow(2).mean() / MICRO).backward()
        for e, s, p in zip(exact, bf16_sum, plain.parameters()):
            e += p.grad.double()
            s += p.grad  # what torch's AccumulateGrad does to a bf16 .grad
            p.grad = None
        ((fp32(x.float()) - y).pow(2).mean() / MICRO).backward()
    ref = _flat64(exact)
    accumulated = _flat64(opt.accumulated_grad(p) for p in model.parameters())
    # The step reduces the fp32 buffers: its norm is that of the DP mean of the exact sums.
    mean = all_reduce(ref, nc.get_parallel_state().dp) / ps.dp_size
    norm = float(opt.step())
    opt.zero_grad()
    return {
        "fp32_accum": rel_norm(accumulated, ref),
        "bf16_accum": rel_norm(_flat64(bf16_sum), ref),
        "bf16_compute": rel_norm(ref, _flat64(p.grad for p in fp32.parameters())),
        "grads_none": all(g is None for g in grads_after_backward),
        "norm_rel": abs(norm - mean.norm().item()) / mean.norm().item(),
        "zeroed": all(not opt.accumulated_grad(p).any() for p in model.parameters()),
    }


def test_fp32_accumulation_of_64_bf16_micro_batches(world):
    for rank, r in enumerate(world(2).run(_accumulation_errors)):
        print(
            f"\nrank {rank}: relative error of the gradient summed over {MICRO} bf16 micro-batches: "
            f"fp32 accumulation {r['fp32_accum']:.2e}, bf16 accumulation {r['bf16_accum']:.2e} "
            f"(bf16 forward/backward against an fp32 model: {r['bf16_compute']:.2e})"
        )
        # fp32 buffers: 64 fp32 roundings of a running sum, ~sqrt(64) * 6e-8 = 5e-7 at worst;
        # 1e-3 is the bound asked for, with three orders of margin.
        assert r["fp32_accum"] < 1e-3
        # bf16 accumulation rounds every partial sum to 8 bits (2^-9 = 2e-3 relative each):
        # measured ~9e-3 here. Requiring 5e-3 shows the test tells the two apart.
        assert r["bf16_accum"] > 5e-3
        assert r["grads_none"]  # the hook leaves no bf16 gradient behind
        assert r["norm_rel"] < 1e-5  # reduced in fp32: only summation order differs
        assert r["zeroed"]  # zero_grad zeroes the fp32 buffers


# ---- options, hooks -----------------------------------------------------------------------


def _one_rank() -> ParallelState:
    one = Group(process_group=None, ranks=(0,), replica_groups=((0,),), rank=0)
    return ParallelState(tp=one, dp=one)


@pytest.mark.parametrize(
    "options, message",
    [
        (
            {"bucket_cap_mb": 0},
            "bucket_cap_mb must be None (no cap), 'auto' (the backend's) or a number > 0 (MiB), got 0",
        ),
        ({"bucket_cap_mb": "128"}, "bucket_cap_mb must be None"),
        ({"bucket_cap_mb": True}, "bucket_cap_mb must be None"),
        (
            {"bucket_cap_mb": 2 / 2**20},
            "bucket_cap_mb=1.9073486328125e-06 holds 0 torch.float32 elements, fewer than dp",
        ),
        ({"accumulate_fp32": "auto"}, "accumulate_fp32 must be None (auto: for bf16/fp16 parameters), True or False"),
    ],
)
def test_options_are_validated(options, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        Zero1Optimizer(_mlp().parameters(), parallel_state=_one_rank(), **options)


def test_fp32_accumulation_is_auto_for_16_bit_params_and_hooks_are_exclusive():
    ps = _one_rank()
    fp32, bf16 = _mlp(), _mlp(torch.bfloat16)
    for model, kept in ((fp32, True), (bf16, False)):
        opt = Zero1Optimizer(model.parameters(), parallel_state=ps)
        _mse(model, *_data(0, 0)).backward()
        assert all((p.grad is not None) == kept for p in model.parameters())
    # bf16's optimizer above is still alive: a second one must not also hook its parameters.
    with pytest.raises(ValueError, match="already accumulates into another Zero1Optimizer"):
        Zero1Optimizer(bf16.parameters(), parallel_state=ps)
    opt.remove_hooks()
    again = Zero1Optimizer(bf16.parameters(), parallel_state=ps)
    opt.zero_grad()
    _mse(bf16, *_data(0, 0)).backward()
    assert all(p.grad is None for p in bf16.parameters()) and again.accumulated_grad(bf16[0].weight).any()
    # Dropping an optimizer frees its fp32 buffer and removes its hooks, while the model lives on:
    # the next backward leaves p.grad in place, and a new optimizer may take the parameters.
    buffer = weakref.ref(again.accumulated_grad(bf16[0].weight)._base)  # the view's base: the buffer
    del again
    assert buffer() is None  # at once: nothing (no hook) keeps the optimizer or its buffer alive
    _mse(bf16, *_data(0, 0)).backward()
    assert all(p.grad is not None for p in bf16.parameters())
    Zero1Optimizer(bf16.parameters(), parallel_state=ps)


def _shared_parameter_slots() -> tuple[list[int], int, int, str]:
    nc.initialize_model_parallel(1)
    shared, other = nn.Parameter(torch.ones(4, 2)), nn.Parameter(torch.ones(3))
    opt = Zero1Optimizer([{"params": [shared, other, shared]}], lr=LR)
    same = Zero1Optimizer([{"params": [shared], "weight_decay": 0.1}, {"params": [shared, other], "weight_decay": 0.1}],
                          lr=LR)  # fmt: skip
    try:
        Zero1Optimizer([{"params": [shared], "weight_decay": 0.1}, {"params": [shared], "weight_decay": 0.0}], lr=LR)
        error = ""
    except ValueError as e:
        error = str(e)
    shapes = [f["shapes"] for f in opt.state_dict()["meta"]["flats"]]  # one flat per (group, dtype)
    same_slots = sum(len(f["shapes"]) for f in same.state_dict()["meta"]["flats"])
    return [len(s) for s in shapes], sum(math.prod(t) for s in shapes for t in s), same_slots, error


def test_a_shared_parameter_gets_one_slot_and_conflicting_groups_are_refused(world):
    """A tied embedding / LM head collected module by module is listed twice: one slot. In two
    groups with different options it is refused (which weight decay would it get?)."""
    slots, numel, same, error = world(1).run(_shared_parameter_slots)[0]
    assert slots == [2] and numel == 11 and same == 2
    assert re.search(r"shape \(4, 2\).*two param groups with different options", error) and "\n" not in error
