"""The RNG streams on XLA: the device generator (``xm.get_rng_state`` / ``set_rng_state``) is
saved and restored with the CPU one, so dropout replays bit-identically, also inside recompute."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import torch_xla
import torch_xla.core.xla_model as xm

import neuron_ckpt as nc
from neuron_ckpt.distributed.random import get_rng_state, set_rng_state
from neuron_ckpt.parallel import CoreAttention
from neuron_ckpt.recompute import checkpoint
from tests.helpers import rel_norm

from .helpers import TOL

pytestmark = pytest.mark.usefixtures("xla")


def _cpu(*tensors):
    torch_xla.sync()
    return [t.detach().cpu() for t in tensors]


def test_snapshot_restores_the_xla_generator(xla):
    x = torch.ones(64, 64, device=xla.device)
    snap = get_rng_state()
    assert isinstance(snap.device, int)  # the XLA seed, not None as on a CPU-only run
    first = F.dropout(x, 0.5, True)
    second = F.dropout(x, 0.5, True)
    set_rng_state(snap)
    replay = F.dropout(x, 0.5, True)
    first, second, replay = _cpu(first, second, replay)
    assert torch.equal(first, replay)
    assert not torch.equal(first, second)
    assert 0.4 < (first == 0).float().mean() < 0.6


def test_tensor_parallel_stream_on_xla(xla):
    tracker = nc.get_rng_tracker()
    draws = []
    for _ in range(2):
        nc.model_parallel_manual_seed(1234)
        outside = torch.rand(16, device=xla.device)
        with tracker.fork():
            inside = torch.rand(16, device=xla.device)
        after = torch.rand(16, device=xla.device)
        draws.append(_cpu(outside, inside, after))
    (o1, i1, a1), (o2, i2, a2) = draws
    assert torch.equal(o1, o2) and torch.equal(i1, i2) and torch.equal(a1, a2)  # reseeding reproduces
    assert not torch.equal(o1, i1) and not torch.equal(a1, i1)  # the TP stream is its own
    assert not torch.equal(o1, a1)  # the default stream advanced past the fork


def _dropout_block(x, w):
    return F.dropout(torch.tanh(x @ w), 0.3, True) @ w


def test_recomputed_dropout_replays_the_forward_mask(xla):
    g = torch.Generator().manual_seed(0)
    x0, w0 = torch.randn(16, 16, generator=g), torch.randn(16, 16, generator=g)
    grads = []
    for recompute in (False, True):
        x, w = x0.to(xla.device).requires_grad_(), w0.to(xla.device).requires_grad_()
        xm.set_rng_state(7)  # same seed, so both variants draw the same forward mask
        out = checkpoint(_dropout_block, x, w) if recompute else _dropout_block(x, w)
        out.pow(2).sum().backward()
        grads.append(_cpu(out, x.grad, w.grad))
    for a, b in zip(*grads):
        assert rel_norm(a, b) < TOL


def test_core_attention_dropout_gradient(xla):
    """With ``v`` the identity, the attention output IS the dropped-out probabilities, which
    reveals the mask XLA drew; the CPU reference applies that mask with plain autograd."""
    s = d = 8
    p = 0.25
    g = torch.Generator().manual_seed(0)
    q0, k0 = torch.randn(s, 1, d, generator=g), torch.randn(s, 1, d, generator=g)
    v0 = torch.eye(s).unsqueeze(1)  # [s, b=1, d]: v[j, 0, :] = e_j
    attn = CoreAttention(1, 1, d, attention_dropout=p)
    nc.model_parallel_manual_seed(3)
    q, k, v = (t.to(xla.device).requires_grad_() for t in (q0, k0, v0))
    out = attn(q, k, v)
    out.sum().backward()
    out, dq, dk = _cpu(out, q.grad, k.grad)

    qr, kr = q0.clone().requires_grad_(), k0.clone().requires_grad_()
    scores = (qr[:, 0] @ kr[:, 0].T) / d**0.5
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    keep = (out[:, 0] != 0).float()
    ref = torch.softmax(scores, -1) * keep / (1 - p)
    assert rel_norm(out[:, 0], ref) < TOL  # the forward is right
    ref.sum().backward()
    assert rel_norm(dq, qr.grad) < TOL and rel_norm(dk, kr.grad) < TOL
