"""The gloo forms of the collectives: the same results as gloo's own reduce-scatter and all-gather,
built from the calls the module docstring names, on buffers that are never handed out while in use.

Exactness: the all-gather only moves values, so it equals ``all_gather_into_tensor`` bit for bit.
The reduce-scatter adds each rank's chunks in rank order: bit for bit ``reduce_scatter_tensor``
at two ranks (a + b = b + a in IEEE arithmetic) and bit for bit the rank-order sum at four, where
gloo's own may add in another order (a few ulps: checked to 1e-6 relative).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist

import neuron_ckpt as nc
from neuron_ckpt.distributed import collectives as C
from neuron_ckpt.distributed.parallel_state import Group

from .helpers import patched


def _inputs(world: int, shape: tuple[int, ...], dtype: torch.dtype) -> list[torch.Tensor]:
    return [torch.randn(shape, generator=torch.Generator().manual_seed(10 + r)).to(dtype) for r in range(world)]


def _calls(fn):
    """``fn()``'s result and the torch.distributed collectives it called, by name."""
    names = ["all_to_all_single", "broadcast", "reduce", "all_reduce", "all_gather_into_tensor",
             "reduce_scatter_tensor", "all_gather_single", "reduce_scatter_single"]  # fmt: skip
    called: list[str] = []
    saved = {n: getattr(dist, n) for n in names if hasattr(dist, n)}
    aliases = {a: getattr(C, a) for a in ("_all_gather_single", "_reduce_scatter_single")}

    def counting(name, f):
        def wrapped(*args, **kwargs):
            called.append(name)
            return f(*args, **kwargs)

        return wrapped

    with contextlib.ExitStack() as stack:
        for n, f in saved.items():
            stack.enter_context(patched(dist, n, counting(n, f)))
        for a, f in aliases.items():
            stack.enter_context(patched(C, a, counting(a, f)))
        out = fn()
    return out, called


def _gloo_forms(dtype: torch.dtype) -> dict[str, object]:
    st = nc.initialize_model_parallel(dist.get_world_size())
    g, r, p = st.tp, st.tp_rank, st.tp_size
    xs = _inputs(p, (4 * p, 3, 5), dtype)
    x = xs[r]
    ok: dict[str, object] = {"uses_gloo_forms": C.uses_gloo_forms(x, g)}

    # reduce-scatter, dims 0 and 1, against gloo's reduce_scatter_tensor and the rank-order sum
    rank_order = xs[0].clone()
    for t in xs[1:]:
        rank_order += t
    got, called = _calls(lambda: C.reduce_scatter(x, 0, g))
    theirs = torch.empty_like(got)
    C._reduce_scatter_single(theirs, x.contiguous(), group=g.process_group)
    ok["reduce_scatter calls"] = called
    ok["reduce_scatter = rank-order sum"] = torch.equal(got, rank_order.chunk(p, 0)[r])
    ok["reduce_scatter = gloo's"] = torch.equal(got, theirs)
    diff = (got.double() - theirs.double()).abs().max()
    ok["reduce_scatter vs gloo's, rel"] = (diff / theirs.double().abs().max()).item()
    y = torch.cat(xs, 1)  # dim 1 of size 3p: every rank's same input, so the sum is p * y's chunk
    y_sum = sum([y] * p, torch.zeros_like(y))
    ok["reduce_scatter dim 1"] = torch.equal(C.reduce_scatter(y, 1, g), y_sum.chunk(p, 1)[r])

    # all-gather, dims 0 and 2, against gloo's all_gather_into_tensor
    got, called = _calls(lambda: C.all_gather(x, 0, g))
    theirs = torch.empty_like(got)
    C._all_gather_single(theirs, x.contiguous(), group=g.process_group)
    ok["all_gather calls"] = called
    ok["all_gather = gloo's"] = torch.equal(got, theirs) and torch.equal(got, torch.cat(xs, 0))
    gathered = C.all_gather(x.transpose(0, 2), 2, g)
    ok["all_gather dim 2, non-contiguous"] = torch.equal(gathered, torch.cat(xs, 0).transpose(0, 2))
    return ok


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("p", [2, 4])
def test_gloo_forms_equal_gloos_collectives(world, p, dtype):
    for rank, ok in enumerate(world(p).run(_gloo_forms, dtype)):
        assert ok.pop("uses_gloo_forms") is True
        assert ok.pop("reduce_scatter calls") == ["all_to_all_single"]
        assert ok.pop("all_gather calls") == ["broadcast"] * p
        rel = ok.pop("reduce_scatter vs gloo's, rel")
        same_order = ok.pop("reduce_scatter = gloo's")
        if p == 2:
            assert same_order and rel == 0.0
        else:
            assert rel < (1e-6 if dtype == torch.float32 else 1e-2)
        assert all(ok.values()), f"rank {rank}: {[k for k, v in ok.items() if not v]}"


