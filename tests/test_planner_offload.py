"""The planner weighs keep, recompute and offload per layer (issue 48, point 4).

* A layer's backward holds the reload of the nearest earlier offloading layer (the engine's
  prefetch): the budget's activation peak of an offloading config is ``offload_price``'s peak,
  whose pieces tests/test_memory_offload.py measures, and a per-layer list prices what the same
  single config prices.
* The copy time a link leaves exposed, in FLOPs at the device's rate, is the formula of
  :mod:`neuron_ckpt.memory.offload_time`, worked by hand.
* The planner's choice is optimal: a brute force over every per-layer assignment (the last layer
  never offloading) of a tiny Llama at several limits and links finds nothing cheaper that fits,
  and nothing of its cost that moves less.
* Offload wins only where it is cheaper: a plan that fits without recompute moves nothing; at a
  link fast enough to hide every copy, offload replaces recompute; at a slow one, recompute stays.
* ``neuron-ckpt plan --host-link D2H[,H2D] --device-tflops F [--offload-modules ...]``: the plan,
  its exposed copies and pinned host bytes (the host budget's offload moment), refusals in one line.
* ``--recompute-modules``: the planner offers that selective set (any, priced as the memory model
  prices it) instead of the presets' selective ones, beside none and full.
"""

from __future__ import annotations

import argparse
import itertools
import json
from dataclasses import replace

import pytest

from neuron_ckpt.cli import main as cli_main
from neuron_ckpt.memory import ModelShape, TrainingSetup, layer_activation_bytes, memory_budget
from neuron_ckpt.memory.analytic import rotary_terms
from neuron_ckpt.memory.budget import BudgetParts, LineItem
from neuron_ckpt.memory.host import host_budget, offload_room
from neuron_ckpt.memory.offload import layer_offloads, offload_price
from neuron_ckpt.memory.offload_time import HostLink, offload_options
from neuron_ckpt.memory.options import layer_options, per_layer_options, stack_options
from neuron_ckpt.memory.plan_cli import model_from_args
from neuron_ckpt.memory.planner import Choices, NothingFits, evaluate, plan_recompute
from neuron_ckpt.recompute import RecomputeConfig

MODEL = ModelShape("llama", 64, 4, 2, 96, 4, vocab=128)
SETUP = TrainingSetup(64, 2, dtype="bf16", attention="explicit")
SELECTIVE = dict(granularity="selective", modules=["core_attn", "mlp_act", "norm"])
CONFIGS = [
    RecomputeConfig(offload_modules=["mlp"]),
    RecomputeConfig(offload_modules=["norm", "core_attn"]),
    RecomputeConfig(**SELECTIVE, offload_modules=["core_attn", "mlp"]),
    RecomputeConfig("full", method="uniform", num_layers=1, offload_modules=["layer"]),
]


def _reload_peak(model: ModelShape, setup: TrainingSetup, order) -> int:
    """The budget's activation peak of one micro-batch with only the rotary tables around the layers."""
    rotary = sum(t.nbytes for t in rotary_terms(model, setup))
    parts = BudgetParts((), 0, (LineItem("rotary", rotary, "activations", ""),), (), 0, 0)
    return parts.activations([(o, 1) for o in order], 1)[1]


@pytest.mark.parametrize(
    "attention, config",
    [(a, c) for a in ("explicit", "flash") for c in CONFIGS if a == "explicit" or c.granularity != "selective"],
    ids=lambda v: v if isinstance(v, str) else ",".join(v.offload_modules),
)
def test_the_budget_holds_each_backward_s_reload_as_offload_price_does(attention, config):
    setup = replace(SETUP, attention=attention)
    order = stack_options(MODEL, setup, config)
    price = offload_price(MODEL, setup, config)
    assert _reload_peak(MODEL, setup, order) == price.peak != price.peak_without
    assert [o.saved_bytes for o in order] == [x.device for x in price.layers]
    # The same config written per layer (the last without offload) prices the same.
    plain = replace(config, offload_modules=())
    listed = per_layer_options(MODEL, setup, [config] * (MODEL.layers - 1) + [plain], {})
    assert [(o.saved_bytes, o.backward_peak_bytes, o.reload_bytes, o.host_bytes) for o in listed] == [
        (o.saved_bytes, o.backward_peak_bytes, o.reload_bytes, o.host_bytes) for o in order
    ]
    total = memory_budget(MODEL, setup, config).total_bytes
    assert total == memory_budget(MODEL, setup, [config] * (MODEL.layers - 1) + [plain]).total_bytes


