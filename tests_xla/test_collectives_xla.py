"""The XLA branch of the collectives lowers to HLO collectives.

At world size 1 the library's collectives short-circuit (a group of one is a no-op), so the XLA
branch is reached with a world-1 group *made to look like* size 2: ``ranks=(0, 0)`` but replica
groups ``[[0]]``, the only replica group a one-process XLA:CPU world has. The numbers such a
group computes mean nothing; what is checked is that each call lowers to its HLO op with the
replica groups passed through (Neuron compiles those same ops into NeuronCore collectives). The
real world-1 ops through ``xm`` are checked to lower and to compute the identity.
"""

from __future__ import annotations

import pytest
import torch
import torch_xla
import torch_xla.core.xla_model as xm

from neuron_ckpt.distributed import collectives as C
from neuron_ckpt.distributed.mappings import copy_to_tensor_parallel_region, reduce_from_tensor_parallel_region
from neuron_ckpt.distributed.parallel_state import Group

from .helpers import hlo

pytestmark = pytest.mark.usefixtures("xla")


@pytest.fixture
def always_all_reduce(monkeypatch):
    # xm.all_reduce returns its input unchanged at world size 1 unless told otherwise.
    monkeypatch.setenv("XLA_ALWAYS_ALLREDUCE", "1")


def _looks_like_two() -> Group:
    return Group(process_group=None, ranks=(0, 0), replica_groups=((0,),), rank=0)


def test_xm_collectives_with_replica_group_of_one_lower_and_are_identity(xla, always_all_reduce):
    x = torch.randn(4, 6).to(xla.device)
    ag = xm.all_gather(x, dim=0, groups=[[0]], pin_layout=False)
    ar = xm.all_reduce(xm.REDUCE_SUM, x, groups=[[0]])
    rs = xm.reduce_scatter(xm.REDUCE_SUM, x, scale=1.0, scatter_dim=0, shard_count=1, groups=[[0]], pin_layout=False)
    text = hlo(ag, ar, rs)
    for op in ("all-gather(", "all-reduce(", "reduce-scatter("):
        assert op in text, f"{op} missing from\n{text}"
    assert "replica_groups={{0}}" in text
    torch_xla.sync()
    for y in (ag, ar, rs):
        assert torch.equal(y.cpu(), x.cpu())


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_library_collectives_take_the_xla_branch(xla, always_all_reduce, dim):
    group = _looks_like_two()
    x = torch.randn(4, 6, 8).to(xla.device)
    gathered = C.all_gather(x, dim, group)
    reduced = C.all_reduce(x, group)
    scattered = C.reduce_scatter(x, dim, group)
    assert scattered.shape[dim % 3] == x.shape[dim % 3] // 2  # shard_count = group size
    text = hlo(gathered, reduced, scattered)
    for op in ("all-gather(", "all-reduce(", "reduce-scatter("):
        assert op in text, f"{op} missing from\n{text}"
    assert f"dimensions={{{dim % 3}}}" in text  # gathered / scattered along the dim asked for


def test_autograd_mappings_put_the_all_reduce_on_the_conjugate_side(xla, always_all_reduce):
    group = _looks_like_two()
    x = torch.randn(4, 6).to(xla.device).requires_grad_()
    y = copy_to_tensor_parallel_region(x, group)  # identity forward, all-reduce backward
    assert "all-reduce(" not in hlo(y)
    y.sum().backward()
    assert "all-reduce(" in hlo(x.grad)

    z = torch.randn(4, 6).to(xla.device).requires_grad_()
    w = reduce_from_tensor_parallel_region(z, group)  # all-reduce forward, identity backward
    assert "all-reduce(" in hlo(w)
    w.backward(torch.ones_like(w))
    assert "all-reduce(" not in hlo(z.grad)
    torch_xla.sync()
