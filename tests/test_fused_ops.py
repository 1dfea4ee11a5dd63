"""``rms_norm``, ``swiglu`` and ``masked_softmax`` compute what the plain expressions compute and
keep less for backward.

References, both run by plain autograd: today's ``RMSNorm.forward`` written out
(``weight * (h * rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)``, ``h = x.float()``)
and ``F.silu(gate) * up``; and the same maths in fp64 on fp64 copies of the inputs.

- Forward: equal bit for bit, dtype included, for fp32, bf16 and fp16 activations with fp32 and
  16-bit weights (the same ops run in the same order, so any difference would be a bug).
- ``swiglu`` backward: equal bit for bit (it runs autograd's own ops).
- ``rms_norm`` backward (a different, shorter formula: see ``fused_ops``' docstring):

  - a gradient in fp32: relative error ``||a - b|| / ||b||`` against the plain reference at most
    ``1e-6``. Unit roundoff is 6e-8; the two differ only in operation order (measured 5e-8 to
    2.5e-7, the largest on a 5-wide row); 1e-6 is ~16 ulps, while a wrong formula (the mean
    term dropped, rstd squared instead of cubed) is off by 1e-2 or more.
  - a gradient in 16 bits: the error against the fp64 reference is no more than 1.1x the plain
    reference's own. Both end in one rounding to 16 bits (bf16: unit roundoff 2^-8 = 3.9e-3,
    ~1.6e-3 norm-wise for one rounding), which dominates; the plain reference also rounds
    ``grad * weight`` (and with a bf16 weight, ``grad * normalised``) to 16 bits on the way, so
    the fused error is measured smaller (fused / plain 0.46 to 1.0 over 4 seeds x 3 shapes, bf16).
    The 10% slack covers seed-to-seed scatter at equal error; a wrong formula is off by ~1.

- ``gradcheck`` in fp64 (``rms_norm`` keeps fp64 statistics for fp64 input for this); a second
  derivative raises (``once_differentiable``) instead of silently missing rstd's dependence on x.
- What is saved, seen by ``saved_tensors_hooks`` and ``SavedTensorRecorder``: ``rms_norm``: ``x``
  itself, an fp32 ``[..., 1]`` rstd and the weight (a parameter, not an activation); ``swiglu``:
  ``gate`` and ``up`` themselves.
- Under ``torch.autocast("cpu", bfloat16)``: the plain RMSNorm computes exactly what it does
  without autocast (none of its ops is autocast's), and so do the Functions.
- ``masked_softmax`` (reference: ``softmax(scores.masked_fill(mask, fill), -1, dtype=fp32)
  .to(scores.dtype)`` under autograd): forward equal bit for bit; fp32 backward equal bit for
  bit; 16-bit backward: (a) against the exact (fp64) softmax backward of the *kept* 16-bit
  output, relative error at most the unit roundoff u (2^-8 bf16, 2^-11 fp16): it is that
  formula rounded once (measured 0.74-1.23x the plain reference's own one-rounding error; rows
  up to s = 1024, where a 16-bit accumulation would be off by far more);
  (b) against the true fp64 gradient, at most 2u: the kept output's rounding plus the final one
  (measured 3.8e-3 bf16, 5.4e-4 fp16; the plain reference 1.8e-3 / 2.6e-4). A wrong formula
  (the row sum dropped, the mask not zeroed) is off by order 1. It keeps only its output.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from neuron_ckpt.memory.measure import SavedTensorRecorder
from neuron_ckpt.parallel.attention import masked_score
from neuron_ckpt.parallel.fused_ops import masked_softmax, rms_norm, swiglu

from .helpers import rel_norm

EPS = 1e-6
SHAPES = [(8, 2, 64), (5, 3, 7), (13, 1, 33)]  # [s, b, h]: small, and odd sizes
ACT = [torch.float32, torch.bfloat16, torch.float16]
WEIGHT = [torch.float32, torch.bfloat16]


def plain_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = EPS) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def exact_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = EPS) -> torch.Tensor:
    h = x.double()
    return weight.double() * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps))


def plain_swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def randn(shape, dtype, seed: int, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (shift + scale * torch.randn(shape, generator=g, dtype=torch.float64)).to(dtype)


def run(fn, inputs: list[torch.Tensor], grad: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Output and input gradients of ``fn(*inputs)`` backpropagating ``grad``, on fresh leaves."""
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    out.backward(grad.to(out.dtype))
    return out.detach(), [t.grad for t in leaves]