def test_a_per_layer_list_copies_the_rotary_tables_once_in_its_first_layer_offload():
    layer = RecomputeConfig("full", method="uniform", num_layers=1, offload_modules=["layer"])
    listed = layer_offloads(MODEL, SETUP, [None, layer, layer, None])
    rotary = sum(t.nbytes for t in rotary_terms(MODEL, SETUP))
    assert [x.host for x in listed] == [0, listed[2].host + rotary, listed[2].host, 0]


def test_the_exposed_copy_time_is_the_copies_beyond_the_compute_they_hide_under():
    link = HostLink(d2h_gbps=20, h2d_gbps=10, tflops=100)
    # 1 GB: 50 ms out and 100 ms back, at 1e14 FLOP/s 5e12 and 1e13 FLOPs of time.
    assert link.exposed_copy_flops(10**9, 2e12) == pytest.approx((5e12 - 2e12) + (1e13 - 4e12))
    assert link.exposed_copy_flops(10**9, 5e12) == pytest.approx(0 + 0)  # forward hides out, backward back
    assert link.exposed_copy_flops(10**9, 3e12) == pytest.approx(2e12 + 4e12)
    with pytest.raises(ValueError, match="h2d_gbps must be a finite number > 0"):
        HostLink(1, 0, 1)


def _brute_force(model, setup, options, base, limit, host_limit=None):
    """The least (cost, host bytes) over every assignment that fits (its pinned blocks within
    ``host_limit``), the last layer from ``base``, priced as the search prices the options
    (``BudgetParts.used``, ``LayerOption.cost``)."""
    parts, best = BudgetParts.of(model, setup), None
    for names in itertools.product(*[options] * (model.layers - 1), base):
        order = [options[n] for n in names]
        if host_limit is not None and sum(o.host_pinned_bytes for o in order) > host_limit:
            continue
        if parts.used([(o, 1) for o in order], 1, "total") <= limit:
            key = (sum(o.cost for o in order), sum(o.host_bytes for o in order))
            best = key if best is None or key < best else best
    return best


