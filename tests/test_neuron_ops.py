"""Neuron-friendly ops: a finite causal-mask value and a MAX all-reduce in place of a last-dim gather.

Mask: ``CoreAttention`` (explicit) fills the scores above the diagonal with
``torch.finfo(dtype).min`` instead of ``-inf``. Two references, forward and backward (output and
the gradients of q, k and v of ``sum(out * r)``), with and without ``softmax_in_fp32``, MHA and GQA:

* the same module with the mask value patched back to ``-inf`` (the previous code): equal
  bit for bit in fp32, bf16 and fp16. Both ways every masked ``exp`` is exactly 0 and
  ``masked_fill`` passes no gradient to masked scores; every other op is the same op on the same
  bits, so any difference at all would mean the finite value leaks probability.
* an independent plain-torch ``-inf`` reference (``masked_fill(mask, -inf)``, softmax, keys
  and values repeated for GQA, scores divided after the matmul) and
  ``F.scaled_dot_product_attention(is_causal=True)``, in the same dtype. These round
  differently (q scaled before the matmul, other summation orders), so they get tolerances on
  the relative error ``||a - b|| / ||b||``:

  - fp32: ``1e-5``. Unit roundoff 6e-8; the measured difference is 1.5e-7 (plain) and 2.6e-7
    (sdpa), a few ulps from summation order. 1e-5 leaves 40x margin; a missing mask gives 0.7,
    a mask of -5 gives 0.1 and even a mask of -10 (leaking ``e^-10`` per position) gives 1e-3.
  - bf16: ``2e-2``. bf16 keeps an 8-bit significand (7 stored + 1 implicit): unit roundoff
    ``2^-8 = 3.9e-3``. Each side rounds its inputs, scores, probabilities and outputs to bf16, so
    two correct bf16 computations differ by one to two units (measured 4.4e-3 to 5.5e-3, the
    same as each one's own error against fp64). ``2e-2`` is ~5 units: it catches a missing
    (0.7) or weak (-5: 0.1) mask; leaks below bf16's resolution are the bitwise test's job.

MAX all-reduce: ``collectives.all_reduce(..., op="max")`` on a 4-rank gloo world (whole world and
TP groups of 2), a bad op name raises, and vocab-parallel cross entropy computes without any
all-gather (``all_gather`` is made to raise) and equals ``F.cross_entropy`` at t = 2 and 4, also
with logits large enough that an unstabilised or wrongly stabilised softmax overflows.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import neuron_ckpt as nc
import neuron_ckpt.parallel.attention as attention
from neuron_ckpt.distributed import collectives as C
from neuron_ckpt.distributed.parallel_state import Group
from neuron_ckpt.parallel import CoreAttention, vocab_parallel_cross_entropy

from .helpers import patched, rel_norm

S, B, D = 16, 2, 8
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _inputs(heads: int, kv_heads: int, dtype: torch.dtype, scale: float = 1.0, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(S, B, n * D, generator=g) for n in (heads, kv_heads, kv_heads))
    r = torch.randn(S, B, heads * D, generator=g)
    return [(x * s).to(dtype) for x, s in ((q, scale), (k, 1.0), (v, 1.0))], r.to(dtype)


def _forward_backward(fn, qkv, r):
    xs = [x.detach().clone().requires_grad_() for x in qkv]
    out = fn(*xs)
    (out * r).sum().backward()
    return [out.detach()] + [x.grad for x in xs]


def _plain_inf(heads: int, kv_heads: int, softmax_in_fp32: bool):
    """Causal attention written the obvious way, masked with -inf."""

    def fn(q, k, v):
        s, b = q.shape[:2]
        rep = heads // kv_heads
        q = q.view(s, b, heads, D).permute(1, 2, 0, 3)
        k = k.view(s, b, kv_heads, D).permute(1, 2, 0, 3).repeat_interleave(rep, 1)
        v = v.view(s, b, kv_heads, D).permute(1, 2, 0, 3).repeat_interleave(rep, 1)
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(D)
        mask = torch.ones(s, s, dtype=torch.bool).triu(1)
        scores = scores.masked_fill(mask, float("-inf"))
        if softmax_in_fp32:
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        else:
            probs = torch.softmax(scores, dim=-1)
        return torch.matmul(probs, v).permute(2, 0, 1, 3).reshape(s, b, heads * D)

    return fn


def _sdpa(heads: int, kv_heads: int):
    def fn(q, k, v):
        s, b = q.shape[:2]
        q = q.view(s, b, heads, D).permute(1, 2, 0, 3)
        k = k.view(s, b, kv_heads, D).permute(1, 2, 0, 3)
        v = v.view(s, b, kv_heads, D).permute(1, 2, 0, 3)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=heads != kv_heads)
        return out.permute(2, 0, 1, 3).reshape(s, b, heads * D)

    return fn


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_mask_value_is_finite_dtype_min(dtype):
    value = attention.masked_score(dtype)
    assert math.isfinite(value)
    assert value == torch.finfo(dtype).min
    # Representable in the dtype itself (masked_fill would otherwise round it to -inf) and in fp32,
    # where the softmax_in_fp32 path sees it.
    assert torch.tensor(value, dtype=dtype).isfinite().item()
    assert torch.tensor(value, dtype=dtype).float().isfinite().item()


@pytest.mark.parametrize("scale", [1.0, 300.0, -300.0], ids=["normal", "large_positive_max", "negative_scores"])
@pytest.mark.parametrize("softmax_in_fp32", [True, False])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_finite_mask_is_bitwise_the_inf_mask(monkeypatch, dtype, heads, kv_heads, softmax_in_fp32, scale):
    # scale=+-300: scores up to ~1e3 in size, so (min - rowmax) is pushed to or past the dtype's
    # range (fp16 overflows it to -inf) and rows whose real scores are all far below 0.
    qkv, r = _inputs(heads, kv_heads, dtype, scale)
    attn = CoreAttention(heads, kv_heads, D, softmax_in_fp32=softmax_in_fp32, implementation="explicit")
    new = _forward_backward(attn, qkv, r)
    monkeypatch.setattr(attention, "masked_score", lambda dtype: float("-inf"))
    old = _forward_backward(attn, qkv, r)
    for name, a, b in zip(("out", "dq", "dk", "dv"), new, old):
        assert a.isfinite().all(), f"{name}: non-finite values with the finite mask"
        assert torch.equal(a, b), f"{name}: finite mask differs from -inf by {rel_norm(a, b):.2e}"
    # Row 0 attends to itself only: probability exactly 1, so out[0] is v[0] exactly (per kv group).
    v0 = qkv[2][0].view(B, kv_heads, 1, D).expand(B, kv_heads, heads // kv_heads, D).reshape(B, heads * D)
    assert torch.equal(new[0][0], v0)


@pytest.mark.parametrize("softmax_in_fp32", [True, False])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("dtype", list(TOL), ids=str)
def test_finite_mask_matches_plain_inf_references(dtype, heads, kv_heads, softmax_in_fp32):
    qkv, r = _inputs(heads, kv_heads, dtype)
    attn = CoreAttention(heads, kv_heads, D, softmax_in_fp32=softmax_in_fp32, implementation="explicit")
    got = _forward_backward(attn, qkv, r)
    for ref_name, fn in (
        ("plain -inf", _plain_inf(heads, kv_heads, softmax_in_fp32)),
        ("sdpa", _sdpa(heads, kv_heads)),
    ):
        ref = _forward_backward(fn, qkv, r)
        errs = {name: rel_norm(a, b) for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref)}
        bad = {k: f"{v:.2e}" for k, v in errs.items() if not v < TOL[dtype]}
        assert not bad, f"{dtype} vs {ref_name}: relative errors above {TOL[dtype]}: {bad}"


# --- all_reduce(op="max") and the cross entropy built on it ------------------------------------


def _rank_values(rank: int) -> torch.Tensor:
    # Each element's max sits on a different rank; negatives check MAX is not a max of |x|.
    base = torch.tensor([0.0, 1.0, -5.0, 2.5, -1.0, 7.0])
    return torch.stack([base.roll(rank), -base.roll(2 * rank) * (rank + 1)])


def _all_reduce_max(t: int) -> dict[str, torch.Tensor]:
    st = nc.initialize_model_parallel(t)
    rank = torch.distributed.get_rank()
    out = {}
    for name, group in (("tp", st.tp), ("dp", st.dp)):
        x = _rank_values(rank)
        out[f"{name} max"] = C.all_reduce(x, group, op="max")
        out[f"{name} sum"] = C.all_reduce(x, group)  # default stays SUM
        out[f"{name} ranks"] = torch.tensor(group.ranks)
    return out


@pytest.mark.parametrize("t", [1, 2, 4])
def test_all_reduce_max_on_gloo(world, t):
    per_rank = world(4).run(_all_reduce_max, t)
    for rank, got in enumerate(per_rank):
        for name in ("tp", "dp"):
            ranks = got[f"{name} ranks"].tolist()
            assert rank in ranks
            vals = torch.stack([_rank_values(r) for r in ranks])
            assert torch.equal(got[f"{name} max"], vals.amax(0)), f"rank {rank} {name} group {ranks}"
            assert torch.equal(got[f"{name} sum"], vals.sum(0)), f"rank {rank} {name} group {ranks}"
    if t == 2:  # the max really crosses ranks (not the identity of a group of one)
        assert not torch.equal(per_rank[0]["tp max"], _rank_values(0))


@pytest.mark.parametrize("op", ["min", "SUM", "avg", None])
def test_all_reduce_rejects_unknown_op(op):
    # Checked before the group-of-one short cut, so a typo fails on one device too.
    one = Group(process_group=None, ranks=(0,), replica_groups=((0,),), rank=0)
    with pytest.raises(ValueError, match=r"'sum', 'max'") as info:
        C.all_reduce(torch.zeros(3), one, op=op)
    assert repr(op) in str(info.value)


def _cross_entropy_without_all_gather(t: int, scale: float) -> dict[str, float]:
    st = nc.initialize_model_parallel(t)

    def no_gather(*args, **kwargs):
        raise AssertionError("vocab_parallel_cross_entropy must not all-gather")

    with patched(C, "all_gather", no_gather):
        V = 24
        g = torch.Generator().manual_seed(11)
        logits = (scale * torch.randn(S, B, V, generator=g)).requires_grad_()
        target = torch.randint(0, V, (S, B), generator=g)
        target[1, 0] = -100
        ref = F.cross_entropy(logits.view(-1, V), target.view(-1), ignore_index=-100)
        ref.backward()
        local = logits.detach().chunk(t, dim=-1)[st.tp_rank].clone().requires_grad_()
        loss = vocab_parallel_cross_entropy(local, target, ignore_index=-100)
        loss.backward()
        return {
            "finite": float(loss.isfinite().item() and local.grad.isfinite().all().item()),
            "loss": rel_norm(loss, ref),
            "dlogits": rel_norm(local.grad, logits.grad.chunk(t, dim=-1)[st.tp_rank]),
        }


@pytest.mark.parametrize("scale", [3.0, 1e4], ids=["normal", "huge_logits"])
@pytest.mark.parametrize("t", [2, 4])
def test_cross_entropy_uses_no_all_gather(world, t, scale):
    # scale=1e4: exp of an unshifted logit (or of one shifted by a local, not global, max) would
    # overflow or mismatch; only the right global max gives F.cross_entropy's numbers.
    for rank, errs in enumerate(world(4).run(_cross_entropy_without_all_gather, t, scale)):
        assert errs.pop("finite") == 1.0, f"rank {rank}: non-finite loss or gradient"
        bad = {k: v for k, v in errs.items() if not v < 1e-5}
        assert not bad, f"rank {rank} at t={t}: relative errors above 1e-5: {bad}"
