"""Recompute on XLA: the optimization barrier is in the backward graph, it keeps XLA's
common-subexpression elimination from merging the recompute into the forward, and the
checkpointed gradients equal the plain ones; recompute applied to layers with dropout
(selective, grouped full) gives the same loss and gradients bit for bit, and the non-reentrant
variant is refused.

What XLA:CPU shows and what it cannot: XLA's target-independent ``cse`` pass runs with the
barrier in place; there the recomputed attention scores survive with the barrier (one extra
``dot``) and are merged away without it. XLA:CPU then strips barriers (``cse_barrier_expander``)
and runs CSE again: in this small probe its final executable has merged the recompute either way;
in a whole Llama step (``scripts/xla_memory_slope.py``) the recomputed matmuls survive but the
scheduler, free of the barrier, runs them in the forward, before the peak. Either way memory
savings from recompute cannot be seen on XLA:CPU (docs/memory.md, "Checking the model against a
device"). Whether the Neuron compiler keeps the recompute in the backward has not been run here
(no Trainium).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch_xla

import neuron_ckpt as nc
from neuron_ckpt.parallel import CoreAttention, QKVParallelLinear, RMSNorm, RowParallelLinear
from neuron_ckpt.recompute import RecomputeConfig, activation_checkpoint, apply_recompute, checkpoint, run_layers
from tests.helpers import rel_norm

from .helpers import TOL, hlo

pytestmark = pytest.mark.usefixtures("xla")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _qkv(device):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(16, 2, n * 8, generator=g).to(device).requires_grad_() for n in (4, 2, 2)]


def _backward_hlo(device, use_checkpoint: bool) -> tuple[str, list[torch.Tensor]]:
    attn = CoreAttention(4, 2, 8)
    q, k, v = _qkv(device)
    out = checkpoint(attn, q, k, v) if use_checkpoint else attn(q, k, v)
    out.pow(2).sum().backward()
    grads = [q.grad, k.grad, v.grad]
    text = hlo(*grads)
    torch_xla.sync()
    return text, grads


def test_backward_graph_has_the_barrier_and_the_recompute(xla):
    plain, _ = _backward_hlo(xla.device, use_checkpoint=False)
    recomputed, _ = _backward_hlo(xla.device, use_checkpoint=True)
    assert "opt-barrier(" not in plain
    assert "opt-barrier(" in recomputed
    # The scores QK^T and the softmax exp appear a second time (the recompute) before optimisation.
    assert recomputed.count(" dot(") == plain.count(" dot(") + 1
    assert recomputed.count("exponential(") == plain.count("exponential(") + 1


def test_without_the_barrier_the_graph_has_none(xla, monkeypatch):
    monkeypatch.setattr(activation_checkpoint, "_xla_barrier", lambda tensors, modules: None)
    text, _ = _backward_hlo(xla.device, use_checkpoint=True)
    assert "opt-barrier(" not in text


def test_checkpointed_gradients_equal_plain_ones(xla):
    _, plain = _backward_hlo(xla.device, use_checkpoint=False)
    _, recomputed = _backward_hlo(xla.device, use_checkpoint=True)
    for a, b in zip(recomputed, plain):
        assert rel_norm(a, b) < TOL


def test_barrier_keeps_xla_cse_from_merging_the_recompute(tmp_path):
    # Fails if the barrier is removed from checkpoint (no_barrier is then what barrier gives).
    env = dict(os.environ, PJRT_DEVICE="CPU", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run(
        [sys.executable, "-m", "tests_xla.cse_probe", str(tmp_path)],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    dots = json.loads(out.stdout.strip().splitlines()[-1])
    plain = dots["plain"]["after_first_cse"]
    assert dots["barrier"]["after_first_cse"] == plain + 1, dots  # the recomputed QK^T survives CSE
    assert dots["no_barrier"]["after_first_cse"] == plain, dots  # CSE merged it into the forward


# --- recompute applied to a stack of layers -----------------------------------------------------


class Layer(torch.nn.Module):
    """Norm, QKV, core attention with dropout, output projection, residual."""

    def __init__(self, device):
        super().__init__()
        self.norm, self.qkv = RMSNorm(16, device=device), QKVParallelLinear(16, 4, device=device)
        self.core_attn = CoreAttention(4, 4, 4, attention_dropout=0.1)
        self.proj = RowParallelLinear(16, 16, device=device)

    def forward(self, x):
        q, k, v = self.qkv(self.norm(x))
        return x + self.proj(self.core_attn(q, k, v))


def _train_step(device, config: RecomputeConfig, seed: int = 1):
    """Loss, parameter gradients and the backward HLO of two layers under ``config``."""
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(Layer(device) for _ in range(2))
    apply_recompute(layers, config)
    nc.model_parallel_manual_seed(seed)
    x = torch.randn(8, 2, 16).to(device).requires_grad_()
    loss = run_layers(layers, x).pow(2).sum()
    loss.backward()
    grads = [p.grad for p in layers.parameters()]
    text = hlo(*grads)
    torch_xla.sync()
    return loss.cpu(), [g.cpu() for g in grads], text


@pytest.mark.parametrize(
    "config",
    [RecomputeConfig(granularity="selective"), RecomputeConfig(granularity="full", method="uniform", num_layers=2)],
    ids=["selective", "uniform2"],
)
def test_applied_recompute_replays_dropout_exactly_behind_the_barrier(xla, config):
    base = _train_step(xla.device, RecomputeConfig())
    assert not torch.equal(base[0], _train_step(xla.device, RecomputeConfig(), seed=2)[0])  # dropout is on
    assert "opt-barrier" not in base[2]
    loss, grads, text = _train_step(xla.device, config)
    assert torch.equal(loss, base[0])
    # The recomputed masks are the forward's: a different mask moves these gradients by percents
    # (seed 2 above). XLA fuses the fenced recompute graph differently from the plain one, and the
    # fused RMSNorm's backward reduces in a different order there: fp32 rounding, measured 9e-8.
    assert max(rel_norm(a, b) for a, b in zip(grads, base[1])) < 1e-6
    assert "opt-barrier" in text  # the recompute is fenced off from the forward


def test_non_reentrant_recompute_is_refused_on_xla(xla):
    with pytest.raises(ValueError, match="use_reentrant"):
        RecomputeConfig(granularity="selective", use_reentrant=False).validate(2)


# ---------------------------------------------------------------------------------------------
# The call-pattern matrix of tests/test_checkpoint_patterns.py for the XLA variant (reentrant,
# inputs, incoming gradients and the fenced parameters through the optimization barrier).

from tests import checkpoint_patterns as cp  # noqa: E402


def _xla_outcome(pattern: str, ckpt, device) -> tuple[str, list | str]:
    result = cp.outcome(cp.run, pattern, ckpt, device)
    torch_xla.sync()
    return result


@pytest.mark.parametrize("pattern", list(cp.PATTERNS))
def test_xla_variant_equals_no_recompute(xla, pattern):
    # The device generator here is XLA's: dropout_device_generator draws on the XLA device.
    ref_kind, ref = _xla_outcome(pattern, cp.plain, xla.device)
    kind, got = _xla_outcome(pattern, checkpoint, xla.device)
    assert ref_kind == "ran", ref
    if "double_backward" in pattern:
        # torch_xla's checkpoint is reentrant only: double backward is refused in one line.
        assert kind == "error" and "use use_reentrant=False" in got and "\n" not in got, got
        return
    assert kind == "ran", got
    # A reentrant Function's float outputs all require grad (see tests/test_checkpoint_patterns.py).
    # Every result within 1e-6 of its largest value (outputs and masks measured bit-identical):
    # the barrier splits the backward graph, so XLA fuses fp32 sums in another order (measured:
    # at most 1.2e-7, one ulp; a wrong mask moves a gradient by order 1).
    assert cp.differences(ref, got, pattern != "outputs_without_grad", grad_rtol=1e-6) == []
