"""``CoreAttention(implementation="flash")`` on XLA: the plumbing to neuronx-distributed's NKI kernel.

The kernel cannot run here (no Trainium; neuronx-distributed on PyPI is a placeholder). A
stand-in with NxD's public signature takes its place under the module name the XLA path
imports: it checks what it is handed (``[b, heads, d, s]`` with ``transpose_nki_inputs=True``, k
and v repeated to the query heads, causal, scale ``1/sqrt(d)``, a sequence that is a multiple of
2048) and computes the same function as an autograd Function that, like NxD's ``NKIAttnFunc``,
saves q, k, v, the output and the fp32 logsumexp: never an ``s x s`` tensor. The tests check the
numerics against eager CPU (torch's SDPA flash kernel), the lowered HLO of what autograd keeps,
and the fallback to the explicit attention, said once, when the kernel cannot run.
"""

from __future__ import annotations

import math
import re
import sys
import types
import warnings

import pytest
import torch

from neuron_ckpt.parallel import CoreAttention, flash
from tests.helpers import rel_norm

from .helpers import TOL, hlo

S, B, HEADS, D = 2048, 1, 4, 8


class _StandIn(torch.autograd.Function):
    """Causal attention on ``[b, h, s, d]``, saving what a flash kernel saves."""

    @staticmethod
    def forward(ctx, q, k, v, scale):
        scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
        scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)
        out = torch.matmul(torch.exp(scores - lse[..., None]), v.float()).to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = (t.float() for t in ctx.saved_tensors)
        dout = dout.float()
        scores = torch.matmul(q, k.transpose(-1, -2)) * ctx.scale
        scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
        p = torch.exp(scores - lse[..., None])
        dv = torch.matmul(p.transpose(-1, -2), dout)
        dp = torch.matmul(dout, v.transpose(-1, -2))
        ds = p * (dp - (dout * out).sum(-1, keepdim=True))
        dq = torch.matmul(ds, k) * ctx.scale
        dk = torch.matmul(ds.transpose(-1, -2), q) * ctx.scale
        dtype = ctx.saved_tensors[0].dtype
        return dq.to(dtype), dk.to(dtype), dv.to(dtype), None


class StandInKernel:
    """``nki_flash_attn_func`` with NxD's signature; records what each call received."""

    def __init__(self):
        self.calls: list[dict] = []

    def __call__(
        self,
        q,
        k,
        v,
        lnc=1,
        dropout_p=0.0,
        softmax_scale=None,
        causal=True,
        mixed_precision=True,
        seed=None,
        hardware_type=None,
        transpose_nki_inputs=True,
    ):
        assert transpose_nki_inputs, "the XLA path passes [b, h, d, s], as NxD's Llama does"
        b, h, d, s = q.shape
        assert k.shape == v.shape == q.shape, f"k, v repeated to the query heads: q {q.shape}, k {k.shape}"
        assert s % 2048 == 0, "NxD's wrapper raises NotImplementedError otherwise"
        self.calls.append(
            {
                "shape": tuple(q.shape),
                "causal": causal,
                "scale": softmax_scale,
                "dropout_p": dropout_p,
                "device": q.device.type,
                "lnc": lnc,
            }
        )
        scale = d**-0.5 if softmax_scale is None else softmax_scale

        def t(x):  # [b, h, d, s] -> [b, h, s, d]
            return x.transpose(-1, -2)

        return _StandIn.apply(t(q), t(k), t(v), scale)


@pytest.fixture
def kernel(monkeypatch):
    """The stand-in, importable as ``neuronx_distributed.kernels.flash_attn.nki_flash_attn_func``."""
    stand_in = StandInKernel()
    module = types.ModuleType(flash.NKI_MODULE)
    module.nki_flash_attn_func = stand_in
    for name in ("neuronx_distributed", "neuronx_distributed.kernels"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, flash.NKI_MODULE, module)
    flash.nki_flash_attn_func.cache_clear()
    yield stand_in
    flash.nki_flash_attn_func.cache_clear()


