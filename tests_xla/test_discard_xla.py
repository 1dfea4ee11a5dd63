"""Output-discarding recompute on XLA: the consumer's backward reads the recomputed output, which
is computed from inputs that passed the optimization barrier, so the compiler's
common-subexpression elimination cannot merge it back into the forward; gradients equal the plain
ones, and applied to layers (``norm`` and ``mlp_act`` with attention dropout) the loss is bit for
bit the plain one. What the Neuron compiler then schedules has not been run here (no Trainium).
"""

from __future__ import annotations

import pytest
import torch
import torch_xla

from neuron_ckpt.parallel import RMSNorm
from neuron_ckpt.recompute import RecomputeConfig, checkpoint_without_output, discard, discard_outputs
from tests.helpers import rel_norm

from .helpers import TOL, hlo
from .test_recompute_xla import _train_step

pytestmark = pytest.mark.usefixtures("xla")


def _norm_then_linear(device, discard_it: bool) -> tuple[str, list[torch.Tensor]]:
    torch.manual_seed(0)
    norm, proj = RMSNorm(16, device=device), torch.nn.Linear(16, 8).to(device)
    x = torch.randn(8, 2, 16).to(device).requires_grad_()
    with discard_outputs():
        h = checkpoint_without_output(norm, x) if discard_it else norm(x)
        out = proj(h)
    out.pow(2).sum().backward()
    grads = [x.grad, norm.weight.grad, proj.weight.grad]
    text = hlo(*grads)
    torch_xla.sync()
    return text, grads


def test_the_rerun_is_fenced_and_gradients_equal_plain_ones(xla):
    plain, plain_grads = _norm_then_linear(xla.device, False)
    text, grads = _norm_then_linear(xla.device, True)
    assert "opt-barrier(" not in plain and "opt-barrier(" in text
    # The norm's 1/rms is computed again in backward (once for the linear's weight gradient).
    assert text.count("rsqrt(") > plain.count("rsqrt(")
    for a, b in zip(grads, plain_grads):
        assert rel_norm(a, b) < TOL


def test_without_the_barrier_the_graph_has_none(xla, monkeypatch):
    monkeypatch.setattr(discard, "_xla_barrier", lambda tensors, modules: None)
    text, _ = _norm_then_linear(xla.device, True)
    assert "opt-barrier(" not in text


def test_applied_norm_discarding_replays_dropout_behind_the_barrier(xla):
    base = _train_step(xla.device, RecomputeConfig())
    loss, grads, text = _train_step(xla.device, RecomputeConfig(granularity="selective", modules=["core_attn", "norm"]))
    assert "opt-barrier" in text
    assert torch.equal(loss, base[0])
    # fp32 rounding only (the fenced backward fuses differently), as for the other recompute tests.
    assert max(rel_norm(a, b) for a, b in zip(grads, base[1])) < 1e-6