@pytest.mark.parametrize("gbps, host", [(0.002, None), (0.02, None), (2.0, None), (2.0, 40_000)])
def test_the_plan_is_the_cheapest_assignment_that_fits(gbps, host):
    model, setup = replace(MODEL, layers=3), SETUP
    modules = ("core_attn", "mlp", "layer")
    offload = Choices(link=HostLink(gbps, gbps, 0.1), offload_modules=modules, host_bytes=host)
    base = layer_options(model, setup)
    options = {**base, **offload_options(model, setup, offload.link, base, offload.offload_modules)}
    assert len(options) > len(base) and (any(o.copy_flops for o in options.values()) or gbps > 1)
    none = evaluate(model, setup, ("none",) * 3, 0, base).budget.total_bytes
    floor = evaluate(model, setup, ("full",) * 3, 0, base).budget.total_bytes
    checked = 0
    for limit in sorted({none, floor, (none + floor) // 2, (3 * none + floor) // 4, floor - 1}):
        expected = _brute_force(model, setup, options, base, limit, host)
        try:
            plan = plan_recompute(model, setup, limit / 2**30, reserve_gib=0, choices=offload)
        except NothingFits:
            assert expected is None
            continue
        order = [plan.options[n] for n in plan.layers]
        got = (sum(o.cost for o in order), sum(o.host_bytes for o in order))
        assert got[0] == pytest.approx(expected[0], rel=1e-12) and got[1] <= expected[1]
        assert plan.fits and plan.layers[-1] in base  # the budget, priced layer by layer, holds no more
        assert host is None or plan.host_pinned_bytes <= host
        checked += 1
    assert checked >= 3


def test_offload_wins_only_where_it_is_cheaper_than_recompute():
    base = plan_recompute(MODEL, SETUP, 1, reserve_gib=0)  # everything fits: nothing to save
    fast = plan_recompute(MODEL, SETUP, 1, reserve_gib=0, choices=Choices(link=HostLink(100, 100, 0.1)))
    assert fast.layers == base.layers == ("none",) * MODEL.layers and fast.host_pinned_bytes == 0
    none = evaluate(MODEL, SETUP, "none", 0).budget.total_bytes
    limit = (none - (none - evaluate(MODEL, SETUP, "full", 0).budget.total_bytes) // 3) / 2**30
    tight = plan_recompute(MODEL, SETUP, limit, reserve_gib=0)
    assert tight.recompute_flops > 0
    hidden = plan_recompute(MODEL, SETUP, limit, reserve_gib=0, choices=Choices(link=HostLink(1e3, 1e3, 1e-3)))
    assert hidden.recompute_flops + hidden.copy_flops < tight.recompute_flops and hidden.copy_flops == 0
    assert hidden.host_pinned_bytes > 0 and "offload" not in hidden.layers[-1]
    slow = plan_recompute(MODEL, SETUP, limit, reserve_gib=0, choices=Choices(link=HostLink(1e-6, 1e-6, 1e3)))
    assert slow.host_pinned_bytes == 0  # copies too slow to hide: recompute stays
    assert slow.recompute_flops == pytest.approx(tight.recompute_flops, rel=1e-12)


def _plan(capsys, *args: str) -> tuple[int, str, str]:
    try:
        code = cli_main(["plan", *args])
    except SystemExit as exc:
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_plan_command_offloads_and_holds_the_pinned_blocks_on_the_host(capsys):
    job = ["--config", "llama3-8b", "--tp", "1", "--dp", "8", "--seq", "4096", "--micro-batch", "2"]
    link = ["--device-memory", "80", "--host-link", "50", "--device-tflops", "400"]
    code, out, _ = _plan(capsys, *job, *link, "--json")
    plan = json.loads(out)
    assert code == 0 and plan["host_pinned_bytes"] > 0 and plan["copy_overhead"] >= 0
    moments = {m["name"]: m for m in plan["host"]["moments"]}
    assert moments["activation offload"]["per_rank_gib"] == round(plan["host_pinned_bytes"] / 2**30, 4)
    assert plan["host"]["instance"] == "p5.48xlarge"
    assert any(r["offload_modules"] for r in plan["recompute"]) and not plan["recompute"][-1]["offload_modules"]
    code, out, _ = _plan(capsys, *job, "--device-memory", "80", "--json")
    assert json.loads(out)["overhead"] > plan["overhead"]  # recompute without the link
    code, out, _ = _plan(capsys, *job, *link)
    assert code == 0 and "offload: copies exposed" in out and "offload_modules=(" in out


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--host-link", "25"], "--host-link: give --device-tflops too"),
        (["--device-tflops", "400"], "--device-tflops: prices activation offload; give --host-link"),
        (["--offload-modules", "mlp"], "--offload-modules: prices activation offload"),
        (["--host-link", "25,x"], "expected D2H[,H2D], GB/s > 0 each"),
        (["--host-link", "25", "--device-tflops", "400", "--offload-modules", "moe"], "expected a comma list"),
        (["--host-link", "25", "--device-tflops", "400", "--device-memory", "trn1"], "trn1 trains through XLA"),
        (["--host-link", "25", "--device-tflops", "400", "--cp", "2"], "--cp 1 only"),
        (["--host-link", "25", "--device-tflops", "400", "--pp", "2", "--micro-batches", "4"], "without --pp"),
    ],
)
def test_plan_command_refuses_what_offload_cannot_plan_in_one_line(capsys, args, needle):
    code, _, err = _plan(capsys, "--config", "llama2-7b", "--tp", "8", "--seq", "4096", "--device-memory", "80", *args)
    assert code == 2 and err.count("\n") == 1 and needle in err, err


def test_plan_offers_the_selective_set_given_instead_of_the_presets(capsys):
    job = ["--config", "llama2-7b", "--tp", "1", "--dp", "8", "--seq", "4096", "--device-memory", "80"]
    explicit = ["--attention", "explicit", "--json"]
    code, out, _ = _plan(capsys, *job, *explicit, "--recompute-modules", "core_attn,mlp")
    plan, name = json.loads(out), "selective[core_attn,mlp]"
    assert code == 0 and name in plan["counts"] and set(plan["counts"]) <= {"none", name, "full"}
    n = plan["counts"][name]
    kept = {i["name"]: i["bytes"] for i in plan["budget"]["items"]}[f"act: {n} layers x {name}"]
    model = model_from_args(
        argparse.Namespace(model="llama", config="llama2-7b", hidden=None, heads=None, layers=None, vocab=None)
    )
    setup = TrainingSetup(4096, 1, tp=1, dp=8, attention="explicit", sequence_parallel=True)
    chosen = RecomputeConfig(granularity="selective", modules=["core_attn", "mlp"])
    assert kept == n * layer_activation_bytes(model, setup, chosen)  # the memory model's own entry point
    code, out, _ = _plan(capsys, *job, *explicit)
    assert name not in json.loads(out)["counts"]  # not a preset's set: offered only when asked
    code, _, err = _plan(capsys, *job, "--recompute-modules", "core_attn,foo")
    assert code == 2 and err.count("\n") == 1 and "unknown module 'foo'" in err
    code, _, err = _plan(capsys, *job, "--model", "transformers", "--recompute-modules", "mlp")
    assert code == 2 and "planned for --model llama only" in err


def test_the_host_limit_binds_where_offload_would_take_more():
    def plan(choices=None):
        return plan_recompute(MODEL, SETUP, _between_none_and_full(), reserve_gib=0, choices=choices)

    free = plan(Choices(link=FAST))
    assert free.host_pinned_bytes > 0
    room = free.host_pinned_bytes // 2
    held = plan(Choices(link=FAST, host_bytes=room))
    assert 0 < held.host_pinned_bytes <= room and held.recompute_flops >= free.recompute_flops
    none = plan(Choices(link=FAST, host_bytes=0))  # no room: the plan without offload
    assert none.host_pinned_bytes == 0 and none.recompute_flops == pytest.approx(plan().recompute_flops, rel=1e-12)


def test_offload_room_is_the_host_less_a_checkpoint_save_over_its_ranks():
    model = model_from_args(
        argparse.Namespace(model="llama", config="llama2-7b", hidden=None, heads=None, layers=None, vocab=None)
    )
    setup = TrainingSetup(4096, 1, tp=1, dp=8, attention="flash")
    group, writers, ranks = 256 * 2**20, 8, 8  # CheckpointManager's defaults; a p5.48xlarge: 8 ranks, 2 TiB
    assert offload_room(model, setup, "p5.48xlarge") == (2048 * 2**30 - group * writers) // ranks
    room = offload_room(model, setup, "p5.48xlarge")
    budget = host_budget(model, setup, "p5.48xlarge", offload_pinned_bytes=room)
    assert budget.fits and not host_budget(model, setup, "p5.48xlarge", offload_pinned_bytes=room + 2**20).fits


FAST = HostLink(1e3, 1e3, 1e-3)


def _between_none_and_full() -> float:
    none = evaluate(MODEL, SETUP, "none", 0).budget.total_bytes
    return (none - (none - evaluate(MODEL, SETUP, "full", 0).budget.total_bytes) // 3) / 2**30
