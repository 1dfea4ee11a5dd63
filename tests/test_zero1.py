"""ZeRO-1 optimizer: the same training trajectory as dense AdamW + clip_grad_norm_, with 1/dp state.

Each check runs on gloo worker processes and computes its dense reference in the same worker.
"""

from __future__ import annotations

import copy

import io

import pytest
import torch
from torch import nn

import neuron_ckpt as nc
from neuron_ckpt.distributed.collectives import all_reduce
from neuron_ckpt.optim.zero1 import Zero1Optimizer
from neuron_ckpt.parallel.params import set_tensor_parallel_attributes

LR, WD = 1e-2, 0.1
CLIP = 0.05  # small enough that every step clips (norms here are ~0.3-1)


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


def _dp_matches_dense(steps: int, grouped: bool) -> tuple[float, list[float], list[float]]:
    ps = nc.initialize_model_parallel(1)
    model = _mlp()
    groups = _groups(model, grouped)
    opt = Zero1Optimizer(groups, torch.optim.AdamW, grad_clip_norm=CLIP, lr=LR, weight_decay=WD)
    norms = _train_zero1(model, opt, range(steps), ps.dp_rank)

    ref = _mlp()
    ref_opt = torch.optim.AdamW(_groups(ref, grouped), lr=LR, weight_decay=WD)
    ref_norms = []
    for step in range(steps):
        ref_opt.zero_grad()
        batches = [_data(step, r) for r in range(ps.dp_size)]
        x, y = (torch.cat(t) for t in zip(*batches))
        _mse(ref, x, y).backward()
        ref_norms.append(float(nn.utils.clip_grad_norm_(ref.parameters(), CLIP)))
        ref_opt.step()
    err = max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters()))
    return err, norms, ref_norms


@pytest.mark.parametrize("grouped", [False, True], ids=["one_group", "no_decay_biases"])
def test_dp2_matches_dense_adamw_with_clipping(world, grouped):
    for err, norms, ref_norms in world(2).run(_dp_matches_dense, 5, grouped):
        assert err < 1e-6
        assert norms == pytest.approx(ref_norms, rel=1e-5)
        assert min(norms) > CLIP  # clipping happened every step


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


def _tp_dp_matches_dense(steps: int) -> tuple[float, list[float], list[float]]:
    ps = nc.initialize_model_parallel(2)
    w_full, b_full = _tp_full_params()
    w = nn.Parameter(w_full.chunk(ps.tp_size, 0)[ps.tp_rank].clone())
    set_tensor_parallel_attributes(w, partition_dim=0)
    b = nn.Parameter(b_full.clone())
    opt = Zero1Optimizer([w, b], grad_clip_norm=CLIP, lr=LR, weight_decay=WD)

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


def test_tp2_dp2_grad_norm_and_steps_match_dense(world):
    for err, norms, ref_norms in world(4).run(_tp_dp_matches_dense, 5):
        assert norms == pytest.approx(ref_norms, rel=1e-5)
        assert min(norms) > CLIP
        assert err < 1e-6


# ---- state: 1/dp per rank, checkpoint round trip, mismatch errors ---------------------------

def _state_numel(opt: Zero1Optimizer) -> int:
    sd = opt.state_dict()
    inner = sum(t.numel() for s in sd["inner"]["state"].values() for t in s.values() if t.dim() > 0)
    return inner + sum(m.numel() for m in sd["master"])


def _state_is_sharded() -> tuple[int, int, int]:
    ps = nc.initialize_model_parallel(1)
    model = _mlp()
    opt = Zero1Optimizer(model.parameters(), lr=LR)
    _train_zero1(model, opt, range(1), ps.dp_rank)
    full = sum(p.numel() for p in model.parameters())
    return _state_numel(opt), full, ps.dp_size


def test_per_rank_state_is_one_dp_th(world):
    for numel, full, dp in world(2).run(_state_is_sharded):
        # master + exp_avg + exp_avg_sq, each ceil(full / dp)
        assert numel == 3 * -(-full // dp)


def _resume_matches(total: int, split: int, dtype: torch.dtype) -> bool:
    ps = nc.initialize_model_parallel(1)
    straight = _mlp(dtype)
    opt = Zero1Optimizer(straight.parameters(), grad_clip_norm=CLIP, lr=LR, weight_decay=WD)
    _train_zero1(straight, opt, range(total), ps.dp_rank)

    first = _mlp(dtype)
    opt = Zero1Optimizer(first.parameters(), grad_clip_norm=CLIP, lr=LR, weight_decay=WD)
    _train_zero1(first, opt, range(split), ps.dp_rank)
    buf = io.BytesIO()
    torch.save({"model": first.state_dict(), "optim": opt.state_dict()}, buf)

    buf.seek(0)
    ckpt = torch.load(buf)
    resumed = _mlp(dtype)
    resumed.load_state_dict(ckpt["model"])
    opt = Zero1Optimizer(resumed.parameters(), grad_clip_norm=CLIP, lr=LR, weight_decay=WD)
    opt.load_state_dict(ckpt["optim"])
    _train_zero1(resumed, opt, range(split, total), ps.dp_rank)
    return all(torch.equal(a, b) for a, b in zip(straight.parameters(), resumed.parameters()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_dict_round_trip_continues_identically(world, dtype):
    # bf16 also proves the fp32 master weights are restored (they differ from the bf16 params).
    assert all(world(2).run(_resume_matches, 5, 3, dtype))


def _saved_state() -> dict:
    ps = nc.initialize_model_parallel(1)
    model = _mlp()
    opt = Zero1Optimizer(model.parameters(), lr=LR)
    _train_zero1(model, opt, range(1), ps.dp_rank)
    return opt.state_dict()


def _load_error(sd: dict, tp: int, out_features: int) -> str:
    nc.initialize_model_parallel(tp)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, out_features))
    opt = Zero1Optimizer(model.parameters(), lr=LR)
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
    mine = gathered[ps.dp_rank * opt.shards[0].master.numel() :][: opt.shards[0].master.numel()]
    in_sync = torch.equal(mine, opt.shards[0].master[: mine.numel()].to(torch.bfloat16))
    return [s.master.dtype for s in opt.shards], [p.dtype for p in model.parameters()], first, last, in_sync


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
    n_flat = sum(len(s.params) for s in opt.shards)
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


def _scheduler_survives_load_state_dict() -> list[float]:
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
    return lrs


def test_scheduler_still_drives_the_inner_optimizer_after_load_state_dict(world):
    """torch's load_state_dict replaces param_groups; the wrapper must share the new list."""
    for lrs in world(2).run(_scheduler_survives_load_state_dict):
        assert lrs == pytest.approx([0.25, 0.125])
