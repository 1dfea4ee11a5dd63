"""The expert-parallel dispatch XLA runs (neuron_ckpt/parallel/experts/all_gather.py) on XLA:CPU at
world size 1, with transformers' Mixtral experts on ``batched_mm`` (the implementation that lowers).

* Dropless, the dispatch and combine around the experts equal the experts called on the tokens
  directly (output and every gradient); with a capacity factor the XLA step equals the same code
  on the eager CPU, drops and all, and the drop count is what the routing says.
* Static shapes: two steps with different routings (and different drops) run one compiled graph
  each, the same one: no shape depends on the routing, no host sync is needed.
* Lowered over an EP group (a world-1 group made to look like two, as tests_xla's collectives
  test does): the step's graph holds an all-gather and a reduce-scatter and no all-to-all (trn1 has
  none); the uneven all-to-all is refused on XLA in one line, and ``ExpertDispatch()`` picks the
  all-gather form there.
"""

from __future__ import annotations

import pytest
import torch
import torch_xla
import torch_xla.debug.metrics as met
import transformers

from neuron_ckpt.distributed import collectives as C
from neuron_ckpt.distributed.parallel_state import Group
from neuron_ckpt.parallel.experts import ExpertDispatch, all_gather
from tests_xla.helpers import TOL, hlo

pytestmark = pytest.mark.usefixtures("xla")
E, T, K, H = 4, 24, 2, 32
ONE = Group(process_group=None, ranks=(0,), replica_groups=((0,),), rank=0)


def experts_module(device):
    config = transformers.MixtralConfig(hidden_size=H, intermediate_size=16, num_local_experts=E, num_experts_per_tok=K)
    torch.manual_seed(0)
    experts = transformers.models.mixtral.modeling_mixtral.MixtralExperts(config)
    torch.nn.init.normal_(experts.gate_up_proj, std=0.2), torch.nn.init.normal_(experts.down_proj, std=0.2)
    experts.config._experts_implementation = "batched_mm"
    return experts.to(device)


def routing(seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    index = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    index[: T // 2, 0] = 0  # half the tokens to expert 0: over a small capacity
    index[: T // 2, 1] = torch.where(index[: T // 2, 1] == 0, 1, index[: T // 2, 1])
    w = torch.softmax(torch.randn(T, K, generator=g), -1)
    return x, index, w, torch.randn(T, H, generator=g)


def step(device, seed: int, capacity_factor: float | None, group: Group = ONE, through_dispatch: bool = True):
    """Output, gradients (x, w, the experts' weights) and drop count of one dispatch step."""
    experts = experts_module(device)
    x, index, w, upstream = (t.to(device) for t in routing(seed))
    x.requires_grad_(), w.requires_grad_()
    dropped = None
    if through_dispatch:
        capacity = ExpertDispatch("all_gather", capacity_factor).capacity(T * group.size, K, E)
        routed, trip = all_gather.dispatch(x, index, w, E, group, capacity)
        y = all_gather.combine(experts(routed.rows, routed.experts[:, None], routed.weights[:, None]), trip)
        dropped = trip.dropped
    else:
        y = experts(x, index, w)
    (y * upstream[: y.shape[0]]).sum().backward()
    return [y, x.grad, w.grad, experts.gate_up_proj.grad, experts.down_proj.grad], dropped


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().cpu().double(), b.detach().cpu().double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def test_dropless_dispatch_equals_the_experts_on_xla(xla):
    got, dropped = step(xla.device, 1, None)
    direct, _ = step(xla.device, 1, None, through_dispatch=False)
    torch_xla.sync()
    assert int(dropped.cpu()) == 0
    for a, b in zip(got, direct):
        assert _rel(a, b) < TOL


def _expected_drops(seed: int, capacity: int) -> int:
    _, index, _, _ = routing(seed)
    counts = torch.bincount(index.reshape(-1), minlength=E)
    return int((counts - capacity).clamp(min=0).sum())


def test_capacity_on_xla_equals_the_cpu_and_counts_the_drops(xla):
    got, dropped = step(xla.device, 1, 0.5)
    ref, ref_dropped = step("cpu", 1, 0.5)
    torch_xla.sync()
    capacity = ExpertDispatch("all_gather", 0.5).capacity(T, K, E)
    assert int(dropped.cpu()) == int(ref_dropped) == _expected_drops(1, capacity) > 0
    for a, b in zip(got, ref):
        assert _rel(a, b) < TOL


def test_different_routings_run_one_graph(xla):
    counts = []
    for seed in (1, 2, 3):
        got, dropped = step(xla.device, seed, 0.5)
        torch_xla.sync()
        counts.append(int(dropped.cpu()))
        if seed == 1:
            compiled = met.metric_data("CompileTime")[0]
    assert met.metric_data("CompileTime")[0] == compiled, "a routing changed a shape: the step recompiled"
    assert len(set(counts)) > 1, counts  # the routings did differ, drops and all


def test_over_an_ep_group_it_lowers_to_all_gather_and_reduce_scatter(xla):
    looks_like_two = Group(process_group=None, ranks=(0, 0), replica_groups=((0,),), rank=0)
    experts = experts_module(xla.device)
    x, index, w, _ = (t.to(xla.device) for t in routing(1))
    capacity = ExpertDispatch("all_gather").capacity(T * 2, K, E)
    routed, trip = all_gather.dispatch(x, index, w, E, looks_like_two, capacity)
    y = all_gather.combine(experts(routed.rows, routed.experts[:, None], routed.weights[:, None]), trip)
    text = hlo(y, trip.dropped)
    assert "all-gather(" in text and "reduce-scatter(" in text and "all-to-all(" not in text
    with pytest.raises(ValueError) as refused:
        C.all_to_all(x, looks_like_two, [T, 0], [T // 2, T // 2])
    assert "XLA has no uneven all-to-all" in str(refused.value) and "\n" not in str(refused.value)
    assert ExpertDispatch().resolved_form() == "all_gather"
