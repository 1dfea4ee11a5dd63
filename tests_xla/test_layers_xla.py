"""Every parallel layer at t = 1 on the XLA device equals the same layer run eagerly on the CPU.

One module is built on the CPU from a seed and copied to the XLA device; the same input and the
same output weighting go through both; the output and the gradients of the inputs and of every
parameter are compared in fp32 (tolerance: see ``helpers.TOL``). At t = 1 the collectives are
no-ops (their lowering is checked in test_collectives_xla.py); what this checks is that each
layer's forward and its custom backward trace and lower on XLA and compute the same numbers.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch_xla

from neuron_ckpt.parallel import (
    ColumnParallelLinear,
    CoreAttention,
    QKVParallelLinear,
    RMSNorm,
    RowParallelLinear,
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
)
from tests.helpers import rel_norm

from .helpers import TOL

pytestmark = pytest.mark.usefixtures("xla")
S, B, H = 8, 2, 16


def randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def run(module: torch.nn.Module, inputs: list[torch.Tensor], device) -> tuple[list[torch.Tensor], list, dict]:
    """Outputs, input gradients and parameter gradients of ``sum_i (out_i * w_i)``, on ``device``."""
    # The parallel state (process groups) is shared, not copied.
    shared = {
        id(m.parallel_state): m.parallel_state
        for m in module.modules()
        if getattr(m, "parallel_state", None) is not None
    }
    module = copy.deepcopy(module, memo=shared).to(device)
    xs = [x.detach().clone().to(device).requires_grad_(x.is_floating_point()) for x in inputs]
    outs = module(*xs)
    outs = list(outs) if isinstance(outs, tuple) else [outs]
    loss = sum((o * randn(*o.shape, seed=100 + i).to(device)).sum() for i, o in enumerate(outs))
    loss.backward()
    if device.type == "xla":
        torch_xla.sync()
    return (
        [o.detach().cpu() for o in outs],
        [x.grad.cpu() if x.grad is not None else None for x in xs],
        {n: p.grad.cpu() for n, p in module.named_parameters()},
    )


def check_same(module: torch.nn.Module, inputs: list[torch.Tensor], xla) -> None:
    cpu_out, cpu_dx, cpu_dp = run(module, inputs, torch.device("cpu"))
    xla_out, xla_dx, xla_dp = run(module, inputs, xla.device)
    errors = {f"out{i}": rel_norm(a, b) for i, (a, b) in enumerate(zip(xla_out, cpu_out))}
    errors |= {f"d_in{i}": rel_norm(a, b) for i, (a, b) in enumerate(zip(xla_dx, cpu_dx)) if b is not None}
    errors |= {f"d_{n}": rel_norm(xla_dp[n], g) for n, g in cpu_dp.items()}
    assert cpu_dp, "the layer has no parameters with gradients"
    assert max(errors.values()) < TOL, errors


@pytest.mark.parametrize("sequence_parallel", [False, True])
@pytest.mark.parametrize("gather_output", [False, True])
def test_column_parallel_linear(xla, sequence_parallel, gather_output):
    torch.manual_seed(0)
    layer = ColumnParallelLinear(H, 24, gather_output=gather_output, sequence_parallel=sequence_parallel)
    with torch.no_grad():
        layer.bias.normal_()
    check_same(layer, [randn(S, B, H, seed=1)], xla)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_row_parallel_linear(xla, sequence_parallel):
    torch.manual_seed(0)
    layer = RowParallelLinear(24, H, sequence_parallel=sequence_parallel)
    with torch.no_grad():
        layer.bias.normal_()
    check_same(layer, [randn(S, B, 24, seed=1)], xla)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_vocab_parallel_embedding(xla, sequence_parallel):
    torch.manual_seed(0)
    layer = VocabParallelEmbedding(40, H, sequence_parallel=sequence_parallel)
    ids = torch.randint(0, 40, (S, B), generator=torch.Generator().manual_seed(3))
    check_same(layer, [ids], xla)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_rms_norm(xla, sequence_parallel):
    layer = RMSNorm(H, sequence_parallel=sequence_parallel)
    with torch.no_grad():
        layer.weight.normal_()
    check_same(layer, [randn(S, B, H, seed=1)], xla)


@pytest.mark.parametrize("num_kv_heads", [4, 2])
def test_qkv_parallel_linear(xla, num_kv_heads):
    torch.manual_seed(0)
    layer = QKVParallelLinear(H, num_heads=4, num_kv_heads=num_kv_heads, bias=True, sequence_parallel=True)
    with torch.no_grad():
        for b in (layer.q_bias, layer.k_bias, layer.v_bias):
            b.normal_()
    check_same(layer, [randn(S, B, H, seed=1)], xla)


class _Attention(torch.nn.Module):
    """CoreAttention has no parameters: give it a scale to carry a parameter gradient."""

    def __init__(self, implementation: str, kv_heads: int):
        super().__init__()
        self.core = CoreAttention(4, kv_heads, 8, implementation=implementation)
        self.scale = torch.nn.Parameter(torch.tensor(0.7))

    def forward(self, q, k, v):
        return self.core(q * self.scale, k, v)


@pytest.mark.parametrize("implementation", ["explicit", "flash"])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_core_attention(xla, implementation, kv_heads):
    q, k, v = randn(S, B, 32, seed=1), randn(S, B, kv_heads * 8, seed=2), randn(S, B, kv_heads * 8, seed=3)
    check_same(_Attention(implementation, kv_heads), [q, k, v], xla)


class _CrossEntropy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.logits = torch.nn.Parameter(randn(S, B, 40, seed=5))

    def forward(self, target):
        return vocab_parallel_cross_entropy(self.logits, target, ignore_index=-100)


def test_vocab_parallel_cross_entropy(xla):
    target = torch.randint(0, 40, (S, B), generator=torch.Generator().manual_seed(4))
    target[0, 0] = target[3, 1] = -100
    check_same(_CrossEntropy(), [target], xla)
    # and both equal the dense loss
    ce = _CrossEntropy()
    dense = torch.nn.functional.cross_entropy(ce.logits.detach().reshape(-1, 40), target.reshape(-1))
    assert rel_norm(ce.to(xla.device)(target.to(xla.device)), dense) < TOL
