"""``rms_norm``, ``swiglu`` and ``masked_softmax`` on the XLA device: the eager CPU numbers, and no op falls back.

Forward output and the gradients of both inputs of ``sum(out * r)``, XLA against eager CPU in
the same process:

- fp32 (activations and weight): ``helpers.TOL``.
- bf16 activations: ``2e-2``. bf16's unit roundoff is ``2^-8 = 3.9e-3``; XLA evaluates
  ``silu`` as ``gate * sigmoid(gate)`` rounding the sigmoid to bf16 first, where ATen's kernel
  rounds once, so the two differ by one to two units (measured up to 4.6e-3, swiglu's gate
  gradient; rms_norm in bf16 came out equal bit for bit). A wrong formula is off by ~1.
  ``masked_softmax`` (causal mask, ``[b, a, s, s]`` scores) is held to the same bounds.

Lowering: ``torch_xla.debug.metrics.executed_fallback_ops()`` (the ops that ran on the CPU
because XLA has no lowering for them) is empty after forward and backward and the graph's HLO
has no ``custom-call``; a control shows the fallback counter sees a fallback (``histc``).
"""

from __future__ import annotations

import pytest
import torch
import torch_xla
import torch_xla.debug.metrics as met

from neuron_ckpt.parallel.attention import masked_score
from neuron_ckpt.parallel.fused_ops import masked_softmax, rms_norm, swiglu
from tests.helpers import rel_norm

from .helpers import TOL, hlo

pytestmark = pytest.mark.usefixtures("xla")
S, B, H = 8, 2, 64
BF16_TOL = 2e-2


def randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def run(fn, inputs: list[torch.Tensor], device) -> tuple[list[torch.Tensor], str]:
    """[out, grads of inputs] of ``sum(fn(*inputs) * r)`` on ``device``, and (XLA) the graph's HLO."""
    leaves = [t.detach().to(device).requires_grad_() for t in inputs]
    out = fn(*leaves)
    (out * randn(*out.shape, seed=100).to(device, out.dtype)).sum().backward()
    results = [out.detach()] + [t.grad for t in leaves]
    text = ""
    if device.type == "xla":
        text = hlo(*results)
        torch_xla.sync()
    return [t.cpu() for t in results], text


def causal_softmax(x: torch.Tensor) -> torch.Tensor:
    mask = torch.ones(x.shape[-1], x.shape[-1], dtype=torch.bool, device=x.device).triu_(1)
    return masked_softmax(x, mask, masked_score(x.dtype))


CASES = {
    "masked_softmax-fp32": (causal_softmax, [3 * randn(B, 4, S, S, seed=4)]),
    "masked_softmax-bf16": (causal_softmax, [(3 * randn(B, 4, S, S, seed=4)).bfloat16()]),
    "rms_norm-fp32": (lambda x, w: rms_norm(x, w, 1e-6), [randn(S, B, H, seed=0), 1 + 0.1 * randn(H, seed=1)]),
    "rms_norm-bf16-fp32weight": (
        lambda x, w: rms_norm(x, w, 1e-6),
        [randn(S, B, H, seed=0).bfloat16(), 1 + 0.1 * randn(H, seed=1)],
    ),
    "rms_norm-bf16": (
        lambda x, w: rms_norm(x, w, 1e-6),
        [randn(S, B, H, seed=0).bfloat16(), (1 + 0.1 * randn(H, seed=1)).bfloat16()],
    ),
    "swiglu-fp32": (swiglu, [3 * randn(S, B, H, seed=2), randn(S, B, H, seed=3)]),
    "swiglu-bf16": (swiglu, [(3 * randn(S, B, H, seed=2)).bfloat16(), randn(S, B, H, seed=3).bfloat16()]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_fused_op_on_xla_equals_eager_cpu_and_lowers_without_fallback(xla, case):
    fn, inputs = CASES[case]
    want, _ = run(fn, inputs, torch.device("cpu"))
    met.clear_all()
    got, text = run(fn, inputs, xla.device)
    assert met.executed_fallback_ops() == []
    assert "custom-call" not in text
    tol = TOL if all(t.dtype == torch.float32 for t in inputs) else BF16_TOL
    for name, a, b in zip(("out", "grad0", "grad1"), got, want):
        assert a.dtype == b.dtype, name
        assert rel_norm(a, b) <= tol, (name, rel_norm(a, b))


def test_control_the_fallback_counter_sees_a_fallback(xla):
    met.clear_all()
    torch.histc(randn(4, 4, seed=0).to(xla.device))
    torch_xla.sync()
    assert met.executed_fallback_ops() != []
