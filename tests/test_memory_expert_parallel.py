"""The MoE layer model under expert parallelism keeps what transformers' layers keep, to the byte.

At ``expert_model_parallel_size`` 2 on 2 gloo processes (world 2: at TP 1 the EP group is the
world, at TP 2 + sequence parallel it is the TP group) each rank holds half the experts, whole,
and dispatches its tokens with the all-to-all (:mod:`neuron_ckpt.parallel.experts`). How many
rows a rank's experts receive is routing's choice: the model takes it as ``MoESetup.ep_rows``,
and here it is the count each rank's dispatch made, itself checked against the routes the
router chose (every rank runs the same input through the same weights, so rank ``j`` receives
every source's routes to its experts ``[j E/2, (j+1) E/2)``). With the router's weight zeroed
every score ties and every token goes to the same two experts, on one rank: it receives the
dropless worst case, the other nothing (one zero row).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

transformers = pytest.importorskip("transformers")

from neuron_ckpt.memory.moe import MLA, MoESetup, MoEShape, layer_memory, load_moe_config  # noqa: E402

S, B = 16, 2  # T = 32 tokens
SHAPES = {
    "mixtral": MoEShape("mixtral", 64, 1, 4, 2, 16, experts=4, top_k=2, moe_ffn=96, vocab=128),
    "qwen2_moe": MoEShape("qwen2_moe", 64, 1, 4, 2, 16, experts=4, top_k=2, moe_ffn=32, vocab=128, shared_ffn=48,
                          norm_topk_prob=False),
    "olmoe": MoEShape("olmoe", 64, 1, 4, 2, 16, experts=4, top_k=2, moe_ffn=32, vocab=128, norm_topk_prob=False),
    "deepseek_v3": MoEShape("deepseek_v3", 64, 2, 4, 4, 16, experts=4, top_k=2, moe_ffn=32, vocab=128, dense_ffn=80,
                            dense_layers=(0,), shared_ffn=32, n_group=2, topk_group=1, mla=MLA(16, 16, 8, 8, 8)),
}  # fmt: skip
CHOICES = ("none", "moe", "moe_act", "full", "norm+moe_act")
# (families, dtype, experts implementation, tp, sequence parallel)
RUNS = [
    (("mixtral", "qwen2_moe", "olmoe", "deepseek_v3"), "bf16", "grouped_mm", 1, False),
    (("mixtral", "deepseek_v3"), "fp32", "eager", 1, False),
    (("mixtral", "qwen2_moe", "deepseek_v3"), "bf16", "grouped_mm", 2, True),
]


def _measure(families, dtype, experts, tp, sp, tied=False, form="all_to_all", cf=None):
    """On this rank, for each family: (rows of ``compare``, rows received per layer, routes the
    router sent to each expert per layer, routes dropped per layer)."""
    import neuron_ckpt as nc
    from neuron_ckpt.memory.moe import compare as cmp
    from neuron_ckpt.memory.moe.measure import build_model, dropped_routes, measure_layers, received_rows

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    out = []
    try:
        nc.initialize_model_parallel(tp, expert_model_parallel_size=2)
        for family in families:
            setup = MoESetup(S, B, tp, dtype, "sdpa", experts, sp, ep=2, ep_dispatch=form, capacity_factor=cf)
            if tied:  # every score ties: top-k picks the same two experts for every token
                model = build_model(SHAPES[family], setup)
                with torch.no_grad():
                    for layer in model.model.layers:
                        layer.mlp.gate.weight.zero_()
                measured = measure_layers(model, setup, backward=True).per_layer_bytes
                out.append((measured, received_rows(model), dropped_routes(model)))
                continue
            rows = cmp.compare(SHAPES[family], setup, CHOICES)
            model, routes = build_model(SHAPES[family], setup), []  # the same seed: the same routing
            for layer in model.model.layers:
                if hasattr(layer.mlp, "gate"):
                    layer.mlp.gate.register_forward_hook(lambda m, a, o, r=routes: r.append(o[-1].reshape(-1)))
            measure_layers(model, setup, backward=False)
            per_expert = torch.bincount(routes[0], minlength=4).tolist()  # the MoE layer's top-k indices
            dropped = [d for d in dropped_routes(model) if d is not None]
            out.append(([(r.kind, r.choice, r.measured, r.analytic) for r in rows], per_expert, dropped))
    finally:
        torch.set_num_threads(threads)
    return out


@pytest.mark.parametrize("families,dtype,experts,tp,sp", RUNS, ids=["bf16-grouped_mm", "fp32-eager", "tp2-sp-bf16"])
def test_measured_equals_analytic_at_ep2_on_every_rank(world, families, dtype, experts, tp, sp):
    """Every family, every choice, both ranks: what autograd kept = ``layer_memory`` at the rows
    the rank received; and those rows are what the router sent there."""
    ranks = world(2).run(_measure, families, dtype, experts, tp, sp)
    for rank, results in enumerate(ranks):
        for family, (rows, per_expert, _) in zip(families, results):
            assert {c for _, c, _, _ in rows} == set(CHOICES)
            for kind, choice, measured, analytic in rows:
                assert measured == analytic, (rank, family, kind, choice)
            # the router's routes to this rank's experts, from every source: at TP 1 both ranks
            # route the same T tokens (x2); at TP 2 the two sources are the two halves of them
            mine = sum(per_expert[2 * rank : 2 * rank + 2]) * (2 // tp)
            shape = SHAPES[family]
            moe = [m for k, c, m, _ in rows if k == "moe" and c == "none"][0]
            setup = MoESetup(S, B, tp, dtype, "sdpa", experts, sp, ep=2, ep_rows=mine)
            assert moe == layer_memory(shape, setup, "none", "moe").autograd_bytes, (rank, family)
    # routing spread the rows unevenly: the ranks' MoE layers kept different bytes (ep_rows matters)
    unplain = [[m for k, c, m, _ in rows if (k, c) == ("moe", "none")] for rows, _, _ in (*ranks[0], *ranks[1])]
    assert unplain[: len(families)] != unplain[len(families) :]


def test_a_tied_router_sends_the_worst_case_to_one_rank_and_nothing_to_the_other(world):
    """Every token's 2 routes land on one rank's two experts from both ranks: 2 T min(k, E/2) =
    128 rows, the dropless worst case; the other receives 0 and runs one zero row. The ``"worst"``
    figure and ``ep_rows=0`` price them to the byte (forward and backward run)."""
    ranks = world(2).run(_measure, ("mixtral",), "bf16", "grouped_mm", 1, False, tied=True)
    (measured, received, _) = zip(*(r[0] for r in ranks))
    assert sorted(received) == [[0], [2 * S * B * 2]]  # torch.topk's ties pick one rank's two experts
    worst = MoESetup(S, B, ep=2, ep_rows="worst")
    for bytes_, rows in zip(measured, received):
        setup = worst if rows[0] else replace(worst, ep_rows=0)
        assert bytes_ == [layer_memory(SHAPES["mixtral"], setup, "none", "moe").autograd_bytes]


def test_a_tied_router_drops_the_worst_case_with_the_all_gather_form(world):
    """The same routing through the all-gather form at capacity factor 1: N = 2 T = 64 gathered
    tokens, 32 slots per expert; one rank's two experts get all 64 tokens' routes each and drop 2 x
    32, ``dropped_worst``'s figure for a rank and for the group; the other drops none. Both run
    their 2 x 32 slots and keep the same bytes, as priced."""
    from neuron_ckpt.memory.moe.all_gather import dropped_worst

    ranks = world(2).run(_measure, ("mixtral",), "bf16", "grouped_mm", 1, False, True, "all_gather", 1.0)
    (measured, received, dropped) = zip(*(r[0] for r in ranks))
    setup = MoESetup(S, B, ep=2, ep_dispatch="all_gather", capacity_factor=1.0)
    assert dropped_worst(SHAPES["mixtral"], setup) == (2 * (2 * S * B - 32), 2 * (2 * S * B - 32))
    assert sorted(dropped) == [[0], [dropped_worst(SHAPES["mixtral"], setup)[0]]]
    assert received == ([2 * 32], [2 * 32])
    assert measured == ([layer_memory(SHAPES["mixtral"], setup, "none", "moe").autograd_bytes],) * 2


# The all-gather form (XLA's, run on gloo): (families, dtype, experts implementation, tp, sequence
# parallel, capacity factor). A factor of 1 drops routes with this seed's routing: some experts get
# more than their N k / E routes.
CF = 1.0
GATHER_RUNS = [
    (("mixtral", "qwen2_moe", "deepseek_v3"), "bf16", "grouped_mm", 1, False, None),
    (("mixtral", "deepseek_v3"), "bf16", "grouped_mm", 1, False, CF),
    (("mixtral",), "fp32", "eager", 1, False, CF),
    (("mixtral", "deepseek_v3"), "bf16", "grouped_mm", 2, True, None),
    (("mixtral", "deepseek_v3"), "bf16", "grouped_mm", 2, True, CF),
]


@pytest.mark.parametrize(
    "families,dtype,experts,tp,sp,cf",
    GATHER_RUNS,
    ids=["dropless", "cf1", "cf1-fp32-eager", "tp2-sp-dropless", "tp2-sp-cf1"],
)
def test_the_all_gather_form_measured_equals_analytic_at_ep2_on_every_rank(world, families, dtype, experts, tp, sp, cf):
    """Every family, every choice, both ranks: what autograd kept = ``layer_memory`` at the form's
    ``E/e x capacity`` slots, the same bytes on both ranks (static shapes: routing decides
    nothing). The routes each rank dropped are the router's routes to its experts beyond their
    capacity (counted here from the router's choices), never more than ``dropped_worst``; at the
    factor some are dropped, dropless none."""
    from neuron_ckpt.memory.moe.all_gather import capacity, dropped_worst

    ranks = world(2).run(_measure, families, dtype, experts, tp, sp, False, "all_gather", cf)
    for family, *per_rank in zip(families, *ranks):
        shape = SHAPES[family]
        setup = MoESetup(S, B, tp, dtype, "sdpa", experts, sp, ep=2, ep_dispatch="all_gather", capacity_factor=cf)
        slots_per_expert = capacity(shape, setup)
        for rank, (rows, per_expert, dropped) in enumerate(per_rank):
            assert {c for _, c, _, _ in rows} == set(CHOICES)
            for kind, choice, measured, analytic in rows:
                assert measured == analytic, (rank, family, kind, choice, measured, analytic)
            # the gathered routes to this rank's experts: at TP 1 both ranks route the same T tokens
            # (x2); at TP 2 the two ranks' halves are the whole sequence
            gathered = [n * (2 // tp) for n in per_expert[2 * rank : 2 * rank + 2]]
            assert dropped == [sum(max(0, n - slots_per_expert) for n in gathered)], (rank, family)
            assert dropped[0] <= dropped_worst(shape, setup)[0]
        assert per_rank[0][0] == per_rank[1][0], family
        assert (sum(r[2][0] for r in per_rank) > 0) == (cf is not None), family


def test_ep1_is_the_model_without_expert_parallelism():
    """``ep=1`` (the default) is today's model byte for byte, whatever ``ep_rows`` says."""
    for shape in SHAPES.values():
        for choice in ("none", "moe_act"):
            kind = shape.kind_of(shape.layers - 1)
            base = layer_memory(shape, MoESetup(S, B, 2, sequence_parallel=True), choice, kind)
            same = layer_memory(shape, MoESetup(S, B, 2, sequence_parallel=True, ep=1, ep_rows="worst"), choice, kind)
            assert base == same


def test_received_rows_balanced_and_worst_case_by_hand():
    """DeepSeek-V3 (256 experts, top 8) and Mixtral (8, top 2) at s 4096, TP 2 + SP: each TP rank
    dispatches T' = 2048 tokens; balanced T' k, worst e T' min(k, E/e)."""
    from neuron_ckpt.memory.moe.experts import received_rows

    ds, mx = load_moe_config("deepseek-v3"), load_moe_config("mixtral-8x7b")
    for e in (2, 8, 64):
        setup = MoESetup(4096, 1, 2, sequence_parallel=True, ep=e)
        assert received_rows(ds, setup) == 2048 * 8
        assert received_rows(ds, replace(setup, ep_rows="worst")) == e * 2048 * min(8, 256 // e)
    assert received_rows(mx, MoESetup(4096, 1, 2, sequence_parallel=True, ep=8, ep_rows="worst")) == 8 * 2048 * 1
    # the experts' activations scale with the rows: doubling them adds 2x the per-row bytes
    one, two = (MoESetup(4096, ep=2, ep_rows=n) for n in (1000, 2000))
    per_row = layer_memory(mx, two, "none", "moe").nbytes - layer_memory(mx, one, "none", "moe").nbytes
    assert per_row == 1000 * (2 * 4096 + 2 * 14336 * 2 + 2 * 14336 * 2 + 4 + 8 + 8)  # in, gate_up, act+product, w, idx


def test_the_all_gather_forms_slots_and_drops_by_hand():
    """Mixtral 8x7B as trn1 would run it, s 4096, TP 8 + SP, EP 8 (the EP group is the TP group):
    each rank dispatches T' = 512 tokens and gathers N = 4096; its one expert has ceil(N k / E x
    cf) slots, 1024 at cf 1, N = 4096 dropless (E T': E/k = 4x the balanced routed rows). At most
    N - C routes dropped per expert: min(k, E/e) = 1 expert here, k = 2 in the group."""
    from neuron_ckpt.memory.moe import all_gather as ag
    from neuron_ckpt.memory.moe.experts import received_rows

    mx = load_moe_config("mixtral-8x7b")
    setup = MoESetup(4096, 1, 8, sequence_parallel=True, ep=8, ep_dispatch="all_gather", capacity_factor=1.0)
    dropless = replace(setup, capacity_factor=None)
    assert (ag.gathered_tokens(setup), ag.capacity(mx, setup), received_rows(mx, setup)) == (4096, 1024, 1024)
    assert (ag.capacity(mx, dropless), received_rows(mx, dropless)) == (4096, 4096)
    assert ag.dropped_worst(mx, setup) == (3072, 6144) and ag.dropped_worst(mx, dropless) == (0, 0)
    assert ag.capacity(mx, replace(setup, capacity_factor=0.01)) == 11  # ceil(4096 x 2 / 8 x 0.01)
    # the layer's bytes grow by a fixed amount per slot: doubling the capacity adds 1024 slots of
    # in, gate_up, act, product, the down projection's output (bf16), the routing weight (fp32),
    # three int64 sort indices, the slot's token and the combine's fp32 copy of its output
    h, F = 4096, 14336
    one, two = (layer_memory(mx, replace(setup, capacity_factor=cf), "none", "moe").nbytes for cf in (1.0, 2.0))
    assert two - one == 1024 * (2 * h + 2 * 2 * F + 2 * F + 2 * F + 2 * h + 4 + 3 * 8 + 8 + 4 * h)


@pytest.mark.parametrize(
    "family,changes,needle",
    [
        ("mixtral", {"ep": 3}, "ep (3) must divide experts (8); allowed: [1, 2, 4, 8]"),
        ("mixtral", {"ep": 2, "ep_rows": 10**9}, "ep_rows (1000000000) is more than this rank's experts can receive"),
        ("mixtral", {"ep_rows": "even"}, "ep_rows must be one of ('balanced', 'worst')"),
        ("mixtral", {"ep": 0}, "ep"),
        ("mixtral", {"ep": 2, "tp": 3}, "seq_len (4096) must be a multiple of tp (3) when ep > 1"),
        ("llama4", {"ep": 2}, "ep: "),
        ("mixtral", {"ep_dispatch": "alltoall"}, "ep_dispatch must be one of ('all_to_all', 'all_gather')"),
        ("mixtral", {"capacity_factor": 1.0}, "capacity_factor (1.0) applies to ep_dispatch='all_gather'"),
        ("mixtral", {"ep_dispatch": "all_gather", "capacity_factor": 0}, "capacity_factor must be None (dropless)"),
        ("mixtral", {"ep_dispatch": "all_gather", "ep_rows": "worst"}, "ep_rows ('worst') applies to ep_dispatch="),
    ],
)
def test_bad_expert_parallel_input_is_refused_in_one_line(family, changes, needle):
    if family == "llama4":
        shape = MoEShape("llama4_text", 64, 1, 4, 2, 16, experts=4, top_k=1, moe_ffn=32, vocab=128, shared_ffn=32)
    else:
        shape = load_moe_config("mixtral-8x7b")
    with pytest.raises(ValueError) as err:
        layer_memory(shape, MoESetup(**{"seq_len": 4096, **changes}), "none", "moe")
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_the_memory_command_prices_and_measures_expert_parallelism(tmp_path, capsys):
    """``neuron-ckpt memory --config <tiny Mixtral> --ep 2 --json``: the spec carries ep, the
    balanced rows (T k = 64) and the experts' weights per rank (2 of 4 experts, whole), the table
    is ``layer_memory``'s; ``--ep-dispatch all_gather --capacity-factor 1`` its capacity, slots and
    worst-case drops. Bad --ep: one line. (``--measure`` at ``--ep 2`` runs ``compare_on_ranks``
    on 2 gloo ranks, tested above; not spawned again here, for CI time.)"""
    import json

    from neuron_ckpt.memory.moe.hf_config import hf_config

    from .helpers import neuron_ckpt_cli

    shape = replace(SHAPES["mixtral"], layers=2)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(hf_config(shape, MoESetup(S)).to_dict()))
    args = ("memory", "--config", str(path), "--seq", str(S), "--micro-batch", str(B), "--ep", "2")
    code, out, _ = neuron_ckpt_cli(capsys, *args, "--json")
    report = json.loads(out)
    spec = report["spec"]
    assert code == 0 and (spec["ep"], spec["ep_rows"], spec["received_rows"]) == (2, "balanced", S * B * 2)
    assert spec["expert_weight_bytes"] == 2 * 3 * 64 * 96 * 2
    balanced = layer_memory(shape, MoESetup(S, B, ep=2), "none", "moe").nbytes
    assert report["per_layer_bytes"]["moe"]["none"] == balanced
    code, out, _ = neuron_ckpt_cli(capsys, *args, "--ep-rows", "worst", "--json")
    assert json.loads(out)["spec"]["received_rows"] == 2 * S * B * min(2, 4 // 2)
    gather = ("--ep-dispatch", "all_gather", "--capacity-factor", "1", "--json")
    spec = json.loads(neuron_ckpt_cli(capsys, *args, *gather)[1])["spec"]
    # N = 2 T = 64 gathered tokens, ceil(64 x 2 / 4) = 32 slots per expert, 2 experts per rank
    assert (spec["ep_dispatch"], spec["capacity_factor"], spec["capacity"], spec["received_rows"]) == (
        "all_gather", 1.0, 32, 64)  # fmt: skip
    assert spec["dropped_routes_worst"] == {"rank": 2 * 32, "group": 2 * 32}
    code, _, err = neuron_ckpt_cli(capsys, *args, "--capacity-factor", "1")
    assert code != 0 and "capacity_factor (1.0) applies to ep_dispatch='all_gather'" in err
    code, _, err = neuron_ckpt_cli(capsys, "memory", "--config", str(path), "--seq", "16", "--ep", "3")
    assert code != 0 and "ep (3) must divide experts (4); allowed: [1, 2, 4]" in err and err.count("\n") == 1
    code, _, err = neuron_ckpt_cli(capsys, "memory", "--hidden", "64", "--heads", "4", "--seq", "16", "--ep", "2")
    assert code != 0 and "--ep, --ep-rows, --ep-dispatch and --capacity-factor apply to --config" in err
