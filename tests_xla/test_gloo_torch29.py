"""The eager (gloo) collectives under the torch of this environment (2.9, the Neuron SDK's),
where the collectives shim falls back to ``all_gather_into_tensor`` / ``reduce_scatter_tensor``;
the main suite runs them under torch 2.13's ``all_gather_single`` / ``reduce_scatter_single``.

This module must not import torch_xla: the spawned gloo workers import it to find the functions.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import neuron_ckpt as nc
from neuron_ckpt.distributed import collectives as C
from neuron_ckpt.distributed.local import run_local
from neuron_ckpt.parallel import ColumnParallelLinear, RowParallelLinear
from tests.helpers import rel_norm


def test_shim_picks_the_names_this_torch_has():
    if hasattr(dist, "all_gather_single"):
        pytest.skip(f"torch {torch.__version__} has all_gather_single: the main suite covers it")
    assert C._all_gather_single is dist.all_gather_into_tensor
    assert C._reduce_scatter_single is dist.reduce_scatter_tensor


def _collectives(world: int) -> dict[str, bool]:
    st = nc.initialize_model_parallel(world)
    r = st.tp_rank
    x = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4) + 100 * r
    everyone = [torch.arange(24, dtype=torch.float32).reshape(2, 3, 4) + 100 * i for i in range(world)]
    ok = {}
    for dim in (0, 1, -1):
        ok[f"all_gather dim {dim}"] = torch.equal(C.all_gather(x, dim, st.tp), torch.cat(everyone, dim))
    total = sum(everyone)
    ok["all_reduce"] = torch.equal(C.all_reduce(x, st.tp), total)
    y = torch.cat([x] * world, dim=1)  # dim 1 divisible by any world size
    ok["reduce_scatter dim 1"] = torch.equal(C.reduce_scatter(y, 1, st.tp), total)
    return ok


def _sequence_parallel_mlp(world: int) -> float:
    """Column (SP all-gather in, reduce-scatter of the input grad) then row (SP reduce-scatter out)
    against the dense computation; returns the worst relative error."""
    st = nc.initialize_model_parallel(world)
    torch.manual_seed(0)
    col = ColumnParallelLinear(8, 16, sequence_parallel=True)
    row = RowParallelLinear(16, 8, sequence_parallel=True)
    w1 = C.all_gather(col.weight.detach(), 0, st.tp).requires_grad_()
    w2 = C.all_gather(row.weight.detach(), 1, st.tp).requires_grad_()
    x = torch.randn(4, 2, 8, generator=torch.Generator().manual_seed(1)).requires_grad_()
    dense = F.linear(F.relu(F.linear(x, w1)), w2)
    dense.pow(2).sum().backward()
    xl = x.detach().chunk(world, 0)[st.tp_rank].clone().requires_grad_()
    out = row(F.relu(col(xl)))
    out.pow(2).sum().backward()

    return max(
        rel_norm(out.detach(), dense.detach().chunk(world, 0)[st.tp_rank]),
        rel_norm(xl.grad, x.grad.chunk(world, 0)[st.tp_rank]),
        rel_norm(col.weight.grad, w1.grad.chunk(world, 0)[st.tp_rank]),
        rel_norm(row.weight.grad, w2.grad.chunk(world, 1)[st.tp_rank]),
    )


@pytest.mark.parametrize("world", [1, 2])
def test_eager_gloo_collectives_under_this_torch(world):
    for ok in run_local(_collectives, world, world):
        assert all(ok.values()), ok


def test_sequence_parallel_layers_on_two_gloo_ranks():
    assert max(run_local(_sequence_parallel_mlp, 2, 2)) < 1e-5
