"""The memory budget and the recompute planner: what they must guarantee.

* The budget's activations are what a real ``LlamaForCausalLM`` keeps for backward (measured,
  within 2%) under no / selective / selective+mlp_act / full recompute and per-layer mixes.
* The planner's choice fits and nothing cheaper fits: a brute force over every per-layer
  assignment (L = 1..4, many limits) finds no assignment with fewer recompute FLOPs that fits;
  likewise against a limit on the activations alone (``plan_activations``).
* When nothing fits, the error says so and names what would: the smallest tensor-parallel
  degree and the largest micro-batch that fit.
* A per-layer list of ``RecomputeConfig`` runs a Llama with the same loss and gradients as no
  recompute, each layer recomputing as its entry says (forward-call counts).
* ``neuron-ckpt plan``: exit 0 with the plan, 1 when nothing fits, 2 with one line on bad input.
  With ``--pp P`` it plans each pipeline stage (``stages`` in ``--json``) and names the smallest
  pipeline degree that fits when a stage does not; ``--pp 1`` prints what it prints without it.
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import replace

import pytest
import torch
import transformers

import neuron_ckpt as nc
from neuron_ckpt.cli import main as cli_main
from neuron_ckpt.memory import (
    ModelShape,
    NothingFits,
    SavedTensorRecorder,
    TrainingSetup,
    layer_options,
    memory_budget,
    plan_activations,
    plan_recompute,
)
from neuron_ckpt.memory.budget import GIB, largest_collective_bytes, optimizer_step_bytes
from neuron_ckpt.memory.options import stack_options
from neuron_ckpt.memory.planner import evaluate, valid_tp_degrees
from neuron_ckpt.models.config_file import load_llama_config
from neuron_ckpt.models.llama import LlamaForCausalLM, SwiGLU
from neuron_ckpt.parallel import CoreAttention
from neuron_ckpt.recompute import RecomputeConfig, apply_recompute, unwrapped

from .helpers import counted_forwards, tiny_config

TOLERANCE = 0.02
S, B = 32, 2
SIZES = {"vocab_size": 256, "intermediate_size": 176, "max_position_embeddings": S}
"""The suite's tiny Llama (``tiny_config``) at the sizes these measurements were set on."""


def _configs(names) -> list[RecomputeConfig | None]:
    options = layer_options(
        ModelShape.from_llama(tiny_config(**SIZES, num_hidden_layers=len(names))), TrainingSetup(S, B)
    )
    return [options[n].recompute for n in names]


def _batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (B, S), generator=g)
    return ids, ids.clone()


# ---------------------------------------------------------------------------------------------
# Budget activations == measured activations of a whole model.

ASSIGNMENTS = {
    "none": ("none", "none"),
    "selective": ("selective", "selective"),
    "selective+mlp_act": ("selective+mlp_act", "selective+mlp_act"),
    "full": ("full", "full"),
    "full, selective": ("full", "selective"),
    "selective+mlp_act, none": ("selective+mlp_act", "none"),
    "full, none": ("full", "none"),
}


def _assignments(attention: str) -> dict[str, tuple[str, str]]:
    """With flash attention the budget offers no selective option."""
    return {k: v for k, v in ASSIGNMENTS.items() if attention == "explicit" or "selective" not in k}


def _measure_whole_model(t: int, sp: bool, attention: str) -> dict[str, int]:
    nc.initialize_model_parallel(t)
    out = {}
    for label, names in _assignments(attention).items():
        torch.manual_seed(0)
        model = LlamaForCausalLM(
            tiny_config(**SIZES), sequence_parallel=sp, attention_implementation=attention, dtype=torch.bfloat16
        ).train()
        apply_recompute(model, _configs(names), sequence_parallel=sp)
        masks = [m.causal_mask(S, torch.device("cpu")) for m in model.modules() if isinstance(m, CoreAttention)]
        ids, labels = _batch()
        with SavedTensorRecorder(exclude_modules=[model], exclude_tensors=masks) as rec:
            loss = model(ids, labels=labels).loss
        out[label] = rec.total_bytes
        loss.backward()  # the recomputed model still trains
    return out


RUNS = [(1, False, "explicit"), (2, True, "explicit"), (2, False, "explicit"), (1, False, "flash"), (2, True, "flash")]
_MEASURED: dict[tuple, list[dict[str, int]]] = {}


