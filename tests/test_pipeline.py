"""Pipeline parallelism on torch.distributed.pipelining, with recompute per stage: what it must do.

* The layout is NxD's and Megatron's: TP contiguous, then DP, then PP
  (``rank = pp_rank * dp * tp + dp_rank * tp + tp_rank``); ``pipeline_parallel_size=1`` is the
  layout without PP, group for group.
* The cut minimises the most expensive stage (each layer 1, embedding and head configurable) and
  gives the extra layers to the later stages; a user's cut is taken as given; impossible cuts are
  refused in one line.
* The loss and every gradient of a pipeline step equal the pp=1 model's (``LlamaForCausalLM`` on
  one process, the same weights and global batch), at pp 2 and pp 2 x tp 2 with sequence
  parallel, for GPipe, 1F1B, the interleaved schedules (2 virtual stages) and zero bubble, with and
  without recompute (full block ``k`` per stage, selective, a per-layer plan), an uneven cut and
  tied embeddings.

  Tolerance 1e-5, relative to the largest element (``rel_max``), in fp32: the pipeline runs the
  same ops on micro-batches, so what differs is summation order (the loss summed over ``m``
  micro-batches instead of one reduction over the batch, parameter gradients accumulated over ``m``
  backward passes instead of one batched matmul, the vocab-parallel sums over TP): a few fp32
  ulps on sums of tens to hundreds of terms, measured below 1e-6; 1e-5 leaves a margin of 10 and
  still fails on any real error (a wrong micro-batch scale is 1/m, a lost tied gradient 100%).
* Recompute counts per stage (Megatron's ``recompute_num_layers`` "within each pipeline stage",
  per virtual stage when interleaved) and replays dropout bit-exact with each stage's own streams;
  dropout masks do not depend on the schedule; the step leaves the caller's generators alone.
* Stages built from one seed hold the same model whatever the cut, ``p`` or ``t``; tied ends start
  equal and stay equal through an optimizer step.

Every multi-process call is bounded (``_run``: 120 s), so a pipeline that hangs on gloo fails the
test instead of hanging CI.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import transformers

import neuron_ckpt as nc
from neuron_ckpt.distributed.parallel_state import Group, ParallelState, parallel_layout
from neuron_ckpt.models import LlamaForCausalLM
from neuron_ckpt.pipeline import (
    LlamaPipeline,
    LlamaStage,
    PipelineConfig,
    apply_pipeline_recompute,
    check_tied_weights,
    cut_layers,
)  # fmt: skip
from neuron_ckpt.pipeline.hf_weights import stage_hf_state_dict
from neuron_ckpt.recompute import Recompute, RecomputeConfig, apply_recompute

from .helpers import rel_max

VOCAB, SEQ, MB = 64, 16, 2  # micro-batch size MB
TOL = 1e-5
BOUND_S = 120


def _run(world, n: int, fn, *args):
    """``world(n).run(fn, *args)`` that fails after BOUND_S seconds instead of hanging."""
    w = world(n)
    before, w.timeout_s = w.timeout_s, BOUND_S
    try:
        return w.run(fn, *args)
    finally:
        w.timeout_s = before


def config(layers: int = 4, tied: bool = False, dropout: float = 0.0) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=tied,
        attention_dropout=dropout, attn_implementation="eager",
    )  # fmt: skip


def _one_process() -> ParallelState:
    one = Group(None, (0,), ((0,),), 0)  # a single process: no process group needed
    return ParallelState(one, one)


def batch(m: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``m`` micro-batches; ignored targets spread unevenly, so a per-micro-batch mean would differ."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (m * MB, SEQ), generator=g)
    labels = ids.clone()
    labels[0, :5] = -100
    labels[-1, 2:11] = -100
    return ids, labels


def reference(cfg: transformers.LlamaConfig, m: int) -> tuple[dict, float, dict]:
    """The pp=1 model on this process: weights, loss, gradients (transformers names)."""
    torch.manual_seed(0)
    ref = LlamaForCausalLM(cfg, parallel_state=_one_process())
    with torch.no_grad():  # non-trivial norm weights, so a norm gradient bug cannot hide behind ones
        for name, p in ref.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    ids, labels = batch(m)
    out = ref(ids, labels)
    out.loss.backward()
    return ref.hf_state_dict(), out.loss.item(), ref.hf_grad_dict()


# ---------------------------------------------------------------------------------------------
# The layout (pure).


def test_layout_is_tp_then_dp_then_pp():
    layout = parallel_layout(8, tensor_parallel_size=2, pipeline_parallel_size=2)
    assert layout.tp == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert layout.dp == ((0, 2), (1, 3), (4, 6), (5, 7))
    assert layout.pp == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert layout.embedding == layout.pp
    t, p, d = 2, 3, 4  # every rank at its formula's place, every group a partition of the world
    layout = parallel_layout(t * p * d, t, p)
    for pp, dp, tp in itertools.product(range(p), range(d), range(t)):
        rank = pp * d * t + dp * t + tp
        assert layout.tp[pp * d + dp][tp] == rank
        assert layout.dp[pp * t + tp][dp] == rank
        assert layout.pp[dp * t + tp][pp] == rank
    for groups in (layout.tp, layout.dp, layout.pp):
        assert sorted(r for g in groups for r in g) == list(range(t * p * d))
    assert layout.embedding == tuple((g[0], g[-1]) for g in layout.pp)


def test_layout_without_pp_is_the_old_one():
    layout = parallel_layout(8, tensor_parallel_size=2)
    assert layout.tp == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert layout.dp == ((0, 2, 4, 6), (1, 3, 5, 7))
    assert layout.pp == tuple((r,) for r in range(8))


@pytest.mark.parametrize("args, field", [
    ((6, 4, 1), "does not divide the world size 6"), ((8, 2, 3), "pipeline_parallel_size=3"),
    ((8, 1, 0), "pipeline_parallel_size must be a positive int"), ((8, True, 1), "tensor_parallel_size"),
])  # fmt: skip
def test_layout_refuses_sizes_that_do_not_fit(args, field):
    with pytest.raises(ValueError, match=field) as e:
        parallel_layout(*args)
    assert "\n" not in str(e.value)


# ---------------------------------------------------------------------------------------------
# The cut (pure).


def _brute_force(n: int, s: int, e: float, h: float) -> tuple[int, ...]:
    """Every cut with a layer per stage: the smallest most expensive stage, then the largest
    cheapest stage, then the one whose later stages hold the most layers."""
    cuts = [c for c in itertools.product(range(1, n + 1), repeat=s) if sum(c) == n]
    costs = lambda c: [x + (e if k == 0 else 0) + (h if k == s - 1 else 0) for k, x in enumerate(c)]  # noqa: E731
    best = min(max(costs(c)) for c in cuts)
    cuts = [c for c in cuts if max(costs(c)) == best]
    even = max(min(costs(c)) for c in cuts)
    return max((c for c in cuts if min(costs(c)) == even), key=lambda c: c[::-1])


@pytest.mark.parametrize("e, h", [(1.0, 1.0), (0.0, 0.0), (0.5, 2.0), (3.0, 0.0)])
def test_balanced_cut_is_the_cheapest_then_the_most_even_with_later_stages_heavier(e, h):
    for n, s in itertools.product(range(1, 9), range(1, 5)):
        if n >= s:
            got = cut_layers(n, s, embedding_cost=e, head_cost=h).layers_per_stage
            assert got == _brute_force(n, s, e, h), (n, s)


def test_cut_examples_and_placement():
    assert cut_layers(4, 2).layers == (range(0, 2), range(2, 4))
    assert cut_layers(5, 2).layers_per_stage == (2, 3)  # the extra layer to the later stage
    assert cut_layers(32, 4, embedding_cost=2, head_cost=2).layers_per_stage == (7, 9, 9, 7)
    cut = cut_layers(8, 2, virtual_stages=2, layers_per_stage=[1, 3, 2, 2])  # uneven, the user's
    assert cut.layers == (range(0, 1), range(1, 4), range(4, 6), range(6, 8))
    assert cut.stages_of_rank(0) == (0, 2) and cut.stages_of_rank(1) == (1, 3)  # loop placement
    assert [cut.rank_of_stage(k) for k in range(4)] == [0, 1, 0, 1]


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_layers=3, pipeline_parallel_size=2, virtual_stages=2), "cannot cut 3 layers into 4 stages"),
    (dict(num_layers=4, pipeline_parallel_size=2, layers_per_stage=[4]), "1 entries for 2 stages"),
    (dict(num_layers=4, pipeline_parallel_size=2, layers_per_stage=[0, 4]), "at least one layer"),
    (dict(num_layers=4, pipeline_parallel_size=2, layers_per_stage=[2, 3]), "sums to 5, the model has 4"),
    (dict(num_layers=4, pipeline_parallel_size=2, layers_per_stage="22"), "list of ints"),
    (dict(num_layers=4, pipeline_parallel_size=2, head_cost=-1), "head_cost"),
])  # fmt: skip
def test_impossible_cuts_are_refused_in_one_line(kwargs, message):
    with pytest.raises(ValueError, match=message) as e:
        cut_layers(**kwargs)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("kwargs, message", [
    (dict(schedule="ZBVZeroBubble"), "places stages in a V"),
    (dict(schedule="DualPipeV"), "places stages in a V"),
    (dict(schedule="PipeDream"), "schedule must be one of"),
    (dict(schedule="1F1B", virtual_stages=2), "virtual_stages must be 1"),
    (dict(schedule="Interleaved1F1B"), "needs virtual_stages >= 2"),
    (dict(micro_batches=0), "micro_batches must be a positive int"),
    (dict(loss_average="sum"), "loss_average must be one of"),
])  # fmt: skip
def test_pipeline_config_refuses_in_one_line(kwargs, message):
    with pytest.raises(ValueError, match=message) as e:
        PipelineConfig(**kwargs)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("kwargs, p, message", [
    (dict(schedule="1F1B", micro_batches=1), 2, "micro_batches >= pipeline_parallel_size=2"),
    (dict(schedule="Interleaved1F1B", virtual_stages=2, micro_batches=9), 4, "multiple of"),
    (dict(), 1, "pipeline_parallel_size >= 2"),
])  # fmt: skip
def test_pipeline_config_checks_the_pipeline_size(kwargs, p, message):
    with pytest.raises(ValueError, match=message) as e:
        PipelineConfig(**kwargs).validate(p)
    assert "\n" not in str(e.value)


# ---------------------------------------------------------------------------------------------
# Parity with the pp=1 model (2 and 4 processes).

BLOCK_1 = dict(granularity="full", method="block", num_layers=1)
SELECTIVE = dict(granularity="selective")
PER_LAYER = [None, RecomputeConfig.preset("full"), RecomputeConfig.preset("selective+mlp_act"), None]

# (schedule, virtual stages, micro-batches, recompute, layers per stage, tied)
PP2_CASES = [
    ("GPipe", 1, 4, None, None, False),
    ("1F1B", 1, 4, None, None, False),
    ("Interleaved1F1B", 2, 4, None, None, False),
    ("LoopedBFS", 2, 2, None, None, False),
    ("InterleavedZeroBubble", 2, 4, None, None, False),
    ("1F1B", 1, 4, BLOCK_1, None, False),
    ("GPipe", 1, 2, SELECTIVE, None, True),
    ("1F1B", 1, 3, PER_LAYER, [1, 3], False),  # uneven, and m not a multiple of p
    ("Interleaved1F1B", 2, 4, SELECTIVE, None, True),
    ("InterleavedZeroBubble", 2, 4, BLOCK_1, None, False),
]
PP4_CASES = [("1F1B", 1, 4, BLOCK_1, None, True)]  # middle stages outside the embedding group
PP2_TP2_CASES = [
    ("1F1B", 1, 4, None, None, False),
    ("GPipe", 1, 2, BLOCK_1, None, True),
    ("Interleaved1F1B", 2, 4, SELECTIVE, None, True),
    ("1F1B", 1, 2, PER_LAYER, [3, 1], False),
]


def _parity(t: int, case: tuple) -> dict:
    schedule, v, m, recompute, cut, tied = case
    cfg = config(tied=tied)
    weights, ref_loss, ref_grads = reference(cfg, m)
    pipe = LlamaPipeline(cfg, PipelineConfig(schedule, m, v, cut), MB, SEQ, sequence_parallel=t > 1)
    if recompute is not None:
        apply_pipeline_recompute(pipe, RecomputeConfig(**recompute) if isinstance(recompute, dict) else recompute)
    pipe.load_hf_state_dict(weights)
    loss = pipe.step(*batch(m))
    grads = pipe.hf_state_dict(grads=True)
    return {
        "loss": None if loss is None else rel_max(loss, torch.tensor(ref_loss)),
        "grads": max(rel_max(g, ref_grads[k]) for k, g in grads.items()),
        "keys": sorted(grads),
        "recomputed": sorted(n for m_ in pipe.modules for n, mod in m_.named_modules() if isinstance(mod, Recompute)),
        "stages": pipe.stage_indices,
    }


def _parity_cases(t: int, p: int, cases: list) -> list[dict]:
    nc.initialize_model_parallel(tensor_parallel_size=t, pipeline_parallel_size=p)
    return [_parity(t, case) for case in cases]


@pytest.fixture(scope="module")
def parity(world) -> dict[int, list[list[dict]]]:
    return {
        "pp2": _run(world, 2, _parity_cases, 1, 2, PP2_CASES),
        "pp4": _run(world, 4, _parity_cases, 1, 4, PP4_CASES),
        "pp2tp2": _run(world, 4, _parity_cases, 2, 2, PP2_TP2_CASES),
    }


SETUPS = {"pp2": (PP2_CASES, 1), "pp4": (PP4_CASES, 1), "pp2tp2": (PP2_TP2_CASES, 2)}  # cases, ranks of the last stage


@pytest.mark.parametrize("setup, i", [(k, i) for k, (cases, _) in SETUPS.items() for i in range(len(cases))])
def test_loss_and_every_gradient_equal_the_pp1_model(parity, setup, i):
    cases, last = SETUPS[setup]
    ranks = [rank_cases[i] for rank_cases in parity[setup]]
    for rank in ranks:
        assert rank["grads"] < TOL, rank
    losses = [r["loss"] for r in ranks if r["loss"] is not None]
    assert len(losses) == last and max(losses) < TOL  # the last stage's ranks (one per TP rank)
    keys = set().union(*(set(r["keys"]) for r in ranks))
    tied = cases[i][5]
    assert len(keys) == 4 * 9 + (2 if tied else 3)  # every parameter on some stage (9 per layer)
    print(f"\n{setup} {cases[i]}: loss {max(losses):.1e}, gradients {max(r['grads'] for r in ranks):.1e} (relative)")


def test_recompute_counts_per_stage(parity):
    # 1F1B, block k=1, cut [2, 2]: the first layer of each stage (Megatron's per-stage count).
    assert parity["pp2"][0][0]["recomputed"] == parity["pp2"][1][0]["recomputed"] == []  # GPipe without recompute
    assert parity["pp2"][0][5]["recomputed"] == ["layers.0"] and parity["pp2"][1][5]["recomputed"] == ["layers.2"]
    # Per-layer plan over the whole model, uneven cut [1, 3]: each stage takes its slice.
    assert parity["pp2"][0][7]["recomputed"] == []
    assert parity["pp2"][1][7]["recomputed"] == ["layers.1", "layers.2.mlp.act_fn", "layers.2.self_attn.core_attn"]
    assert parity["pp2"][0][2]["stages"] == (0, 2) and parity["pp2"][1][2]["stages"] == (1, 3)  # 2 virtual stages


def _block_per_virtual_stage() -> list[list[str]]:
    nc.initialize_model_parallel(pipeline_parallel_size=2)
    pipe = LlamaPipeline(config(layers=8), PipelineConfig("Interleaved1F1B", 2, 2, [2, 2, 2, 2]), MB, SEQ)
    names = apply_pipeline_recompute(pipe, RecomputeConfig(**BLOCK_1))
    return [names, [type(m.layers[str(m.layer_ids.start)]).__name__ for m in pipe.modules]]


def test_block_recompute_counts_per_virtual_stage(world):
    (names0, kinds0), (names1, kinds1) = _run(world, 2, _block_per_virtual_stage)
    # 8 layers, 4 virtual stages of 2: the first layer of each virtual stage.
    assert names0 == ["0", "4"] and names1 == ["2", "6"]
    assert kinds0 == kinds1 == ["Recompute", "Recompute"]


def _per_stage_plan() -> list[str]:
    nc.initialize_model_parallel(pipeline_parallel_size=2)
    pipe = LlamaPipeline(config(), PipelineConfig("1F1B", 2), MB, SEQ)
    block_2 = RecomputeConfig(granularity="full", method="block", num_layers=2)
    return apply_pipeline_recompute(pipe, [block_2, [None, RecomputeConfig.preset("selective")]])


def test_a_plan_per_stage(world):
    # The first stage (most micro-batches in flight under 1F1B) recomputes more than the last.
    assert _run(world, 2, _per_stage_plan) == [["0", "1"], ["3.self_attn.core_attn"]]


# ---------------------------------------------------------------------------------------------
# Dropout: each stage's streams, bit-exact replay, independent of the schedule.


def _dropout_runs() -> dict:
    nc.initialize_model_parallel(tensor_parallel_size=1, pipeline_parallel_size=2)
    ids, labels = batch(4)

    def run(schedule: str, recompute, dropout: float = 0.1, v: int = 1):
        pipe = LlamaPipeline(config(dropout=dropout), PipelineConfig(schedule, 4, v), MB, SEQ, seed=7)
        if recompute is not None:
            apply_pipeline_recompute(pipe, RecomputeConfig(**recompute))
        outer = torch.get_rng_state()
        loss = pipe.step(ids, labels)
        untouched = torch.equal(outer, torch.get_rng_state())
        return loss, pipe.hf_state_dict(grads=True), untouched, [m.rng.seed for m in pipe.modules]

    base = run("1F1B", None)
    others = {
        "full": run("1F1B", dict(granularity="full", method="uniform", num_layers=2)),
        "selective": run("1F1B", SELECTIVE),
        "gpipe": run("GPipe", None),
    }
    no_dropout = run("1F1B", None, dropout=0.0)

    def equal(a, b) -> bool:
        return (a[0] is None or torch.equal(a[0], b[0])) and all(torch.equal(g, b[1][k]) for k, g in a[1].items())

    same = {name: equal(other, base) for name, other in others.items()}
    # Two virtual stages per rank, run in turns in different orders: each keeps its own streams, so
    # the masks agree. The two schedules accumulate the micro-batches' weight gradients in different
    # orders (1e-7 apart with dropout off too), so the gradients agree to rounding, not bit for bit;
    # with one stream per rank the masks differ and so do the gradients (by 80-90%).
    a, b = run("Interleaved1F1B", None, v=2), run("LoopedBFS", None, v=2)
    same["interleaved_vs_bfs"] = (a[0] is None or torch.equal(a[0], b[0])) and max(
        rel_max(g, b[1][k]) for k, g in a[1].items()
    ) < 1e-6
    changed = None if base[0] is None else not torch.equal(base[0], no_dropout[0])
    return {"same": same, "changed": changed, "untouched": base[2], "seeds": base[3]}


def test_dropout_replays_bit_exact_with_each_stages_streams(world):
    r0, r1 = _run(world, 2, _dropout_runs)
    for r in (r0, r1):
        assert r["same"] == {"full": True, "selective": True, "gpipe": True, "interleaved_vs_bfs": True}, r
        assert r["untouched"]  # the caller's default generator is where it was
    assert r1["changed"]  # dropout is on: the loss is not the no-dropout one
    assert r0["seeds"] == [7] and r1["seeds"] == [107]  # Megatron's seed + 100 * stage


# ---------------------------------------------------------------------------------------------
# Initialisation, tied ends, the layout at run time, bad input.


def _init_and_tied(t: int, p: int, cut) -> dict:
    state = nc.initialize_model_parallel(tensor_parallel_size=t, pipeline_parallel_size=p)
    cfg = config(tied=True)
    pipe = LlamaPipeline(cfg, PipelineConfig("1F1B", 2, layers_per_stage=cut), MB, SEQ, sequence_parallel=t > 1, seed=3)
    whole = LlamaStage(cfg, range(0, 4), 0, 1, parallel_state=_one_process(), seed=3)  # pp=1, t=1
    reference = stage_hf_state_dict(whole)
    same_init = all(torch.equal(v, reference[k]) for k, v in pipe.hf_state_dict().items())
    # LlamaForCausalLM from the same seed is that model too (one seed, one model, any layout).
    model = LlamaForCausalLM(cfg, parallel_state=_one_process(), seed=3).hf_state_dict()
    same_init = same_init and model.keys() == reference.keys()
    same_init = same_init and all(torch.equal(v, reference[k]) for k, v in model.items())
    tied_at_init = check_tied_weights(pipe.modules, state)
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.5)
    pipe.step(*batch(2))
    optimizer.step()
    return {
        "same_init": same_init,
        "tied_at_init": tied_at_init,
        "tied_after_step": check_tied_weights(pipe.modules, state),
        "groups": (state.tp.ranks, state.dp.ranks, state.pp.ranks, state.embedding.ranks),
        "ends": (state.pp_rank, state.is_first_stage, state.is_last_stage),
        "shared_in_one_stage": whole.lm_head.weight is whole.embed_tokens.weight,
    }


def test_stages_of_one_seed_hold_one_model_and_tied_ends_stay_equal(world):
    for rank in _run(world, 2, _init_and_tied, 1, 2, [1, 3]) + _run(world, 4, _init_and_tied, 2, 2, None):
        assert rank["same_init"] and rank["shared_in_one_stage"]
        assert rank["tied_at_init"] == 0.0 and rank["tied_after_step"] == 0.0


def _accumulation() -> float:
    nc.initialize_model_parallel(pipeline_parallel_size=2)
    cfg, pc = config(tied=True), PipelineConfig("1F1B", 2)
    once, twice = LlamaPipeline(cfg, pc, MB, SEQ), LlamaPipeline(cfg, pc, MB, SEQ)
    once.step(*batch(2))
    twice.step(*batch(2), finish_gradients=False)
    twice.step(*batch(2), finish_gradients=False)
    twice.finish_gradients()  # once per optimizer step: the tied sum of two steps, not of a sum
    return max(rel_max(g, 2 * once.hf_state_dict(grads=True)[k]) for k, g in twice.hf_state_dict(grads=True).items())


def test_gradients_accumulate_over_steps_and_tied_ends_are_summed_once(world):
    for err in _run(world, 2, _accumulation):
        assert err < 1e-6  # 2 * g against g + g: rounding of one fp32 addition


def test_layout_at_run_time(world):
    ranks = _run(world, 4, _init_and_tied, 2, 2, None)
    assert [r["groups"] for r in ranks] == [
        ((0, 1), (0,), (0, 2), (0, 2)), ((0, 1), (1,), (1, 3), (1, 3)),
        ((2, 3), (2,), (0, 2), (0, 2)), ((2, 3), (3,), (1, 3), (1, 3)),
    ]  # fmt: skip
    assert [r["ends"] for r in ranks] == [(0, True, False), (0, True, False), (1, False, True), (1, False, True)]


def _groups_at_pp4() -> tuple:
    state = nc.initialize_model_parallel(pipeline_parallel_size=4)
    return state.pp.ranks, None if state.embedding is None else state.embedding.ranks, state.dp.ranks


def test_middle_stages_are_outside_the_embedding_group(world):
    assert _run(world, 4, _groups_at_pp4) == [
        ((0, 1, 2, 3), (0, 3), (0,)), ((0, 1, 2, 3), None, (1,)),
        ((0, 1, 2, 3), None, (2,)), ((0, 1, 2, 3), (0, 3), (3,)),
    ]  # fmt: skip


def _bad_inputs() -> list[str]:
    def pipe():
        return LlamaPipeline(config(), PipelineConfig("1F1B", 2), MB, SEQ)

    def zero_bubble():
        return LlamaPipeline(config(), PipelineConfig("InterleavedZeroBubble", 4, 2), MB, SEQ)

    def discarding_applied_to_a_stage(pipe):
        apply_recompute(pipe.modules[0], RecomputeConfig(granularity="selective", modules=["core_attn", "norm"]))
        return pipe

    calls = (
        lambda: nc.initialize_model_parallel(tensor_parallel_size=1, pipeline_parallel_size=3),
        lambda: pipe().step(*batch(3)),
        lambda: apply_pipeline_recompute(pipe(), RecomputeConfig(granularity="full", method="block", num_layers=3)),
        lambda: apply_pipeline_recompute(pipe(), [None] * 3),
        lambda: LlamaPipeline(config(), PipelineConfig("1F1B", 2), 0, SEQ),
        lambda: apply_pipeline_recompute(zero_bubble(), RecomputeConfig(granularity="selective", use_reentrant=True)),
        lambda: apply_pipeline_recompute(zero_bubble(), RecomputeConfig.preset("selective+mlp_act")),
        lambda: discarding_applied_to_a_stage(zero_bubble()).step(*batch(4)),
    )
    messages = []
    for i, call in enumerate(calls):
        try:
            call()
            messages.append("no error")
        except ValueError as e:
            messages.append(str(e))
        if i == 0:
            nc.initialize_model_parallel(tensor_parallel_size=1, pipeline_parallel_size=2)
    return messages


def test_bad_inputs_are_refused_in_one_line(world):
    for messages in _run(world, 2, _bad_inputs):
        assert "does not divide the world size 2" in messages[0]
        assert "input_ids must be a [4, 16] tensor" in messages[1] or "labels must be a [4, 16]" in messages[1]
        assert "stage 0 (2 layers)" in messages[2] and "num_layers=3" in messages[2]
        assert "one entry per layer (4) or per stage (2), got 3" in messages[3]
        assert "micro_batch_size must be a positive int, got 0" in messages[4]
        # Zero bubble's split backward refuses the reentrant checkpoint and output-discarding units
        # (they raised mid-step and left the peer waiting), before the step.
        assert "stage 0" in messages[5] and "reentrant" in messages[5]
        assert "output-discarding recompute (mlp_act)" in messages[6]
        assert "layernorm: schedule 'InterleavedZeroBubble'" in messages[7] and "output-discarding" in messages[7]
        assert all("\n" not in m for m in messages)