@pytest.fixture
def no_kernel(monkeypatch):
    monkeypatch.setitem(sys.modules, flash.NKI_MODULE, None)  # import raises ImportError
    flash.nki_flash_attn_func.cache_clear()
    flash._warn_once.cache_clear()
    yield
    flash.nki_flash_attn_func.cache_clear()
    flash._warn_once.cache_clear()


def _inputs(kv_heads: int, seq: int = S) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(seq, B, n * D, generator=g) for n in (HEADS, kv_heads, kv_heads)]


def _forward_backward(implementation: str, kv_heads: int, device, seq: int = S):
    core = CoreAttention(HEADS, kv_heads, D, implementation=implementation).to(device)
    xs = [x.to(device).requires_grad_() for x in _inputs(kv_heads, seq)]
    out = core(*xs)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(device)
    (out * w).sum().backward()
    return [t.cpu() for t in (out, *(x.grad for x in xs))]


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_flash_on_xla_calls_the_kernel_as_nxd_does(xla, kernel, kv_heads):
    got = _forward_backward("flash", kv_heads, xla.device)
    want = _forward_backward("flash", kv_heads, torch.device("cpu"))  # torch's SDPA flash kernel
    errors = {name: rel_norm(a, b) for name, a, b in zip(("out", "dq", "dk", "dv"), got, want)}
    assert max(errors.values()) < TOL, errors
    assert kernel.calls == [
        {
            "shape": (B, HEADS, D, S),
            "causal": True,
            "scale": 1 / math.sqrt(D),
            "dropout_p": 0.0,
            "device": "xla",
            "lnc": 1,
        }
    ]


def _root_shapes(text: str) -> str:
    """The output shapes of the HLO's entry computation (its ROOT instruction's type)."""
    entry = text[text.index("ENTRY") :]
    return re.search(r"ROOT \S+ = (\([^)]*\)|\S+)", entry).group(1)


@pytest.mark.parametrize("implementation", ["flash", "explicit"])
def test_no_s_by_s_tensor_is_kept_for_backward(xla, kernel, implementation):
    """The lowered graph of what autograd keeps after the forward: with the kernel nothing
    ``[.., s, s]``; with explicit attention the probabilities (the control: the check can fail)."""
    core = CoreAttention(HEADS, 2, D, implementation=implementation)
    xs = [x.to(xla.device).requires_grad_() for x in _inputs(2)]
    kept: list[torch.Tensor] = []

    def pack(t):
        kept.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        core(*xs)
    shapes = _root_shapes(hlo(*[t for t in kept if t.device.type == "xla"]))
    s_by_s = re.search(rf"\[[\d,]*{S},{S}\]", shapes)
    if implementation == "flash":
        assert s_by_s is None, shapes
        assert re.search(rf"f32\[{B},{HEADS},{S}\]", shapes), f"the fp32 logsumexp is kept: {shapes}"
    else:
        assert s_by_s is not None, shapes


def test_without_the_kernel_xla_runs_explicit_and_says_so_once(xla, no_kernel):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _forward_backward("flash", 2, xla.device, seq=64)
        _forward_backward("flash", 2, xla.device, seq=64)
    said = [str(w.message) for w in caught if "runs the explicit attention" in str(w.message)]
    assert len(said) == 1 and "not importable" in said[0], said
    want = _forward_backward("explicit", 2, xla.device, seq=64)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_a_sequence_the_kernel_refuses_runs_explicit(xla, kernel):
    assert "multiple of 2048" in flash.unavailable("xla", 1024, D)
    assert "head_dim" in flash.unavailable("xla", 2048, 256)
    assert flash.unavailable("xla", 4096, 128) is None and flash.unavailable("cpu", 7, 999) is None
    _forward_backward("flash", 2, xla.device, seq=64)
    assert kernel.calls == []