@pytest.mark.parametrize("t,sp,attention,label", [(*run, label) for run in RUNS for label in _assignments(run[2])])
def test_budget_activations_match_a_measured_llama(world, t, sp, attention, label):
    if (t, sp, attention) not in _MEASURED:
        _MEASURED[(t, sp, attention)] = world(2).run(_measure_whole_model, t, sp, attention)
    model = ModelShape.from_llama(tiny_config(**SIZES))
    setup = TrainingSetup(S, B, tp=t, dp=2 // t, sequence_parallel=sp, attention=attention)
    analytic = memory_budget(model, setup, ASSIGNMENTS[label]).activation_bytes
    for rank, per_rank in enumerate(_MEASURED[(t, sp, attention)]):
        ratio = per_rank[label] / analytic
        assert abs(ratio - 1) <= TOLERANCE, f"{label}, t={t}, sp={sp}, rank {rank}: measured/analytic {ratio:.4f}"
        assert per_rank[label] == analytic  # in fact to the byte: nothing is left out


# ---------------------------------------------------------------------------------------------
# The shape every tool shares: parameters and FLOPs.


def test_presets_parameters_and_flops_per_token():
    seven_b = ModelShape.from_llama(load_llama_config("llama2-7b"))
    assert seven_b.num_parameters() == 6_738_415_616  # Llama-2 7B
    n = seven_b.num_parameters(include_embedding=False)
    assert seven_b.flops_per_token(4096) == 6 * n + 12 * 32 * 4096 * 4096  # 6N + 12LHQT
    eight_b = ModelShape.from_llama(load_llama_config("llama3-8b"))
    assert (eight_b.kv_heads, eight_b.ffn, eight_b.vocab) == (8, 14336, 128256)
    assert eight_b.num_parameters() == 8_030_261_248  # Llama-3 8B
    for bias in (False, True):
        config = tiny_config(**SIZES)
        config.attention_bias = config.mlp_bias = bias
        reference = transformers.LlamaForCausalLM(config)
        assert ModelShape.from_llama(config).num_parameters() == sum(p.numel() for p in reference.parameters())


def _local_parameter_count(t: int, bias: bool) -> int:
    nc.initialize_model_parallel(t)
    config = tiny_config(**SIZES)
    config.num_key_value_heads, config.attention_bias, config.mlp_bias = 1, bias, bias  # g < t at t = 2
    return sum(p.numel() for p in LlamaForCausalLM(config).parameters())


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("t", [1, 2])
def test_local_parameters_are_what_a_rank_holds(world, t, bias):
    config = tiny_config(**SIZES)
    config.num_key_value_heads, config.attention_bias, config.mlp_bias = 1, bias, bias
    expected = ModelShape.from_llama(config).local_parameters(t)
    assert world(2).run(_local_parameter_count, t, bias) == [expected, expected]


# ---------------------------------------------------------------------------------------------
# Optimality against a brute force over every per-layer assignment.


def _grouped(model):
    return [RecomputeConfig(granularity="full", method="uniform", num_layers=k) for k in range(2, model.layers + 1)]


def _every_assignment(model, setup):
    """(total bytes, recompute FLOPs) of every per-layer assignment and of grouped full
    recompute with every group size, each laid out by ``memory_budget``."""
    options = layer_options(model, setup)
    priced = []
    for names in [*itertools.product(options, repeat=model.layers), *_grouped(model)]:
        budget = memory_budget(model, setup, names, options)
        grouped = isinstance(names, RecomputeConfig)
        layers = stack_options(model, setup, names) if grouped else [options[n] for n in names]
        priced.append((budget.total_bytes, sum(o.recompute_flops for o in layers)))
    return priced


@pytest.mark.parametrize("layers", [1, 2, 3, 4])
@pytest.mark.parametrize("kind", ["llama", "gpt"])
def test_planner_is_optimal_against_brute_force(layers, kind):
    if kind == "llama":
        model = ModelShape("llama", 64, 4, 2, 176, layers, 128)
    else:
        model = ModelShape.gpt(64, 4, layers, vocab=128)
    setup = TrainingSetup(seq_len=128, micro_batch=2, tp=1, zero1=False)
    every = _every_assignment(model, setup)
    limits = sorted({total + d for total, _ in every for d in (-1, 0)})
    for limit in limits:
        best = min((cost for total, cost in every if total <= limit), default=None)
        if best is None:
            with pytest.raises(NothingFits, match="nothing fits"):
                plan_recompute(model, setup, limit / GIB, reserve_gib=0)
            continue
        plan = plan_recompute(model, setup, limit / GIB, reserve_gib=0)
        assert plan.limit_bytes == limit and plan.fits
        assert plan.budget.total_bytes <= limit
        assert plan.recompute_flops == pytest.approx(best, rel=1e-12), (limit, plan.layers)


@pytest.mark.parametrize("limit_on", ["total", "activations"])
def test_every_split_priced_at_once_is_the_budget_of_that_split(limit_on):
    """The planner prices all splits in one numpy pass (``BudgetParts.used_by_counts``); each row is
    ``memory_budget`` of that split laid out layer by layer, with micro-batches in flight (PP)."""
    from neuron_ckpt.memory.budget import BudgetParts
    from neuron_ckpt.memory.planner import _splits

    model = ModelShape("llama", 64, 4, 2, 176, 5, 128)
    one = TrainingSetup(seq_len=128, micro_batch=2, tp=2, zero1=False)
    for setup in (one, replace(one, microbatches_in_flight=3)):
        options = layer_options(model, setup)
        names, m = list(options), setup.microbatches_in_flight
        splits = _splits(model.layers, len(names))
        assert len(splits) == math.comb(model.layers + len(names) - 1, len(names) - 1)
        assert (splits.sum(axis=1) == model.layers).all() and len({tuple(r) for r in splits.tolist()}) == len(splits)
        used = BudgetParts.of(model, setup).used_by_counts([options[n] for n in names], splits, m, limit_on)
        for row, bytes_ in zip(splits.tolist(), used.tolist()):
            budget = memory_budget(model, setup, tuple(n for n, k in zip(names, row) for _ in range(k)), options)
            assert bytes_ == (budget.total_bytes if limit_on == "total" else budget.activation_bytes), row


@pytest.mark.parametrize("layers", [1, 3])
def test_plan_activations_is_optimal_against_brute_force(layers):
    model = ModelShape("llama", 64, 4, 2, 176, layers, 128)
    setup = TrainingSetup(seq_len=128, micro_batch=2, tp=1, zero1=False)
    options = layer_options(model, setup)
    budgets = [memory_budget(model, setup, n, options) for n in itertools.product(options, repeat=layers)]
    acts = sorted({b.activation_bytes for b in budgets})
    for limit in sorted({x + d for x in acts for d in (-1, 0)}):
        fitting = [sum(options[n].recompute_flops for n in b.layers) for b in budgets if b.activation_bytes <= limit]
        if not fitting:
            with pytest.raises(NothingFits, match="no recompute choice keeps at most"):
                plan_activations(model, setup, limit)
            continue
        plan = plan_activations(model, setup, limit)
        assert plan.limit_on == "activations" and plan.fits and plan.used_bytes == plan.budget.activation_bytes <= limit
        assert plan.recompute_flops == pytest.approx(min(fitting), rel=1e-12), (limit, plan.layers)
    # Parameters, optimizer state and workspace do not count: at the activations of no recompute, none.
    assert plan_activations(model, setup, acts[-1]).layers == ("none",) * layers


def test_budget_line_items_follow_zero1_and_dtype():
    model = ModelShape.from_llama(load_llama_config("llama2-7b"))
    items = {i.name: i.nbytes for i in memory_budget(model, TrainingSetup(4096, 1, tp=8, dp=4), "selective").items}
    n = items["parameters"] // 2
    assert items["gradients"] == 4 * n  # ZeRO-1 accumulates bf16 gradients in fp32 buffers
    bf16_grads = memory_budget(model, TrainingSetup(4096, 1, tp=8, dp=4, accumulate_fp32=False), "selective")
    assert {i.name: i.nbytes for i in bf16_grads.items}["gradients"] == 2 * n
    assert items["master weights"] == 4 * n // 4 and items["optimizer moments"] == 8 * n // 4
    plain = {
        i.name: i.nbytes
        for i in memory_budget(model, TrainingSetup(4096, 1, tp=8, dp=4, zero1=False), "selective").items
    }
    assert plain["master weights"] == 4 * n and plain["optimizer moments"] == 8 * n
    fp32 = {i.name for i in memory_budget(model, TrainingSetup(4096, 1, tp=8, dtype="fp32", zero1=False)).items}
    assert "master weights" not in fp32  # fp32 parameters are their own master copy
    # Pipeline parallelism keeps more micro-batches alive: activations scale, the rest does not.
    one = memory_budget(model, TrainingSetup(4096, 1, tp=8, dp=4), "selective")
    two = memory_budget(model, TrainingSetup(4096, 1, tp=8, dp=4, microbatches_in_flight=2), "selective")
    assert two.activation_bytes == 2 * one.activation_bytes
    assert two.bytes_of("static") == one.bytes_of("static")


def test_budget_prices_any_recompute_config():
    """A config prices as the preset it equals; block reads as its per-layer names; a per-layer
    list takes configs and None as ``apply_recompute`` does; bad entries name their index."""
    model = ModelShape("llama", 64, 4, 2, 176, 8, 128)
    setup = TrainingSetup(seq_len=64, micro_batch=1, zero1=False)
    assert memory_budget(model, setup, RecomputeConfig("selective")) == memory_budget(model, setup, "selective")
    block = memory_budget(model, setup, RecomputeConfig("full", "block", 3))
    assert block == memory_budget(model, setup, ("full",) * 3 + ("none",) * 5)
    subset = RecomputeConfig("selective", modules=["mlp", "norm"])
    mixed = memory_budget(model, setup, [RecomputeConfig.preset("full"), None, subset, "selective", *[None] * 4])
    assert mixed.layers == ("full", "none", "selective[mlp,norm]", "selective", *["none"] * 4)
    assert (
        mixed.activation_bytes
        == memory_budget(model, setup, ("full", "none", "none", "selective", *["none"] * 4)).activation_bytes
        - (memory_budget(model, setup, "none").activation_bytes - memory_budget(model, setup, subset).activation_bytes)
        // 8
    )
    with pytest.raises(ValueError, match=r"layers\[1\]: .*use num_layers=1, got num_layers=2"):
        memory_budget(model, setup, [None, RecomputeConfig("full", "uniform", 2), *[None] * 6])
    with pytest.raises(ValueError, match=r"layers\[0\] must be a preset name, a RecomputeConfig or None"):
        memory_budget(model, setup, [3, *[None] * 7])


def test_grouped_recompute_keeps_least_and_its_buffer_is_in_the_total():
    """Bigger groups keep fewer inputs after the forward but bring more layers back at once in
    backward; the device total holds that peak."""
    model = ModelShape("llama", 64, 4, 2, 176, 8, 128)
    setup = TrainingSetup(seq_len=1024, micro_batch=1, zero1=False, attention="flash")
    budgets = [memory_budget(model, setup, RecomputeConfig("full", "uniform", k)) for k in (1, 2, 4, 8)]
    kept, peaks = [b.activation_bytes for b in budgets], [b.activation_peak_bytes for b in budgets]
    assert kept == sorted(kept, reverse=True) and peaks == sorted(peaks) and len(set(peaks)) == 4
    for b in budgets:
        assert b.total_bytes >= b.bytes_of("static") + b.activation_peak_bytes
    assert budgets[-1].total_bytes == budgets[-1].bytes_of("static") + budgets[-1].activation_peak_bytes
    assert budgets[-1].items[-1].note.startswith("recompute in backward")


def test_zero1_step_is_bounded_by_the_bucket_cap():
    """Bucketed, the step's largest collective is the cap and its transient about the fp32
    gradient slices; one bucket moves every local gradient at once (the layout before buckets)."""
    model = ModelShape.from_llama(load_llama_config("llama2-7b"))
    setup = TrainingSetup(4096, 1, tp=8, dp=4)
    n = model.local_parameters(8)
    assert largest_collective_bytes(model, setup) == 128 * 2**20
    assert optimizer_step_bytes(model, setup) == -(-n // 4) * 4 + 128 * 2**20
    one = TrainingSetup(4096, 1, tp=8, dp=4, bucket_cap_mb=None, accumulate_fp32=False)
    assert largest_collective_bytes(model, one) == 2 * n  # 1.57 GiB in one reduce-scatter
    assert optimizer_step_bytes(model, one) > 2.5 * optimizer_step_bytes(model, setup)
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        TrainingSetup(4096, bucket_cap_mb=0)


def test_host_budget_counts_the_model_once_per_tp_rank():
    """Checkpoint bytes: the model once per TP rank and the ZeRO-1 state once in all, so more DP
    replicas add no bytes; host moments: construction on every rank at once, saving by the
    writers only."""
    from neuron_ckpt.memory.host import host_budget

    model = ModelShape.from_llama(load_llama_config("llama2-7b"))
    n = model.local_parameters(8)
    four = host_budget(model, TrainingSetup(4096, 1, tp=8, dp=4))
    two = host_budget(model, TrainingSetup(4096, 1, tp=8, dp=2), instance="trn1.32xlarge")
    assert four.checkpoint_model_bytes == two.checkpoint_model_bytes == 8 * n * 2
    assert four.checkpoint_optimizer_bytes == pytest.approx(8 * n * 12, rel=1e-6)
    moments = {m.name: m for m in four.moments}
    assert moments["model construction"].per_host == 32 * moments["model construction"].per_rank
    assert moments["checkpoint save"].per_host == 8 * 256 * 2**20
    assert four.fits and four.peak_per_rank < 16 * GIB
    everyone = host_budget(model, TrainingSetup(4096, 1, tp=8, dp=4), writers=0)
    assert {m.name: m for m in everyone.moments}["checkpoint save"].per_host == 32 * 256 * 2**20
    with pytest.raises(ValueError, match="instance must be one of"):
        host_budget(model, TrainingSetup(4096, 1, tp=8, dp=4), instance="trn9")


def test_llama2_7b_on_trn1_plan():
    model = ModelShape.from_llama(load_llama_config("llama2-7b"))
    setup = TrainingSetup(seq_len=4096, micro_batch=1, tp=8, dp=4)
    plan = plan_recompute(model, setup, "trn1")  # default reserve: 10%
    # 10% of the 16 GiB kept free by default: 14.4 GiB to plan for.
    assert plan.limit_bytes == 16 * GIB - int(1.6 * GIB)
    # The tutorial's shape keeps everything (192.3 MiB per layer with the fused softmax and norms).
    assert plan.fits and plan.counts == {"none": 32} and plan.overhead == 0
    # Two micro-batches per step: no recompute does not fit, selective everywhere does; the plan
    # spends what selective leaves free on keeping some attention cores, and discards SwiGLU's
    # output and the norms' (output-discarding mlp_act and norm: 2sbf/t and 4sbh/t less for a few
    # elementwise FLOPs) where that buys more.
    setup = TrainingSetup(seq_len=4096, micro_batch=2, tp=8, dp=4)
    plan = plan_recompute(model, setup, "trn1")
    selective = evaluate(model, setup, "selective", plan.limit_bytes)
    assert plan.fits and selective.fits
    assert plan.counts == {"none": 10, "selective": 6, "selective+mlp_act": 4, "selective+mlp_act+norm": 12}
    # Without the leanest layer: fewer attention cores kept.
    assert plan_recompute(model, setup, "trn1", allowed=("none", "selective", "selective+mlp_act", "full")).counts == {
        "none": 9,
        "selective": 10,
        "selective+mlp_act": 13,
    }
    # Without mlp_act, the attention cores alone: 7 layers keep theirs.
    assert plan_recompute(model, setup, "trn1", allowed=("none", "selective", "full")).counts == {
        "none": 7,
        "selective": 25,
    }
    assert plan.overhead < selective.overhead  # less recompute, by using the memory selective leaves free
    assert plan.budget.total_bytes > selective.budget.total_bytes
    assert not evaluate(model, setup, "none", plan.limit_bytes).fits


def test_grouped_full_recompute_wins_where_full_on_every_layer_does_not_fit():
    # Flash attention, 32 sequences of 4096 at once: full recompute on every layer keeps 32 layer
    # inputs and does not fit; groups of 2 keep 16 and bring 2 layers back at a time, and fit.
    model = ModelShape.from_llama(load_llama_config("llama2-7b"))
    setup = TrainingSetup(seq_len=4096, micro_batch=32, tp=8, dp=4, attention="flash")
    plan = plan_recompute(model, setup, "trn1")
    assert plan.recompute == RecomputeConfig(granularity="full", method="uniform", num_layers=2)
    assert plan.fits and not evaluate(model, setup, "full", plan.limit_bytes).fits
    # Every layer rerun, and the first of each pair to its end (its output feeds the second): more
    # than full on every layer, which stops each layer's rerun before its down projection.
    full = evaluate(model, setup, "full", plan.limit_bytes)
    down = 2 * 4096 * 32 * (11008 // 8) * 4096  # one down projection's forward on one rank (b 32)
    assert plan.recompute_matmul_flops == full.recompute_matmul_flops + 16 * down
    assert plan.budget.activation_peak_bytes > plan.budget.activation_bytes  # the group's buffer counted
    # Against a limit on the kept activations alone the group's buffer would not count: not offered
    # there, so at the group's kept bytes nothing per layer keeps that little.
    with pytest.raises(NothingFits):
        plan_activations(model, setup, plan.budget.activation_bytes)


def test_plan_recompute_forms():
    model = ModelShape("llama", 64, 4, 2, 176, 3, 128)
    setup = TrainingSetup(seq_len=64, micro_batch=1)
    limit = 1 << 40
    assert evaluate(model, setup, "none", limit).recompute == RecomputeConfig()
    assert evaluate(model, setup, "selective", limit).recompute == RecomputeConfig(granularity="selective")
    block = evaluate(model, setup, ("full", "none", "none"), limit).recompute
    assert block == RecomputeConfig(granularity="full", method="block", num_layers=1)
    mixed = evaluate(model, setup, ("full", "selective", "none"), limit).recompute
    assert isinstance(mixed, list) and len(mixed) == 3 and mixed[2] == RecomputeConfig()
    assert plan_recompute(model, setup, 1024).layers == ("none",) * 3  # plenty of memory: no recompute


# ---------------------------------------------------------------------------------------------
# Nothing fits: say what would.


def test_nothing_fits_names_the_smallest_tp_and_largest_micro_batch():
    model = ModelShape.from_llama(load_llama_config("llama2-7b"))
    setup = TrainingSetup(seq_len=4096, micro_batch=32, tp=8, dp=4)
    with pytest.raises(NothingFits) as info:
        plan_recompute(model, setup, "trn1", reserve_gib=0)
    exc = info.value
    assert "nothing fits in 16.00 GiB" in str(exc)
    assert f"tp={exc.smallest_tp}" in str(exc) and f"micro-batch {exc.largest_micro_batch}" in str(exc)

    def fits(**changes):
        try:
            plan_recompute(model, TrainingSetup(**{**setup.__dict__, **changes}), "trn1", reserve_gib=0)
            return True
        except NothingFits:
            return False

    bigger = [t for t in valid_tp_degrees(model, setup) if t > setup.tp]
    assert exc.smallest_tp == next(t for t in bigger if fits(tp=t))
    assert fits(micro_batch=exc.largest_micro_batch) and not fits(micro_batch=exc.largest_micro_batch + 1)


def test_nothing_fits_even_at_micro_batch_one_says_so():
    model = ModelShape.from_llama(load_llama_config("llama2-7b"))
    with pytest.raises(NothingFits, match="no tensor-parallel degree above 32 fits") as info:
        plan_recompute(model, TrainingSetup(seq_len=4096, micro_batch=1, tp=32, dp=1, zero1=False), 4)
    assert info.value.smallest_tp is None and info.value.largest_micro_batch is None


# ---------------------------------------------------------------------------------------------
# Per-layer RecomputeConfig lists on a real model.


def _loss_and_grads(per_layer):
    nc.initialize_model_parallel(1)
    try:
        torch.manual_seed(0)
        # The per-layer list goes straight to apply_recompute, as a plan from `neuron-ckpt plan` would.
        model = LlamaForCausalLM(tiny_config(**SIZES, num_hidden_layers=4)).train()
        apply_recompute(model, per_layer)
        ids, labels = _batch(1)
        layers = [unwrapped(m) for m in model.layers]  # the layers, not the Recompute holding one
        with counted_forwards([type(layers[0]), CoreAttention, SwiGLU]) as calls:
            loss = model(ids, labels=labels).loss
            loss.backward()
        counts = [(calls(m), calls(unwrapped(m.self_attn.core_attn)), calls(unwrapped(m.mlp.act_fn))) for m in layers]
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, counts
    finally:
        nc.destroy_distributed()


def test_per_layer_list_gives_same_loss_grads_and_right_call_counts():
    ref_loss, ref_grads, ref_counts = _loss_and_grads(None)
    per_layer = _configs(("full", "selective", "none", "selective+mlp_act"))
    loss, grads, counts = _loss_and_grads(per_layer)
    assert ref_counts == [(1, 1, 1)] * 4
    # (layer, core attention, SwiGLU) forwards: full reruns everything in layer 0; selective
    # reruns core attention; mlp_act reruns SwiGLU too.
    assert counts == [(2, 2, 2), (1, 2, 1), (1, 1, 1), (1, 2, 2)]
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    for name in ref_grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-5, atol=1e-6, msg=name)


def test_per_layer_list_is_validated():
    layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(3))
    with pytest.raises(ValueError, match="one entry per layer: got 2 entries for a stack of 3"):
        apply_recompute(layers, [None, None])
    grouped = RecomputeConfig(granularity="full", method="uniform", num_layers=2)
    with pytest.raises(ValueError, match=r"recompute\[1\].*num_layers=1"):
        apply_recompute(layers, [None, grouped, None])
    with pytest.raises(TypeError, match=r"recompute\[0\]"):
        apply_recompute(layers, ["full", None, None])
    full = RecomputeConfig(granularity="full", method="uniform", num_layers=1)
    assert apply_recompute(layers, [full, None, RecomputeConfig()]) == ["0"]


# ---------------------------------------------------------------------------------------------
# The CLI.


def _run(argv: list[str]) -> int:
    """``neuron-ckpt plan ...``'s exit status."""
    try:
        return cli_main(["plan", *argv])
    except SystemExit as exc:  # bad input: one line on stderr
        return exc.code


SEVEN_B = ["--config", "llama2-7b", "--tp", "8", "--dp", "4", "--seq", "4096", "--micro-batch", "1"]


def test_cli_prints_the_plan(capsys):
    assert _run([*SEVEN_B, "--device-memory", "trn1"]) == 0
    out = capsys.readouterr().out
    assert "plan: 32 x none" in out and "optimizer moments" in out
    assert "optimizer step: largest collective 128 MiB" in out and "host memory (trn1.32xlarge" in out
    assert "checkpoint on disk per step" in out
    assert (
        _run([*SEVEN_B[:-1], "2", "--device-memory", "16", "--reserve", "0", "--attention", "explicit", "--json"]) == 0
    )
    data = json.loads(capsys.readouterr().out)
    assert data["attention"] == "explicit" and data["attention_notes"] == []
    assert data["fits"] and data["counts"] == {
        "none": 16,
        "selective": 4,
        "selective+mlp_act": 1,
        "selective+mlp_act+norm": 11,
    }
    assert data["optimizer_step"]["largest_collective_bytes"] == 128 * 2**20
    assert data["host"]["instance"] == "trn1.32xlarge" and data["host"]["fits"]
    assert data["recompute_is_per_layer"]
    assert data["alternatives"]["selective"]["fits"] and not data["alternatives"]["none"]["fits"]


def test_cli_with_flash_attention_offers_no_selective_recompute(capsys):
    """The reference recipe (Llama-3 8B, TP 8, s 8192, flash, trn1): none fits, no mask, no
    selective option (its saving would be the fp32 logsumexp), and the NKI kernel's repeated
    k/v named with their bytes."""
    argv = ["--config", "llama3-8b", "--tp", "8", "--dp", "16", "--seq", "8192", "--device-memory", "trn1"]
    assert _run([*argv, "--json"]) == 0  # flash is the default
    data = json.loads(capsys.readouterr().out)
    assert data["attention"] == "flash" and data["counts"] == {"none": 32}
    assert set(data["alternatives"]) == {"none", "full"}
    assert "attention mask" not in [item["name"] for item in data["budget"]["items"]]
    lse = 4 * 4 * 8192  # fp32, 32/8 heads, s = 8192
    assert f"drop {lse / 1024:,.1f} KiB per layer" in data["attention_notes"][0]
    assert "12.0 MiB per layer more" in data["attention_notes"][1]  # 2 * 2 bytes * 8192 * (4 - 1) * 128
    assert _run([*argv, "--attention", "explicit", "--json"]) == 0
    explicit = json.loads(capsys.readouterr().out)
    assert explicit["counts"].get("selective", 0) > 0 and explicit["overhead"] > 0
    assert explicit["budget"]["total_bytes"] > data["budget"]["total_bytes"]


def test_budget_follows_the_attention():
    model = ModelShape.from_llama(load_llama_config("llama3-8b"))
    explicit = TrainingSetup(8192, tp=8, dp=16)
    flash = replace(explicit, attention="flash")
    # With flash, core attention is never recomputed; the output-discarding modules still are.
    assert set(layer_options(model, flash)) == {"none", "selective[mlp_act]", "selective[mlp_act,norm]", "full"}
    lean = layer_options(model, flash)["selective[mlp_act,norm]"]
    assert (
        lean.saved_bytes
        < layer_options(model, flash)["selective[mlp_act]"].saved_bytes
        < layer_options(model, flash)["none"].saved_bytes
    )
    with pytest.raises(ValueError, match="'selective' is not offered.*flash"):
        memory_budget(model, flash, "selective")
    kept = memory_budget(model, explicit, "full").activation_bytes, memory_budget(model, flash, "full").activation_bytes
    assert kept[0] == kept[1]  # full recompute keeps the layer input either way
    items = {i.name: i for i in memory_budget(model, explicit, "full").items}
    flash_items = {i.name: i for i in memory_budget(model, flash, "full").items}
    assert items["attention mask"].nbytes == 8192**2 and "attention mask" not in flash_items
    assert items["peak workspace"].note.startswith("attention")  # [b, 4, s, s] scores at s = 8192
    assert not flash_items["peak workspace"].note.startswith("attention")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--tp", "3", "--seq", "4096", "--device-memory", "trn1"], "tp (3) must divide heads"),
        (["--seq", "4096", "--device-memory", "trn2x"], "device memory"),
        (["--seq", "4096", "--device-memory", "-1"], "device memory"),
        (["--seq", "4096", "--config", "/nonexistent.json", "--device-memory", "16"], "config"),
        (["--model", "gpt", "--seq", "2048", "--device-memory", "16"], "--hidden"),
        (["--seq", "0", "--device-memory", "16"], "seq_len"),
    ],
)
def test_cli_bad_input_is_one_line_and_exit_2(capsys, argv, message):
    assert _run(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err


def test_cli_nothing_fits_exits_1_with_the_reason(capsys):
    assert _run([*SEVEN_B[:-2], "--micro-batch", "8", "--tp", "2", "--device-memory", "trn1"]) == 1
    err = capsys.readouterr().err
    assert "nothing fits" in err and "would fit" in err


# ---------------------------------------------------------------------------------------------
# The CLI with a pipeline (the model: tests/test_memory_pipeline.py).


def test_cli_pp_1_is_the_plan_without_a_pipeline(capsys):
    argv = [*SEVEN_B, "--device-memory", "trn1", "--attention", "explicit"]
    assert _run(argv) == 0
    plain = capsys.readouterr().out
    for extra in (["--pp", "1"], ["--pp", "1", "--micro-batches", "64"]):
        assert _run([*argv, *extra]) == 0
        assert capsys.readouterr().out == plain


NXD_70B = ["--tp", "32", "--dp", "4", "--device-memory", "trn1", "--pp", "8", "--micro-batches", "256"]


def test_cli_pp_json_lists_every_stage(capsys):
    """NxD's Llama-3.1 70B recipe (s 8192, flash, 1F1B, m 256): one entry per stage, stage i
    holding 8 - i micro-batches of its layers, no recompute needed."""
    assert _run(["--config", "llama3.1-70b", "--seq", "8192", *NXD_70B, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["fits"] and data["pp"] == 8 and data["schedule"] == "1f1b" and data["smallest_pp"] is None
    assert [s["stage"] for s in data["stages"]] == list(range(8))
    for i, stage in enumerate(data["stages"]):
        assert {"stage", "layers", "microbatches_in_flight", "activation_bytes", "total_bytes", "recompute"} <= set(
            stage
        )
        n = (9, 10, 10, 10, 10, 10, 11, 10)[i]  # the pipeline's own cut of 80 layers
        assert stage["layers"] == n and stage["microbatches_in_flight"] == 8 - i and stage["recompute"] == {"none": n}
        assert stage["activation_bytes"] < stage["total_bytes"] <= data["limit_bytes"]
        assert stage["total_bytes"] == stage["budget"]["total_bytes"]


def test_cli_pp_nothing_fits_names_the_smallest_pp(capsys):
    argv = [
        "--config",
        "llama3.1-70b",
        "--seq",
        "8192",
        "--tp",
        "32",
        "--dp",
        "4",
        "--device-memory",
        "trn1",
        "--pp",
        "2",
        "--micro-batches",
        "16",
        "--schedule",
        "gpipe",
        "--attention",
        "explicit",
    ]
    assert _run(argv) == 1
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and "nothing fits" in captured.err and "would fit: pp=3" in captured.err
    assert "stage  layers  in flight" in captured.out  # the stages are printed all the same


@pytest.mark.parametrize("extra, message", [
    (["--virtual-stages", "2"], "--virtual-stages applies to a pipeline"),
    (["--schedule", "gpipe", "--stage-layers", "16,16"], "--schedule, --stage-layers apply to a pipeline"),
    (["--pp", "2"], "--micro-batches is required"),
    (["--pp", "4", "--micro-batches", "2"], "must be >= pp (4) for torch's 1F1B"),
    (["--pp", "2", "--micro-batches", "4", "--stage-layers", "10,20"], "add up to 30, the model has 32"),
    (["--pp", "2", "--micro-batches", "4", "--stage-layers", "ten"], "comma-separated layer counts"),
])  # fmt: skip
def test_cli_pp_bad_input_is_one_line_and_exit_2(capsys, extra, message):
    assert _run([*SEVEN_B, "--device-memory", "trn1", *extra]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err
