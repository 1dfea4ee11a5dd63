"""Context parallelism on XLA: its collectives are an all-gather and a reduce-scatter, nothing else.

trn1 runs no send/recv (aws-neuron-sdk#1189) and no all-to-all (#1142), so the CP attention must
lower to all-gathers and reduce-scatters only. At world size 1 a CP group is made to look like
two ranks (``ranks=(0, 0)``, replica groups ``[[0]]``, as tests_xla/test_collectives_xla.py does);
XLA's all-gather over that one-replica group returns its input, so it is stood in for by the real
``xm.all_gather`` followed by a copy of its result (the shape two ranks give, and the real HLO
op in the graph). The same stand-ins on eager CPU (rank 0's rows twice; reduce-scatter keeps the
first half) give the numerical reference.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch_xla
import torch_xla.core.xla_model as xm

from neuron_ckpt.distributed import collectives as C
from neuron_ckpt.distributed.parallel_state import Group
from neuron_ckpt.parallel import CoreAttention

from .helpers import TOL, hlo

pytestmark = pytest.mark.usefixtures("xla")
NO_GO = ("all-to-all", "collective-permute", "send(", "recv(")


def _looks_like_two() -> Group:
    return Group(process_group=None, ranks=(0, 0), replica_groups=((0,),), rank=0)


@pytest.fixture
def two_rank_all_gather(monkeypatch):
    real = xm.all_gather

    def gather(x, dim=0, groups=None, pin_layout=True, **kw):
        one = real(x, dim=dim, groups=groups, pin_layout=pin_layout, **kw)
        return torch.cat([one, one], dim=dim)

    monkeypatch.setattr(xm, "all_gather", gather)


def _inputs(a: int, g: int, d: int = 8, s: int = 8, b: int = 2):
    gen = torch.Generator().manual_seed(a + 10 * g)
    q, k, v = (torch.randn(s, b, n * d, generator=gen) for n in (a, g, g))
    return q, k, v, torch.randn(s, b, a * d, generator=gen)


def _eager_reference(monkeypatch, layer: CoreAttention, q, k, v, gout):
    """The same layer on eager CPU, through the stand-ins for two ranks (module docstring)."""
    with monkeypatch.context() as m:
        m.setattr(C, "all_gather", lambda x, dim, group: torch.cat([x, x], dim=dim))
        m.setattr(C, "reduce_scatter", lambda x, dim, group: x.chunk(2, dim=dim)[0])
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = layer(*leaves)
        out.backward(gout)
    return [out.detach()] + [t.grad for t in leaves]


@pytest.mark.parametrize("implementation", ["explicit", "flash"])
@pytest.mark.parametrize("a, g", [(4, 2), (2, 1)])
def test_cp_attention_lowers_to_all_gather_and_reduce_scatter_only(
    xla, two_rank_all_gather, monkeypatch, implementation, a, g
):
    """Forward: one all-gather of K and V. Backward: the gradients' graph holds the all-gather
    again behind an optimization barrier (the regather: the gathered K, V are not kept) and one
    reduce-scatter of dK, dV. Values equal eager CPU's through the same stand-ins."""
    torch_xla.sync()  # XLA chains collectives through a token: nothing earlier may be pending
    layer = CoreAttention(a, g, 8, implementation=implementation, context_parallel_group=_looks_like_two())
    q, k, v, gout = _inputs(a, g)
    leaves = [t.to(xla.device).requires_grad_() for t in (q, k, v)]
    with warnings.catch_warnings():  # flash: the NKI kernel cannot take a chunk against a key prefix
        warnings.simplefilter("ignore")
        out = layer(*leaves)
    forward = hlo(out)
    assert forward.count("all-gather(") == 1 and "reduce-scatter(" not in forward, forward
    out.backward(gout.to(xla.device))
    backward = hlo(*(t.grad for t in leaves))
    assert backward.count("all-gather(") == 2 and backward.count("reduce-scatter(") == 1, backward
    assert "opt-barrier" in backward
    assert not [op for op in NO_GO if op in forward + backward]
    got = [out] + [t.grad for t in leaves]
    torch_xla.sync()
    want = _eager_reference(monkeypatch, layer, q, k, v, gout)
    for x, y in zip(got, want):
        assert ((x.cpu() - y).norm() / y.norm()).item() < TOL


def test_the_tutorial_takes_cp_on_xla_and_the_layout_decides(xla, tmp_path):
    """``--cp`` is not refused on XLA (``--pp`` is): a CP degree the world cannot hold is refused
    by the layout, in one line, before any work."""
    from tests.tutorial_run import tiny_run_files, train_error

    argv = tiny_run_files(tmp_path) + ["--max-steps", "1", "--cp", "2"]
    message = train_error(argv)
    assert "does not divide the world size 1" in message and "context_parallel_size=2" in message