def norm_inputs(shape, act, weight, seed=0):
    x = randn(shape, act, seed)
    w = randn(shape[-1:], weight, seed + 1, scale=0.1, shift=1.0)
    dy = randn(shape, torch.float64, seed + 2)
    return x, w, dy


# --- rms_norm ------------------------------------------------------------------------------


@pytest.mark.parametrize("weight_dtype", WEIGHT, ids=str)
@pytest.mark.parametrize("act", ACT, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_rms_norm_forward_is_bitwise_the_plain_module(shape, act, weight_dtype):
    x, w, _ = norm_inputs(shape, act, weight_dtype)
    got, want = rms_norm(x, w, EPS), plain_rms_norm(x, w)
    assert got.dtype == want.dtype == torch.promote_types(act, weight_dtype)
    assert torch.equal(got, want), rel_norm(got, want)


@pytest.mark.parametrize("weight_dtype", WEIGHT, ids=str)
@pytest.mark.parametrize("act", ACT, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_rms_norm_gradients_match_the_plain_module(shape, act, weight_dtype):
    x, w, dy = norm_inputs(shape, act, weight_dtype)
    _, fused = run(lambda x, w: rms_norm(x, w, EPS), [x, w], dy)
    _, plain = run(plain_rms_norm, [x, w], dy)
    _, exact = run(exact_rms_norm, [x.double(), w.double()], dy)
    for name, f, p, e, dtype in zip(("dx", "dw"), fused, plain, exact, (act, weight_dtype)):
        assert f.dtype == p.dtype == dtype, name
        if dtype == torch.float32:
            assert rel_norm(f, p) <= 1e-6, (name, rel_norm(f, p))
        else:
            assert rel_norm(f, e) <= 1.1 * rel_norm(p, e), (name, rel_norm(f, e), rel_norm(p, e))


def test_rms_norm_weight_gradient_uses_the_rounded_normalised_input():
    # With an fp32 weight, autograd's weight gradient is fp32 grad * the bf16-rounded normalised
    # input, summed in fp32: the fused one runs the same ops, so it is the same bits.
    x, w, dy = norm_inputs((16, 4, 96), torch.bfloat16, torch.float32)
    _, (_, fused_dw) = run(lambda x, w: rms_norm(x, w, EPS), [x, w], dy)
    _, (_, plain_dw) = run(plain_rms_norm, [x, w], dy)
    assert torch.equal(fused_dw, plain_dw)


def test_rms_norm_non_contiguous_input_and_one_gradient_at_a_time():
    x, w, dy = norm_inputs((6, 3, 20), torch.bfloat16, torch.float32)
    xt = x.transpose(0, 1)  # [b, s, h], not contiguous
    assert torch.equal(rms_norm(xt, w, EPS), plain_rms_norm(xt, w))
    frozen = w.clone()  # no grad for the weight
    leaf = x.clone().requires_grad_()
    rms_norm(leaf, frozen, EPS).backward(dy.float())
    _, (dx, _) = run(lambda x, w: rms_norm(x, w, EPS), [x, w], dy)
    assert torch.equal(leaf.grad, dx)
    wleaf = w.clone().requires_grad_()
    rms_norm(x, wleaf, EPS).backward(dy.float())
    _, (_, dw) = run(lambda x, w: rms_norm(x, w, EPS), [x, w], dy)
    assert torch.equal(wleaf.grad, dw)


def test_rms_norm_rejects_a_weight_of_the_wrong_shape():
    with pytest.raises(ValueError, match=r"weight must have shape \[8\]"):
        rms_norm(torch.randn(2, 8), torch.ones(7), EPS)


def test_rms_norm_gradcheck_fp64():
    x = randn((3, 2, 5), torch.float64, 0).requires_grad_()
    w = randn((5,), torch.float64, 1, scale=0.1, shift=1.0).requires_grad_()
    assert torch.autograd.gradcheck(lambda x, w: rms_norm(x, w, 1e-3), (x, w))


# --- swiglu --------------------------------------------------------------------------------


@pytest.mark.parametrize("act", ACT, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_swiglu_forward_and_backward_are_bitwise_autograds(shape, act):
    gate, up = randn(shape, act, 0, scale=3.0), randn(shape, act, 1)
    dy = randn(shape, torch.float64, 2)
    out, (d_gate, d_up) = run(swiglu, [gate, up], dy)
    want, (want_gate, want_up) = run(plain_swiglu, [gate, up], dy)
    assert out.dtype == want.dtype == act
    assert torch.equal(out, want)
    assert torch.equal(d_gate, want_gate) and torch.equal(d_up, want_up)


def test_swiglu_gradcheck_fp64():
    gate = randn((3, 2, 5), torch.float64, 0, scale=3.0).requires_grad_()
    up = randn((3, 2, 5), torch.float64, 1).requires_grad_()
    assert torch.autograd.gradcheck(swiglu, (gate, up))


@pytest.mark.parametrize("op", ["rms_norm", "swiglu"])
def test_a_second_derivative_raises_rather_than_being_wrong(op):
    a = randn((3, 2, 5), torch.float64, 0).requires_grad_()
    b = randn((5,) if op == "rms_norm" else (3, 2, 5), torch.float64, 1).requires_grad_()
    out = rms_norm(a, b, EPS) if op == "rms_norm" else swiglu(a, b)
    (da,) = torch.autograd.grad(out.sum(), a, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable|does not require grad"):
        da.sum().backward()


# --- what is saved -------------------------------------------------------------------------


def saved_by(fn, *inputs: torch.Tensor) -> list[torch.Tensor]:
    saved = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*inputs)
    return saved


def same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


@pytest.mark.parametrize("act", [torch.bfloat16, torch.float32], ids=str)
def test_rms_norm_saves_x_and_an_fp32_rstd_and_no_other_activation(act):
    s, b, h = 8, 2, 64
    x = randn((s, b, h), act, 0).requires_grad_()
    w = torch.nn.Parameter(torch.ones(h))
    saved = saved_by(lambda x, w: rms_norm(x, w, EPS), x, w)
    assert len(saved) == 3, [(t.dtype, tuple(t.shape)) for t in saved]
    xs, rstd, ws = saved
    assert same_storage(xs, x) and xs.dtype == act and xs.shape == x.shape
    assert rstd.dtype == torch.float32 and rstd.shape == (s, b, 1)
    assert same_storage(ws, w)

    # The same through the library's recorder, parameters excluded: x plus an fp32 per row.
    module = torch.nn.Module()
    module.weight = w
    with SavedTensorRecorder(exclude_modules=[module]) as fused:
        out = rms_norm(x, w, EPS)  # kept: the graph (and what it saved) lives while out does
    assert fused.total_bytes == x.nbytes + s * b * 4
    with SavedTensorRecorder(exclude_modules=[module]) as plain:
        plain_out = plain_rms_norm(x, w)
    # Plain keeps x in fp32 (a copy, or x itself when fp32), rstd, and the normalised x in x's dtype.
    assert plain.total_bytes == x.numel() * 4 + s * b * 4 + x.nbytes
    assert fused.total_bytes < plain.total_bytes
    del out, plain_out


def test_swiglu_saves_exactly_gate_and_up():
    gate = randn((8, 2, 64), torch.bfloat16, 0).requires_grad_()
    up = randn((8, 2, 64), torch.bfloat16, 1).requires_grad_()
    saved = saved_by(swiglu, gate, up)
    assert len(saved) == 2
    assert same_storage(saved[0], gate) and same_storage(saved[1], up)
    with SavedTensorRecorder() as fused:
        out = swiglu(gate, up)  # kept: the graph (and what it saved) lives while out does
    with SavedTensorRecorder() as plain:
        plain_out = plain_swiglu(gate, up)
    assert fused.total_bytes == 2 * gate.nbytes
    assert plain.total_bytes == 3 * gate.nbytes  # gate, silu(gate), up
    del out, plain_out


# --- autocast ------------------------------------------------------------------------------


@pytest.mark.parametrize("weight_dtype", WEIGHT, ids=str)
@pytest.mark.parametrize("act", [torch.float32, torch.bfloat16], ids=str)
def test_under_cpu_autocast_everything_computes_as_without_it(act, weight_dtype):
    x, w, dy = norm_inputs((8, 2, 64), act, weight_dtype)
    gate, up = randn((8, 2, 64), act, 3, scale=3.0), randn((8, 2, 64), act, 4)
    cases = [
        (lambda x, w: rms_norm(x, w, EPS), [x, w]),
        (plain_rms_norm, [x, w]),
        (swiglu, [gate, up]),
        (plain_swiglu, [gate, up]),
    ]
    for fn, inputs in cases:
        want, want_grads = run(fn, inputs, dy)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got, grads = run(fn, inputs, dy)
        assert got.dtype == want.dtype and torch.equal(got, want)
        assert all(torch.equal(a, b) for a, b in zip(grads, want_grads))
    # And so the fused norm is still bitwise the plain one under autocast.
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(rms_norm(x, w, EPS), plain_rms_norm(x, w))


# ---------------------------------------------------------------------------------------------
# masked_softmax


SCORES = [(2, 3, 8, 8), (1, 2, 13, 13), (1, 4, 64, 64), (1, 2, 1024, 1024)]  # [b, a, s, s]; s = 1024:
# a row sum accumulated in 16 bits would be ~sqrt(1024) roundings off and fail the 16-bit bounds
UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def plain_masked_softmax(scores: torch.Tensor, mask: torch.Tensor, fill: float) -> torch.Tensor:
    return torch.softmax(scores.masked_fill(mask, fill), dim=-1, dtype=torch.float32).to(scores.dtype)


def softmax_inputs(shape, act, seed):
    g = torch.Generator().manual_seed(seed)
    scores = (3 * torch.randn(shape, generator=g)).to(act)
    grad = torch.randn(shape, generator=g).to(act)
    mask = torch.ones(shape[-1], shape[-1], dtype=torch.bool).triu_(1)
    return scores, grad, mask, masked_score(act)


@pytest.mark.parametrize("act", ACT, ids=str)
@pytest.mark.parametrize("shape", SCORES, ids=str)
def test_masked_softmax_forward_is_bitwise_the_plain_expression(shape, act):
    scores, _, mask, fill = softmax_inputs(shape, act, 0)
    out = masked_softmax(scores, mask, fill)
    assert out.dtype == act and torch.equal(out, plain_masked_softmax(scores, mask, fill))
    assert torch.equal(out.masked_select(mask), torch.zeros(1, dtype=act).expand(out.masked_select(mask).shape))


@pytest.mark.parametrize("shape", SCORES, ids=str)
def test_masked_softmax_fp32_backward_is_bitwise_autograds(shape):
    scores, grad, mask, fill = softmax_inputs(shape, torch.float32, 1)
    (_, [ours]), (_, [ref]) = (run(lambda x, f=f: f(x, mask, fill), [scores], grad)
                               for f in (masked_softmax, plain_masked_softmax))  # fmt: skip
    assert torch.equal(ours, ref)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("act", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", SCORES, ids=str)
def test_masked_softmax_16bit_backward_is_one_rounding_of_the_kept_output(shape, act, seed):
    scores, grad, mask, fill = softmax_inputs(shape, act, seed)
    out, [ours] = run(lambda x: masked_softmax(x, mask, fill), [scores], grad)
    u = UNIT_ROUNDOFF[act]
    # (a) The exact softmax backward of the 16-bit output it kept, rounded once.
    exact = torch.ops.aten._softmax_backward_data(grad.double(), out.double(), -1, torch.float64)
    assert rel_norm(ours, exact) <= u
    # (b) Against the true gradient: the kept output's rounding and the final one.
    x = scores.double().requires_grad_()
    torch.softmax(x.masked_fill(mask, fill), -1).backward(grad.double())
    assert rel_norm(ours, x.grad) <= 2 * u
    assert torch.equal(ours.masked_select(mask), torch.zeros_like(ours.masked_select(mask)))


def test_masked_softmax_gradcheck_fp64():
    scores, _, mask, fill = softmax_inputs((1, 2, 6, 6), torch.float64, 2)
    assert torch.autograd.gradcheck(lambda x: masked_softmax(x, mask, fill), [scores.requires_grad_()])


@pytest.mark.parametrize("act", [torch.bfloat16, torch.float32], ids=str)
def test_masked_softmax_keeps_only_its_output(act):
    scores, _, mask, fill = softmax_inputs((2, 3, 8, 8), act, 3)
    x = scores.requires_grad_()
    outs: list[torch.Tensor] = []
    saved = saved_by(lambda: outs.append(masked_softmax(x, mask, fill)))
    assert len(saved) == 1 and same_storage(saved[0], outs[0])  # the output itself: no fp32 copy


def test_masked_softmax_rejects_a_non_bool_mask():
    with pytest.raises(ValueError, match="mask must be a bool tensor"):
        masked_softmax(torch.randn(2, 2), torch.zeros(2, 2), -1e4)