def _in_flight() -> dict[str, bool]:
    """ZeRO-1's pattern: several collectives of one shape started before any is waited on, and
    all-gather results held while more are started: each must still be right."""
    st = nc.initialize_model_parallel(2)
    g, r = st.tp, st.tp_rank
    inputs = [torch.full((64,), float(10 * i + r)) for i in range(6)]
    scattering = [C.reduce_scatter_start(t, g) for t in inputs]
    gathering = [C.all_gather_start(t, g) for t in inputs]
    scattered = [s.wait() for s in scattering]
    gathered = [a.wait() for a in gathering]
    more = [C.all_gather_start(t + 100, g).wait() for t in inputs]  # while `gathered` is held
    ok = {}
    for i in range(6):
        ok[f"reduce_scatter {i}"] = torch.equal(scattered[i], torch.full((32,), float(20 * i + 1)))
        both = torch.cat([torch.full((64,), float(10 * i)), torch.full((64,), float(10 * i + 1))])
        ok[f"all_gather {i}"] = torch.equal(gathered[i], both)
        ok[f"all_gather {i} again"] = torch.equal(more[i], both + 100)
    storages = {t.untyped_storage().data_ptr() for t in gathered + more}
    ok["held results never share a buffer"] = len(storages) == 12
    return ok


def test_collectives_in_flight_and_held_results_stay_right(world):
    for rank, ok in enumerate(world(2).run(_in_flight)):
        assert all(ok.values()), f"rank {rank}: {[k for k, v in ok.items() if not v]}"


def test_buffers_are_reused_only_when_nothing_refers_to_them():
    pool, cpu = C._Buffers(per_key=2, keys=2), torch.device("cpu")
    a = pool.take((4, 2), torch.float32, cpu)
    b = pool.take((4, 2), torch.float32, cpu)
    assert a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
    view, a_ptr = a[1:].t(), a.untyped_storage().data_ptr()
    del a
    c = pool.take((4, 2), torch.float32, cpu)  # a's view still lives: a third buffer, not kept (per_key=2)
    assert c.untyped_storage().data_ptr() not in (a_ptr, b.untyped_storage().data_ptr())
    del view
    assert pool.take((4, 2), torch.float32, cpu).untyped_storage().data_ptr() == a_ptr  # free again
    assert pool.take((8,), torch.float32, cpu).shape == (8,)  # another key
    pool.take((2,), torch.bfloat16, cpu)  # a third key: the least recently used, (4, 2), goes
    assert ((4, 2), torch.float32, cpu) not in pool._kept and len(pool._kept) == 2


def test_default_bucket_cap_per_backend(monkeypatch):
    no_pg = Group(None, (0,), ((0,),), 0)
    assert C.default_bucket_cap_mb(no_pg) == C.OTHER_BUCKET_CAP_MB == 128.0  # no backend
    monkeypatch.setattr(C, "backend", lambda group: "nccl")
    assert C.default_bucket_cap_mb(no_pg) == 128.0  # not measured: unchanged
    monkeypatch.setattr(C, "backend", lambda group: "gloo")
    assert C.default_bucket_cap_mb(no_pg) == 8.0
    monkeypatch.undo()
    monkeypatch.setattr(C.runtime, "is_xla", lambda: True)
    assert C.backend(no_pg) == "xla"
    assert C.default_bucket_cap_mb(no_pg) == 128.0  # Neuron: NaN above ~140 MB


def _gloo_default_cap() -> tuple[str | None, float, bool]:
    st = nc.initialize_model_parallel(1)
    return C.backend(st.dp), C.default_bucket_cap_mb(st.dp), C.uses_gloo_forms(torch.zeros(2), st.dp)


def test_a_gloo_group_gets_the_gloo_cap_and_forms(world):
    assert world(2).run(_gloo_default_cap) == [("gloo", 8.0, True)] * 2
