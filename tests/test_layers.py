"""Every parallel layer equals a dense single-process reference built from torch.nn.functional.

Each check runs on a pooled 4-rank gloo world at t = 1, 2 and 4 (the remaining factor is data
parallel, so several TP groups run side by side). The full weight is rebuilt by all-gathering the
shards; the dense reference runs the same full input through ``torch.nn.functional`` on every
rank; outputs and the gradients of inputs and weights are compared shard by shard in fp32.

Tolerance: relative error (Frobenius norm of the difference over the norm of the reference)
below 1e-5. fp32 has a 6e-8 unit roundoff; the only differences are summation orders of matmuls
split over ranks (a few ulps per element), far below 1e-5 and far above what a wrong slice,
missing all-reduce or double-counted gradient would give (order 1).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import neuron_ckpt as nc
from neuron_ckpt.distributed import collectives as C
from neuron_ckpt.distributed.mappings import (
    gather_from_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
)
from neuron_ckpt.parallel import (
    ColumnParallelLinear,
    CoreAttention,
    LayerNorm,
    QKVParallelLinear,
    RMSNorm,
    RowParallelLinear,
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
)

from .helpers import rel_norm

TOL = 1e-5
TPS = (1, 2, 4)
S, B, H = 8, 2, 12  # sequence, micro-batch, hidden (all divisible by 4)


def chunk(x: torch.Tensor, dim: int, st) -> torch.Tensor:
    return x.chunk(st.tp_size, dim=dim)[st.tp_rank]


def full_input(*shape: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g)


def _column(t: int) -> dict[str, float]:
    st = nc.initialize_model_parallel(t)
    errs = {}
    for sp in (False, True):
        for gather in (False, True):
            torch.manual_seed(0)
            layer = ColumnParallelLinear(H, 16, bias=True, gather_output=gather, sequence_parallel=sp)
            with torch.no_grad():
                layer.bias.normal_()
            w = C.all_gather(layer.weight.detach(), 0, st.tp).requires_grad_()
            b = C.all_gather(layer.bias.detach(), 0, st.tp).requires_grad_()
            x = full_input(S, B, H).requires_grad_()
            r = full_input(S, B, 16, seed=2)
            yd = F.linear(x, w, b)
            (yd * r).sum().backward()

            xl = chunk(x.detach(), 0, st).clone() if sp else x.detach().clone()
            xl.requires_grad_()
            y = layer(xl)
            ref_y, ref_r = (yd, r) if gather else (chunk(yd, -1, st), chunk(r, -1, st))
            (y * ref_r).sum().backward()
            key = f"sp={sp},gather={gather}"
            errs[f"{key} y"] = rel_norm(y, ref_y)
            errs[f"{key} dx"] = rel_norm(xl.grad, chunk(x.grad, 0, st) if sp else x.grad)
            errs[f"{key} dw"] = rel_norm(layer.weight.grad, chunk(w.grad, 0, st))
            errs[f"{key} db"] = rel_norm(layer.bias.grad, chunk(b.grad, 0, st))
    return errs


def _row(t: int) -> dict[str, float]:
    st = nc.initialize_model_parallel(t)
    errs = {}
    for sp, parallel_in in ((False, False), (False, True), (True, True)):
        torch.manual_seed(0)
        layer = RowParallelLinear(16, H, bias=True, input_is_parallel=parallel_in, sequence_parallel=sp)
        with torch.no_grad():
            layer.bias.normal_()
        w = C.all_gather(layer.weight.detach(), 1, st.tp).requires_grad_()
        b = layer.bias.detach().clone().requires_grad_()
        x = full_input(S, B, 16).requires_grad_()
        r = full_input(S, B, H, seed=2)
        yd = F.linear(x, w, b)
        (yd * r).sum().backward()

        xl = (chunk(x.detach(), -1, st) if parallel_in else x.detach()).clone().requires_grad_()
        y = layer(xl)
        ref_y, ref_r = (chunk(yd, 0, st), chunk(r, 0, st)) if sp else (yd, r)
        (y * ref_r).sum().backward()
        key = f"sp={sp},input_is_parallel={parallel_in}"
        errs[f"{key} y"] = rel_norm(y, ref_y)
        errs[f"{key} dx"] = rel_norm(xl.grad, chunk(x.grad, -1, st) if parallel_in else x.grad)
        errs[f"{key} dw"] = rel_norm(layer.weight.grad, chunk(w.grad, 1, st))
        errs[f"{key} db"] = rel_norm(layer.bias.grad, b.grad)
    return errs


def _embedding(t: int) -> dict[str, float]:
    st = nc.initialize_model_parallel(t)
    errs = {}
    V = 20
    for sp in (False, True):
        torch.manual_seed(0)
        layer = VocabParallelEmbedding(V, H, sequence_parallel=sp)
        w = C.all_gather(layer.weight.detach(), 0, st.tp).requires_grad_()
        ids = torch.randint(0, V, (S, B), generator=torch.Generator().manual_seed(3))
        r = full_input(S, B, H, seed=2)
        yd = F.embedding(ids, w)
        (yd * r).sum().backward()
        y = layer(ids)
        ref_y, ref_r = (chunk(yd, 0, st), chunk(r, 0, st)) if sp else (yd, r)
        (y * ref_r).sum().backward()
        errs[f"sp={sp} y"] = rel_norm(y, ref_y)
        errs[f"sp={sp} dw"] = rel_norm(layer.weight.grad, chunk(w.grad, 0, st))
    return errs


def _cross_entropy(t: int) -> dict[str, float]:
    st = nc.initialize_model_parallel(t)
    errs = {}
    V = 20
    logits = (3 * full_input(S, B, V)).requires_grad_()
    target = torch.randint(0, V, (S, B), generator=torch.Generator().manual_seed(4))
    target[0, 0] = target[3, 1] = target[5, 0] = -100  # ignored labels
    for reduction in ("mean", "sum", "none"):
        logits.grad = None
        ref = F.cross_entropy(logits.view(-1, V), target.view(-1), ignore_index=-100, reduction=reduction)
        ref = ref if reduction != "none" else ref.view(S, B)
        r = full_input(*ref.shape, seed=5) if reduction == "none" else torch.tensor(1.7)
        (ref * r).sum().backward()
        local = chunk(logits.detach(), -1, st).clone().requires_grad_()
        loss = vocab_parallel_cross_entropy(local, target, ignore_index=-100, reduction=reduction)
        (loss * r).sum().backward()
        errs[f"{reduction} loss"] = rel_norm(loss, ref)
        errs[f"{reduction} dlogits"] = rel_norm(local.grad, chunk(logits.grad, -1, st))
    return errs


def _cross_entropy_bf16(t: int) -> dict[str, bool | float]:
    """bf16 logits: the kept bf16 softmax (+ fp32 target probability) against the same cross
    entropy fed the fp32 copy of those logits (which keeps the fp32 softmax), its gradient
    rounded to bf16 as autograd rounds it for bf16 logits."""
    st = nc.initialize_model_parallel(t)
    V = 64
    # Scale 12: many tokens put p > 0.99 on one entry, where the target's p - 1 would cancel.
    full = (12 * full_input(S, B, V)).to(torch.bfloat16)
    target = full.float().argmax(-1)
    target[1::2] = torch.randint(0, V, target[1::2].shape, generator=torch.Generator().manual_seed(4))
    target[0, 0] = -100
    out: dict[str, bool | float] = {}
    for reduction, scale in (("sum", 0.5), ("mean", 1.0), ("sum", 0.3)):
        grads = []
        for dtype in (torch.bfloat16, torch.float32):
            local = chunk(full, -1, st).to(dtype).clone().requires_grad_()
            loss = vocab_parallel_cross_entropy(local, target, ignore_index=-100, reduction=reduction)
            (loss * scale).backward()
            grads.append(local.grad.to(torch.bfloat16))
        ours, ref = grads
        key = f"{reduction}*{scale}"
        out[f"{key} equal"] = torch.equal(ours, ref)
        # One bf16 rounding: |ours - ref| <= one bf16 ulp of ref (2^-7 relative, normal range).
        ulp = ref.float().abs() * 2**-7
        out[f"{key} within one ulp"] = bool(((ours.float() - ref.float()).abs() <= ulp).all())
    out["max p"] = float(torch.softmax(full.float(), -1).amax())
    return out


def test_cross_entropy_bf16_keeps_a_bf16_softmax_with_the_fp32_gradient(world):
    """2^k grad_loss (sum * 0.5): bit-identical to the fp32 softmax; otherwise within one bf16
    rounding (double rounding); the target entries (p near 1) never lose to cancellation."""
    for t in (1, 2):
        for rank, res in enumerate(world(t).run(_cross_entropy_bf16, t)):
            assert res["max p"] > 0.99, res
            assert res["sum*0.5 equal"], (t, rank, res)  # grad_loss 0.5 = 2^-1
            for key, value in res.items():
                if key.endswith("within one ulp"):
                    assert value, (t, rank, key, res)


def test_cross_entropy_keeps_half_the_bytes_for_bf16_logits():
    from neuron_ckpt.memory import SavedTensorRecorder

    nc.initialize_model_parallel(1)
    try:
        target = torch.randint(0, 1000, (8, 4), generator=torch.Generator().manual_seed(0))
        kept = {}
        for dtype in (torch.bfloat16, torch.float32):
            logits = torch.randn(8, 4, 1000, dtype=dtype, requires_grad=True)
            with SavedTensorRecorder() as rec:
                loss = vocab_parallel_cross_entropy(logits, target, reduction="none")
            kept[dtype] = rec.total_bytes
            del loss
        masks = 32 * (8 + 1 + 1)  # int64 index, two bool masks
        assert kept[torch.float32] == 32 * 1000 * 4 + masks
        assert kept[torch.bfloat16] == 32 * 1000 * 2 + 32 * 4 + masks
    finally:
        nc.destroy_distributed()


def _norms(t: int) -> dict[str, float]:
    st = nc.initialize_model_parallel(t)
    errs = {}
    x = full_input(S, B, H).requires_grad_()
    r = full_input(S, B, H, seed=2)
    w = (1 + 0.1 * full_input(H, seed=6)).requires_grad_()
    bias = (0.1 * full_input(H, seed=7)).requires_grad_()
    for name in ("rms", "layer"):
        for sp in (False, True):
            x.grad = w.grad = bias.grad = None
            if name == "rms":
                norm = RMSNorm(H, eps=1e-5, sequence_parallel=sp)
                yd = F.rms_norm(x, (H,), w, eps=1e-5)
            else:
                norm = LayerNorm(H, eps=1e-5, sequence_parallel=sp)
                yd = F.layer_norm(x, (H,), w, bias, eps=1e-5)
            (yd * r).sum().backward()
            with torch.no_grad():
                norm.weight.copy_(w)
                if name == "layer":
                    norm.bias.copy_(bias)
            xl = (chunk(x.detach(), 0, st) if sp else x.detach()).clone().requires_grad_()
            y = norm(xl)
            (y * (chunk(r, 0, st) if sp else r)).sum().backward()
            key = f"{name} sp={sp}"
            errs[f"{key} y"] = rel_norm(y, chunk(yd, 0, st) if sp else yd)
            errs[f"{key} dx"] = rel_norm(xl.grad, chunk(x.grad, 0, st) if sp else x.grad)
            errs[f"{key} dw"] = rel_norm(norm.weight.grad, w.grad)  # complete, not partial
            if name == "layer":
                errs[f"{key} db"] = rel_norm(norm.bias.grad, bias.grad)
    return errs


def _dense_attention(q, k, v, heads, kv_heads, d):
    s, b = q.shape[:2]
    q = q.view(s, b, heads, d).permute(1, 2, 0, 3)
    k = k.view(s, b, kv_heads, d).permute(1, 2, 0, 3).repeat_interleave(heads // kv_heads, dim=1)
    v = v.view(s, b, kv_heads, d).permute(1, 2, 0, 3).repeat_interleave(heads // kv_heads, dim=1)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return out.permute(2, 0, 1, 3).reshape(s, b, heads * d)


def _attention_block(t: int) -> dict[str, float]:
    """QKV (GQA) -> core attention -> row projection, with and without sequence parallel."""
    st = nc.initialize_model_parallel(t)
    errs = {}
    heads, d = 4, 4
    hidden = heads * d
    for kv_heads in (4, 2, 1):  # kv=1 at t=2,4 and kv=2 at t=4 replicate kv heads
        for sp in (False, True):
            torch.manual_seed(0)
            qkv = QKVParallelLinear(hidden, heads, kv_heads, bias=True, sequence_parallel=sp)
            with torch.no_grad():
                for bias in (qkv.q_bias, qkv.k_bias, qkv.v_bias):
                    bias.normal_()
            core = CoreAttention(qkv.local_heads, qkv.local_kv_heads, d)
            proj = RowParallelLinear(hidden, hidden, bias=False, sequence_parallel=sp)

            def full(p, dim=0, qkv=qkv):  # this iteration's layer, bound
                if qkv.replicas > 1 and p is not qkv.q_weight and p is not qkv.q_bias:
                    parts = C.all_gather(p.detach().unsqueeze(0), 0, st.tp)[:: qkv.replicas]
                    return torch.cat(list(parts), dim)
                return C.all_gather(p.detach(), dim, st.tp)

            wq, wk, wv = (full(p).requires_grad_() for p in (qkv.q_weight, qkv.k_weight, qkv.v_weight))
            bq, bk, bv = (full(p).requires_grad_() for p in (qkv.q_bias, qkv.k_bias, qkv.v_bias))
            wo = C.all_gather(proj.weight.detach(), 1, st.tp).requires_grad_()
            x = full_input(S, B, hidden).requires_grad_()
            r = full_input(S, B, hidden, seed=2)
            yd = F.linear(
                _dense_attention(F.linear(x, wq, bq), F.linear(x, wk, bk), F.linear(x, wv, bv), heads, kv_heads, d), wo
            )
            (yd * r).sum().backward()

            xl = (chunk(x.detach(), 0, st) if sp else x.detach()).clone().requires_grad_()
            y = proj(core(*qkv(xl)))
            (y * (chunk(r, 0, st) if sp else r)).sum().backward()
            key = f"kv={kv_heads} sp={sp}"
            errs[f"{key} y"] = rel_norm(y, chunk(yd, 0, st) if sp else yd)
            errs[f"{key} dx"] = rel_norm(xl.grad, chunk(x.grad, 0, st) if sp else x.grad)
            errs[f"{key} dwq"] = rel_norm(qkv.q_weight.grad, chunk(wq.grad, 0, st))
            errs[f"{key} dbq"] = rel_norm(qkv.q_bias.grad, chunk(bq.grad, 0, st))
            kv_rows = slice(qkv.kv_index * qkv.local_kv_heads * d, (qkv.kv_index + 1) * qkv.local_kv_heads * d)
            errs[f"{key} dwk"] = rel_norm(qkv.k_weight.grad, wk.grad[kv_rows])
            errs[f"{key} dwv"] = rel_norm(qkv.v_weight.grad, wv.grad[kv_rows])
            # The key bias gradient is analytically zero (softmax ignores a per-query constant
            # q.b_k), so relative error would compare rounding noise: check the value bias.
            errs[f"{key} dbv"] = rel_norm(qkv.v_bias.grad, bv.grad[kv_rows])
            errs[f"{key} dwo"] = rel_norm(proj.weight.grad, chunk(wo.grad, 1, st))
    return errs


def _mlp_block(t: int) -> dict[str, float]:
    """Column -> GeLU -> row, the Megatron MLP, with and without sequence parallel."""
    st = nc.initialize_model_parallel(t)
    errs = {}
    for sp in (False, True):
        torch.manual_seed(0)
        up = ColumnParallelLinear(H, 32, bias=True, sequence_parallel=sp)
        down = RowParallelLinear(32, H, bias=True, sequence_parallel=sp)
        with torch.no_grad():
            up.bias.normal_()
            down.bias.normal_()
        w1 = C.all_gather(up.weight.detach(), 0, st.tp).requires_grad_()
        b1 = C.all_gather(up.bias.detach(), 0, st.tp).requires_grad_()
        w2 = C.all_gather(down.weight.detach(), 1, st.tp).requires_grad_()
        b2 = down.bias.detach().clone().requires_grad_()
        x = full_input(S, B, H).requires_grad_()
        r = full_input(S, B, H, seed=2)
        yd = F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2)
        (yd * r).sum().backward()
        xl = (chunk(x.detach(), 0, st) if sp else x.detach()).clone().requires_grad_()
        y = down(F.gelu(up(xl)))
        (y * (chunk(r, 0, st) if sp else r)).sum().backward()
        key = f"sp={sp}"
        errs[f"{key} y"] = rel_norm(y, chunk(yd, 0, st) if sp else yd)
        errs[f"{key} dx"] = rel_norm(xl.grad, chunk(x.grad, 0, st) if sp else x.grad)
        errs[f"{key} dw1"] = rel_norm(up.weight.grad, chunk(w1.grad, 0, st))
        errs[f"{key} db1"] = rel_norm(up.bias.grad, chunk(b1.grad, 0, st))
        errs[f"{key} dw2"] = rel_norm(down.weight.grad, chunk(w2.grad, 1, st))
        errs[f"{key} db2"] = rel_norm(down.bias.grad, b2.grad)
    return errs


def _sequence_mappings(t: int) -> dict[str, float]:
    """scatter/gather along the sequence are inverse; their backward is the conjugate collective."""
    nc.initialize_model_parallel(t)
    x = full_input(S, B, H).requires_grad_()
    y = gather_from_sequence_parallel_region(scatter_to_sequence_parallel_region(x), tensor_parallel_output_grad=False)
    (y * 3).sum().backward()
    return {"roundtrip": rel_norm(y, x), "grad": rel_norm(x.grad, torch.full_like(x, 3.0))}


CHECKS = {
    "column": _column,
    "row": _row,
    "embedding": _embedding,
    "cross_entropy": _cross_entropy,
    "norms": _norms,
    "mlp_block": _mlp_block,
    "attention_block": _attention_block,
    "sequence_mappings": _sequence_mappings,
}


@pytest.mark.parametrize("t", TPS)
@pytest.mark.parametrize("name", list(CHECKS))
def test_layer_matches_dense_reference(world, name, t):
    per_rank = world(4).run(CHECKS[name], t)
    worst = {k: max(r[k] for r in per_rank) for k in per_rank[0]}
    bad = {k: v for k, v in worst.items() if not v < TOL}
    assert not bad, f"{name} at t={t}: relative errors above {TOL}: {bad}"


def _full_weights(t: int) -> dict[str, torch.Tensor]:
    st = nc.initialize_model_parallel(t)
    torch.manual_seed(123)
    col = ColumnParallelLinear(H, 16, bias=False)
    row = RowParallelLinear(16, H, bias=False)
    emb = VocabParallelEmbedding(20, H)
    qkv = QKVParallelLinear(16, 4, 2)
    return {
        "column": C.all_gather(col.weight.detach(), 0, st.tp),
        "row": C.all_gather(row.weight.detach(), 1, st.tp),
        "embedding": C.all_gather(emb.weight.detach(), 0, st.tp),
        "q": C.all_gather(qkv.q_weight.detach(), 0, st.tp),
    }


def test_initialisation_does_not_depend_on_tp_degree(world):
    ref = world(4).run(_full_weights, 1)[0]
    for t in (2, 4):
        got = world(4).run(_full_weights, t)
        for rank, weights in enumerate(got):
            for name, w in weights.items():
                assert torch.equal(w, ref[name]), f"{name} differs at t={t} on rank {rank}"


_CPU_DROPOUT_WARNINGS = """
import warnings
import torch
from neuron_ckpt.parallel import flash
q, k, v = (torch.randn(2, n, 16, 8) for n in (4, 2, 2))
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    flash.flash_attention(q, k, v, dropout_p=0.1)
    flash.flash_attention(q, k, v, dropout_p=0.1)
    flash.flash_attention(q, k, v, dropout_p=0.0)
print(sum("math path" in str(w.message) for w in caught))
"""


def test_flash_attention_equals_explicit_and_says_when_cpu_dropout_is_not_flash():
    """fp32: torch's flash kernel and the written-out softmax agree to rounding (GQA, causal);
    with dropout CPU SDPA runs its math path, which the memory model does not count: said once
    per process (a fresh one, so that no earlier test has said it already)."""
    import subprocess
    import sys

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(16, 2, n * 8, generator=g) for n in (4, 2, 2))
    explicit = CoreAttention(4, 2, 8)(q, k, v)
    fused = CoreAttention(4, 2, 8, implementation="flash")(q, k, v)
    assert (fused - explicit).abs().max() < 1e-5
    said = subprocess.run([sys.executable, "-c", _CPU_DROPOUT_WARNINGS], capture_output=True, text=True, check=True)
    assert said.stdout.split()[-1] == "1", said.stdout + said.stderr
