"""ZeRO-1's bucket cap by default: the DP group's backend's (8 MiB on gloo, 128 on XLA), recorded
as a number; and a state saved at another cap (the 128 MiB every backend had before, another
backend's default) loads into a default-cap optimizer, which takes that cap, and continues bit for
bit as the run that saved it would have. A version-1 state (unbucketed, from development versions
before bucketing) is refused, not adopted.

Checks run on gloo worker processes. To make the default cut the tiny model into several buckets,
some set the gloo default to 64 bytes inside the worker (restored after).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

import neuron_ckpt as nc
from neuron_ckpt.distributed import collectives as C
from neuron_ckpt.optim import Zero1Optimizer

from .test_zero1 import CLIP, LR, TINY_CAP_MB, WD, _as_v1, _mlp, _saved_after, _train_zero1


@contextlib.contextmanager
def _gloo_default(cap_mb: float):
    saved = dict(C.DEFAULT_BUCKET_CAP_MB)
    C.DEFAULT_BUCKET_CAP_MB["gloo"] = cap_mb
    try:
        yield
    finally:
        C.DEFAULT_BUCKET_CAP_MB.clear()
        C.DEFAULT_BUCKET_CAP_MB.update(saved)


def _caps() -> dict[str, object]:
    nc.initialize_model_parallel(1)
    out = {}
    for name, options in {"default": {}, "auto": {"bucket_cap_mb": "auto"}, "128": {"bucket_cap_mb": 128},
                          "None": {"bucket_cap_mb": None}}.items():  # fmt: skip
        opt = Zero1Optimizer(_mlp().parameters(), lr=LR, **options)
        out[name] = (opt.bucket_cap_mb, opt.state_dict()["meta"]["bucket_cap_mb"])
    return out


def test_default_cap_is_the_backends_and_is_saved_as_a_number(world):
    for caps in world(2).run(_caps):
        assert caps == {"default": (8.0, 8.0), "auto": (8.0, 8.0), "128": (128, 128), "None": (None, None)}


def _resume_at_saved_cap(dtype: torch.dtype, saved_cap: float | None) -> dict[str, object]:
    """Train 5 steps at ``saved_cap``; and 3 steps at it, save, load into a default-cap optimizer
    (the gloo default set to 64 bytes: several buckets) and 2 more steps."""
    ps = nc.initialize_model_parallel(1)
    options = {"grad_clip_norm": CLIP, "lr": LR, "weight_decay": WD}
    straight = _mlp(dtype)
    opt = Zero1Optimizer(straight.parameters(), bucket_cap_mb=saved_cap, **options)
    _train_zero1(straight, opt, range(5), ps.dp_rank)

    ckpt = _saved_after(3, dtype, ps, bucket_cap_mb=saved_cap, **options)

    resumed = _mlp(dtype)
    resumed.load_state_dict(ckpt["model"])
    with _gloo_default(TINY_CAP_MB):
        opt = Zero1Optimizer(resumed.parameters(), **options)
    before = (opt.bucket_cap_mb, len(opt.buckets))
    opt.load_state_dict(ckpt["optim"])
    after = (opt.bucket_cap_mb, len(opt.buckets))
    _train_zero1(resumed, opt, range(3, 5), ps.dp_rank)
    return {
        "before": before,
        "after": after,
        "inner params are the masters": [id(p) for g in opt.param_groups for p in g["params"]]
        == [id(b.master) for b in opt.buckets],
        "identical": all(torch.equal(a, b) for a, b in zip(straight.parameters(), resumed.parameters())),
    }


def test_a_state_saved_at_another_cap_loads_into_the_default_and_continues_identically(world):
    w2 = world(2)
    # 128 MiB (the old default everywhere, Neuron's now): one bucket for this model, 4 here.
    for dtype in (torch.float32, torch.bfloat16):  # bf16: fp32 accumulation hooks on the new flats
        for r in w2.run(_resume_at_saved_cap, dtype, 128.0):
            assert r == {"before": (TINY_CAP_MB, 4), "after": (128.0, 1), "inner params are the masters": True,
                         "identical": True}, dtype  # fmt: skip
    # Unbucketed (None) is a cap too.
    for r in w2.run(_resume_at_saved_cap, torch.float32, None):
        assert r["before"] == (TINY_CAP_MB, 4) and r["after"] == (None, 1) and r["identical"]


def _other_state_error(v1: bool) -> dict[str, object]:
    """Load a state of another model (the last layer 6->4), or a version-1 state of this one (an
    unbucketed layout, which a state at cap None would be adopted for), into a default-cap
    optimizer: the error, and whether the optimizer kept its own layout."""
    nc.initialize_model_parallel(1)
    opt = Zero1Optimizer(_mlp().parameters(), lr=LR, bucket_cap_mb=None if v1 else 128)
    saved = _as_v1(opt) if v1 else opt.state_dict()
    torch.manual_seed(0)
    other = _mlp() if v1 else nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 4))
    with _gloo_default(TINY_CAP_MB):
        opt = Zero1Optimizer(other.parameters(), lr=LR)
    masters = [b.master for b in opt.buckets]
    try:
        opt.load_state_dict(saved)
        message = "no error"
    except ValueError as e:
        message = str(e)
    return {
        "message": message,
        "layout kept": opt.bucket_cap_mb == TINY_CAP_MB
        and len(opt.buckets) == len(masters)
        and all(b.master is m for b, m in zip(opt.buckets, masters)),
    }


def test_a_state_of_another_model_is_still_refused_with_the_default_cap(world):
    for r in world(2).run(_other_state_error, False):
        assert "parameter 2 shape: checkpoint (3, 6), here (4, 6)" in r["message"]
        assert r["layout kept"]


def test_a_version_1_state_is_refused_not_adopted_with_the_default_cap(world):
    for r in world(2).run(_other_state_error, True):
        assert r["message"].startswith("Zero1Optimizer.load_state_dict: version: checkpoint 1 (before bucketing), ")
        assert r["layout kept"]
