"""The five parallel dimensions laid out by one function: TP, CP, DP, PP (dense grid) and expert
TP, EP, expert DP (expert grid), against the formulas and Megatron's own examples."""

import itertools

import pytest
import torch

import neuron_ckpt as nc
from neuron_ckpt.distributed import collectives
from neuron_ckpt.distributed.layout import parallel_layout
from neuron_ckpt.distributed.local import LocalWorld

KINDS = ("tp", "cp", "dp", "dp_cp", "pp", "ep", "edp", "etp")


def _partition(groups, world):
    return sorted(r for g in groups for r in g) == list(range(world))


@pytest.mark.parametrize("t, c, d, p", list(itertools.product((1, 2), (1, 2, 3), (1, 2), (1, 2))))
def test_dense_grid_is_tp_then_cp_then_dp_then_pp(t, c, d, p):
    world = t * c * d * p
    layout = parallel_layout(world, t, p, context_parallel_size=c)
    assert layout.data_parallel_size == d
    for pp, dp, cp, tp in itertools.product(range(p), range(d), range(c), range(t)):
        rank = pp * d * c * t + dp * c * t + cp * t + tp
        assert layout.tp[(pp * d + dp) * c + cp][tp] == rank
        assert layout.cp[(pp * d + dp) * t + tp][cp] == rank
        assert layout.dp[(pp * c + cp) * t + tp][dp] == rank
        assert layout.pp[(dp * c + cp) * t + tp][pp] == rank
        assert rank in layout.dp_cp[pp * t + tp]  # every (dp, cp) of one (pp, tp)
    for kind in KINDS:
        assert _partition(getattr(layout, kind), world), kind
    assert all(len(g) == d * c for g in layout.dp_cp)


def test_megatron_examples():
    # Megatron's parallel_state docstring: 8 GPUs, tp 4, cp 2.
    assert parallel_layout(8, 4, context_parallel_size=2).cp == ((0, 4), (1, 5), (2, 6), (3, 7))
    # Megatron's RankGenerator on world 8, TP 2, EP 4, ETP 1: EP holds the attention TP pairs.
    layout = parallel_layout(8, 2, expert_model_parallel_size=4)
    assert layout.ep == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert layout.edp == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert layout.etp == tuple((r,) for r in range(8))
    assert layout.expert_data_parallel_size == 2


@pytest.mark.parametrize(
    "t, c, d, p, e", [(1, 1, 4, 1, 2), (2, 1, 2, 1, 2), (1, 2, 2, 1, 4), (2, 2, 1, 2, 4), (1, 1, 8, 2, 8)]
)
def test_expert_grid_is_carved_from_each_stage(t, c, d, p, e):
    world = t * c * d * p
    layout = parallel_layout(world, t, p, context_parallel_size=c, expert_model_parallel_size=e)
    stage = world // p
    for group in layout.ep + layout.edp:  # inside one pipeline stage
        assert len({r // stage for r in group}) == 1
    assert all(g == tuple(range(g[0], g[0] + e)) for g in layout.ep)  # contiguous (etp 1)
    assert layout.expert_data_parallel_size == world // (e * p)
    for ep, edp in itertools.product(layout.ep, layout.edp):  # an EP and an expert-DP group meet once
        assert len(set(ep) & set(edp)) <= 1


def test_without_cp_and_ep_the_new_kinds_are_the_old_groups():
    layout = parallel_layout(8, 2, 2)
    assert layout.dp_cp == layout.dp and layout.edp == layout.dp and layout.etp == layout.tp
    assert layout.cp == tuple((r,) for r in range(8)) and layout.ep == layout.cp
    assert layout.expert_tensor_parallel_size == 2


@pytest.mark.parametrize("kwargs, message", [
    (dict(world_size=8, tensor_parallel_size=2, context_parallel_size=3),
     "tensor_parallel_size=2 x context_parallel_size=3 = 6 does not divide the world size 8"),
    (dict(world_size=8, context_parallel_size=0), "context_parallel_size must be a positive integer"),
    (dict(world_size=8, expert_model_parallel_size=3), "expert_model_parallel_size=3 does not divide the 8 ranks"),
    (dict(world_size=8, pipeline_parallel_size=2, expert_model_parallel_size=8),
     "does not divide the 4 ranks of a pipeline stage"),
    (dict(world_size=8, tensor_parallel_size=2, expert_model_parallel_size=2, expert_tensor_parallel_size=2),
     "expert_tensor_parallel_size must be 1"),
    (dict(world_size=8, tensor_parallel_size=2, expert_tensor_parallel_size=1),
     "expert_tensor_parallel_size must be 2"),
    (dict(world_size=8, expert_model_parallel_size=True), "expert_model_parallel_size must be a positive integer"),
])  # fmt: skip
def test_sizes_that_do_not_fit_are_refused_in_one_line(kwargs, message):
    with pytest.raises(ValueError, match=message) as e:
        parallel_layout(**kwargs)
    assert "\n" not in str(e.value)


def _groups_at_run_time(t: int, c: int, e: int) -> dict:
    made = []
    new_group = torch.distributed.new_group

    def counting(*args, **kwargs):
        made.append(args[0] if args else kwargs.get("ranks"))
        return new_group(*args, **kwargs)

    torch.distributed.new_group = counting
    try:
        state = nc.initialize_model_parallel(t, context_parallel_size=c, expert_model_parallel_size=e)
    finally:
        torch.distributed.new_group = new_group
    rank = torch.distributed.get_rank()
    sums = {}
    for kind in ("tp", "cp", "dp", "dp_cp", "ep", "edp", "etp"):
        group = getattr(state, kind)
        if group is not None:  # each group really talks to the ranks it lists
            sums[kind] = int(collectives.all_reduce(torch.tensor([2**rank]), group).item())
    out = {
        "sums": sums,
        "new_groups": len(made),
        "sizes": (state.tp_size, state.cp_size, state.dp_size, state.ep_size, state.edp.size),
        "shared": (state.dp_cp is state.dp, state.edp is state.dp_cp, state.etp is state.tp),
    }
    nc.destroy_model_parallel()
    return out


def test_groups_at_run_time_match_the_layout():
    with LocalWorld(world_size=4) as world:
        for t, c, e in ((2, 1, 1), (1, 2, 2), (2, 2, 1), (2, 1, 2)):
            layout = parallel_layout(4, t, context_parallel_size=c, expert_model_parallel_size=e)
            results = world.run(_groups_at_run_time, t, c, e)
            for rank, r in enumerate(results):
                for kind, total in r["sums"].items():
                    (mine,) = [g for g in getattr(layout, kind) if rank in g]
                    assert total == sum(2**q for q in mine), (t, c, e, kind)
                etp = t if e == 1 else 1
                assert r["sizes"] == (t, c, 4 // (t * c), e, 4 // (etp * e))
                # a kind with the rank lists of another shares its communicator
                assert r["shared"] == (layout.dp_cp == layout.dp, layout.edp == layout.dp_cp, layout.etp == layout.tp)
            # Without CP and EP no communicator beyond TP's and DP's: TP 2 at world 4 makes 2 + 2.
            if (c, e) == (1, 1):
                assert results[0]["new_groups"] == 4
        # Initialising again in the same world reuses every communicator: a worker that runs many
        # tests makes each process group (three gloo threads) once, not once per test.
        for t, c, e in ((2, 1, 1), (1, 2, 2), (2, 2, 1), (2, 1, 2)):
            assert all(r["new_groups"] == 0 for r in world.run(_groups_at_run_time, t, c, e)), (t, c, e)
