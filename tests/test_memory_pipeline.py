"""Pipeline memory per stage: the schedules' orders, the micro-batches in flight, each stage's bytes.

* Each rank's order of forwards and backwards is torch 2.13's own: ``ScheduleGPipe`` and
  ``Schedule1F1B`` run with a stage that records its calls, ``ScheduleInterleaved1F1B``'s
  ``pipeline_order_with_comms`` read, over a grid of degrees, micro-batches and virtual stages.
* In flight: GPipe all ``m``, 1F1B ``min(m, p - i)``, interleaved counted per virtual stage;
  the closed forms agree where ``p`` divides ``m`` and differ where torch's flexible rounds are
  longer (p = 4, m = 10, v = 2: 12 chunk forwards on rank 0, not 11).
* A stage's bytes, uneven cuts included, from one layer's analytic bytes and the terms outside
  the layers, written out independently; with one stage the budget is the whole-model budget.
* Measured = analytic: :class:`neuron_ckpt.pipeline.LlamaPipeline` (torch's schedules on gloo)
  steps a tiny bf16 Llama under ``LiveSavedTensors`` on every rank (reentrant recompute, whose
  rerun it sees): the most kept once a forward and its loss are done and the peak over the step
  equal the stage budget to the byte, at p = 2 and 4 (TP 1) and p = 2 x TP 2 + sequence parallel,
  GPipe, 1F1B and interleaved, uneven cuts, per-layer recompute mixes. The two differences are
  asserted to the byte: the batch's one shared token count (8 bytes), and with output-discarding
  recompute (``mlp_act``) the recomputed SwiGLU output, which backward unpacks without packing it.
* The planner's choice per stage is the cheapest that fits (brute force over every per-layer
  assignment of a stage), and the smallest pipeline degree it names is the first that fits.
"""

from __future__ import annotations

import itertools
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

import neuron_ckpt as nc
from neuron_ckpt.memory import ModelShape, TrainingSetup, memory_budget
from neuron_ckpt.memory.analytic import layer_activation_bytes, rotary_terms
from neuron_ckpt.memory.budget import _outside_items, embedding_bytes
from neuron_ckpt.memory.options import layer_options
from neuron_ckpt.memory.pipeline import (
    PipelinePlan,
    PipelineSetup,
    closed_form_in_flight,
    peak_in_flight,
    plan_pipeline,
    rank_order,
    smallest_pp,
    stage_budgets,
)  # fmt: skip
from neuron_ckpt.memory.pipeline.measure import measure_rank
from neuron_ckpt.memory.pipeline.schedule import Action
from neuron_ckpt.memory.pipeline.stage_budget import RankModel
from neuron_ckpt.memory.planner import limit_bytes
from neuron_ckpt.parallel import CoreAttention
from neuron_ckpt.recompute import RecomputeConfig

from .helpers import tiny_config

# ---------------------------------------------------------------------------------------------
# The schedules: torch's order.


class _RecordingStage:
    """What ``PipelineScheduleSingle._step_microbatches`` calls on its stage, recording the
    forwards and backwards; every communication list is empty."""

    def __init__(self, index: int, stages: int):
        self.num_stages, self.stage_index = stages, index
        self.is_first, self.is_last = index == 0, index == stages - 1
        self.log: list[Action] = []

    def forward_one_chunk(self, i, *args, **kwargs):
        self.log.append(Action("F", self.stage_index, i))
        return i

    def backward_one_chunk(self, i, **kwargs):
        self.log.append(Action("B", self.stage_index, i))

    def __getattr__(self, name):
        return (lambda *a, **k: []) if name.startswith("get_") else (lambda *a, **k: None)


def _torch_single(cls, pp: int, m: int, rank: int) -> list[Action]:
    """The order torch's single-stage schedule runs on ``rank``. Private API, because the order
    lives only in ``_step_microbatches``'s code: the stage set-up (which needs real stages and a
    process group) is skipped, the schedule's own loop runs."""
    stage = _RecordingStage(rank, pp)
    schedule = cls(stage, m, loss_fn=lambda out, target: out)
    schedule._initialize_stage = lambda *a, **k: None
    schedule._step_microbatches(arg_mbs=[()] * m, target_mbs=[None] * m)
    return stage.log


def _torch_interleaved(pp: int, m: int, v: int, rank: int) -> list[Action]:
    """``ScheduleInterleaved1F1B``'s compute actions for ``rank`` (its ``pipeline_order_with_comms``,
    what ``_PipelineScheduleRuntime`` executes), built over stand-in stages."""
    from torch.distributed.pipelining import ScheduleInterleaved1F1B
    from torch.distributed.pipelining.schedules import _ComputationType as C

    stages = [
        SimpleNamespace(
            num_stages=pp * v,
            group_size=pp,
            group_rank=rank,
            stage_index=j * pp + rank,
            is_first=j * pp + rank == 0,
            is_last=j * pp + rank == pp * v - 1,
            stage_index_to_group_rank=None,
        )
        for j in range(v)
    ]
    schedule = ScheduleInterleaved1F1B(stages, m, loss_fn=lambda out, target: out)
    kinds = {C.FORWARD: "F", C.FULL_BACKWARD: "B"}
    return [
        Action(kinds[a.computation_type], a.stage_index, a.microbatch_index)
        for a in schedule.pipeline_order_with_comms[rank]
        if a is not None and a.computation_type in kinds
    ]


@pytest.mark.parametrize("pp", [2, 3, 4])
def test_gpipe_and_1f1b_orders_are_torchs(pp):
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

    for m in range(pp, 2 * pp + 2):
        for rank in range(pp):
            assert rank_order("gpipe", pp, m, rank) == _torch_single(ScheduleGPipe, pp, m, rank)
            assert rank_order("1f1b", pp, m, rank) == _torch_single(Schedule1F1B, pp, m, rank)
    assert rank_order("gpipe", pp, 1, 0) == _torch_single(ScheduleGPipe, pp, 1, 0)  # m < p: GPipe runs it


@pytest.mark.parametrize("pp,v", [(2, 2), (3, 2), (4, 2), (2, 3), (4, 3)])
def test_interleaved_order_is_torchs(pp, v):
    for m in range(1, 3 * pp + 2):
        if m % max(1, m // pp):
            continue  # torch refuses these (and so does PipelineSetup)
        for rank in range(pp):
            assert rank_order("interleaved", pp, m, rank, v) == _torch_interleaved(pp, m, v, rank), (pp, v, m, rank)


def test_in_flight_per_schedule_and_stage():
    for pp, m in [(2, 5), (4, 4), (4, 9), (8, 256)]:
        for i in range(pp):
            assert peak_in_flight("gpipe", pp, m, i).total == m
            assert peak_in_flight("1f1b", pp, m, i).total == min(m, pp - i) == closed_form_in_flight("1f1b", pp, m, i)
    # Interleaved, p = 4, v = 2, m = 8 (rounds of 4): rank 0 warms up with 10 chunk forwards and
    # holds 11 after the first forward of the steady state, 7 on stage 0 and 4 on stage 4; that is
    # the paper's first stage, p micro-batches x (1 + (p - 1) / (p v)) = 11 chunks of L / 8 layers.
    first = peak_in_flight("interleaved", 4, 8, 0, 2)
    assert first.by_stage == {0: 7, 4: 4} and first.total == 4 * 2 * (1 + 3 / 8)
    assert [peak_in_flight("interleaved", 4, 8, r, 2).total for r in range(4)] == [11, 9, 7, 5]
    assert [closed_form_in_flight("interleaved", 4, 8, r, 2) for r in range(4)] == [11, 9, 7, 5]
    # torch's flexible rounds: m = 10 makes rounds of 5, so every rank holds (v - 1)(5 - 4) more.
    assert [peak_in_flight("interleaved", 4, 10, r, 2).total for r in range(4)] == [12, 10, 8, 6]
    assert closed_form_in_flight("interleaved", 4, 10, 0, 2) == 11
    assert peak_in_flight("interleaved", 4, 3, 0, 2).total == 6  # m < p: every forward before a backward


@pytest.mark.parametrize("kwargs, needle", [
    ({"pp": 4, "microbatches": 3}, "must be >= pp (4) for torch's 1F1B"),
    ({"pp": 2, "microbatches": 4, "schedule": "interleaved"}, "virtual_stages must be >= 2"),
    ({"pp": 2, "microbatches": 4, "virtual_stages": 2}, "needs schedule 'interleaved'"),
    ({"pp": 4, "microbatches": 10, "schedule": "interleaved", "virtual_stages": 2}, None),
    ({"pp": 4, "microbatches": 9, "schedule": "interleaved", "virtual_stages": 2}, "multiple of the number of rounds"),
    ({"pp": 2, "microbatches": 2, "schedule": "zb"}, "schedule must be one of"),
    ({"pp": 0, "microbatches": 2}, "pp must be a positive integer"),
    ({"pp": 2, "microbatches": 2, "buffers": "nxd"}, "buffers must be one of"),
    ({"pp": 2, "microbatches": 2, "stage_layers": (1, 2, 3)}, "one count per virtual stage"),
    ({"pp": 3, "microbatches": 3, "stage_layers": (4, 0, 4)}, "stage 1 has no layers"),
    ({"pp": 2, "microbatches": 2, "stage_layers": (1.5, 2)}, "tuple of ints >= 0"),
])  # fmt: skip
def test_pipeline_setup_refuses_what_torch_does_not_run(kwargs, needle):
    if needle is None:
        PipelineSetup(**kwargs)
        return
    with pytest.raises(ValueError) as exc:
        PipelineSetup(**kwargs)
    assert needle in str(exc.value) and "\n" not in str(exc.value)


def test_the_default_cut_is_the_pipelines_own():
    # the plan describes the pipeline LlamaPipeline builds: its cut, balanced by cost (the
    # embedding and the head a layer each), the extra layers to the later stages
    from neuron_ckpt.pipeline.cut import cut_layers

    assert PipelineSetup(8, 16).cut(80) == cut_layers(80, 8).layers_per_stage == (9, 10, 10, 10, 10, 10, 11, 10)
    assert PipelineSetup(2, 4, "interleaved", 2).cut(8) == cut_layers(8, 2, 2).layers_per_stage
    assert cut_layers(80, 6, embedding_cost=0, head_cost=0).layers_per_stage == (13, 13, 13, 13, 14, 14)  # NxD's
    assert PipelineSetup(2, 4, stage_layers=(3, 5)).first_layers(8) == [0, 3]
    with pytest.raises(ValueError, match="add up to 9, the model has 8"):
        PipelineSetup(2, 4, stage_layers=(4, 5)).cut(8)
    with pytest.raises(ValueError, match=r"pp x virtual_stages \(16\) is more than the model's 8 layers"):
        PipelineSetup(8, 8, "interleaved", 2).cut(8)


# ---------------------------------------------------------------------------------------------
# A stage's bytes, written out.

SEVEN_B = ModelShape("llama", 4096, 32, 32, 11008, 32, 32000, "llama2-7b")


TIED = replace(SEVEN_B, tie_word_embeddings=True, name="tied")
GPT = ModelShape.gpt(2048, 16, 32)


@pytest.mark.parametrize(
    "model, attention", [(SEVEN_B, "explicit"), (SEVEN_B, "flash"), (TIED, "flash"), (GPT, "explicit")]
)
def test_one_stage_is_the_whole_model_budget(model, attention):
    """Without torch's runtime (which would hold the logits until the backward). A tied model's
    table counts once on one stage; over two, the last stage holds its own copy."""
    setup = TrainingSetup(4096, tp=8, dp=4, attention=attention)
    for layers in ["none", "full", RecomputeConfig("full", "uniform", 4), ["none", "full"] * 16]:
        whole = memory_budget(model, setup, layers)
        stage = stage_budgets(model, setup, PipelineSetup(1, 1, "gpipe", buffers="none"), layers)[0]
        assert (stage.total_bytes, stage.activation_bytes) == (whole.total_bytes, whole.activation_bytes)
        assert stage.budget.activation_peak_bytes == whole.activation_peak_bytes
    two = stage_budgets(model, setup, PipelineSetup(2, 2, "gpipe"))
    copy = model.vocab // 8 * model.hidden if model.kind == "gpt" or model.tie_word_embeddings else 0
    assert sum(b.budget.items[0].nbytes for b in two) == 2 * (model.local_parameters(8) + copy)  # bf16


def test_uneven_cut_bytes_per_stage():
    """1F1B, p = 4, m = 8, layers (5, 9, 9, 9), no recompute, TP 8 + SP: stage i keeps
    min(m, p - i) micro-batches of its layers (one layer's analytic bytes each), its rotary tables,
    stage 0 the embedding's ids, stage 3 the final norm, head input and loss; its parameters are
    its layers' and the table(s) it holds. torch's buffers: m receive buffers of the [s/t, b, h]
    boundary for the input (the in-flight ones are the first layer's kept input) and m for the
    output's gradient, and each in-flight output (the last stage's: its logits)."""
    setup = TrainingSetup(4096, tp=8, dp=4, attention="flash")
    cut, m = (5, 9, 9, 9), 8
    layer = layer_activation_bytes(SEVEN_B, setup, "none")
    rope = sum(t.nbytes for t in rotary_terms(SEVEN_B, setup))
    _, after, _ = _outside_items(SEVEN_B, setup)
    one = replace(SEVEN_B, layers=1).local_parameters(8)
    per_layer = replace(SEVEN_B, layers=2).local_parameters(8) - one
    table = 32000 // 8 * 4096
    boundary = 2 * 4096 // 8 * 4096
    logits = 2 * 4096 * 32000 // 8
    for buffers in ("none", "torch"):
        budgets = stage_budgets(SEVEN_B, setup, PipelineSetup(4, m, "1f1b", stage_layers=cut, buffers=buffers))
        assert sum(b.budget.items[0].nbytes for b in budgets) == SEVEN_B.local_parameters(8) * 2  # bf16
        for i, b in enumerate(budgets):
            n = min(m, 4 - i)
            outside = (
                rope
                + (embedding_bytes(SEVEN_B, setup) if i == 0 else 0)
                + (sum(x.nbytes for x in after) if i == 3 else 0)
            )
            assert b.in_flight == (n,) and b.layers == cut[i]
            assert b.activation_bytes == n * (cut[i] * layer + outside)
            params = cut[i] * per_layer + (table if i == 0 else 0) + (one - per_layer - table if i == 3 else 0)
            assert b.budget.items[0].nbytes == 2 * params
            items = {x.name: x.nbytes for x in b.budget.items}
            if buffers == "none":
                assert not any(name.startswith("pipeline") for name in items)
                continue
            assert items["pipeline: receive buffers"] == m * boundary * ((i > 0) + (i < 3)) - n * boundary * (i > 0)
            assert items["pipeline: outputs in flight"] == n * (logits if i == 3 else boundary)


# ---------------------------------------------------------------------------------------------
# Measured = analytic: neuron_ckpt.pipeline's steps on gloo.

S, B, LAYERS, VOCAB = 32, 2, 8, 256
SIZES = {"vocab_size": VOCAB, "intermediate_size": 176, "max_position_embeddings": S, "num_hidden_layers": LAYERS}
SCHEDULE_NAMES = {"GPipe": "gpipe", "1F1B": "1f1b", "Interleaved1F1B": "interleaved"}
BOUND_S = 120  # a pipeline on gloo can hang (pytorch#132644): fail instead


def _reentrant(config: RecomputeConfig | None) -> RecomputeConfig | None:
    """The same recompute through the reentrant checkpoint, whose rerun the tracker sees."""
    if config is None:
        return None
    return RecomputeConfig(
        config.granularity,
        config.method,
        config.num_layers,
        config.modules,
        config.distribute_saved_activations,
        use_reentrant=True,
    )


SEL, FULL = RecomputeConfig("selective", modules=("core_attn",)), RecomputeConfig("full", "uniform", 1)
MIX = [FULL, None, SEL, SEL, None, FULL, SEL, None]
ACT = [None, RecomputeConfig("selective", modules=("mlp_act",))] * 4

# (tp, pp, schedule, micro-batches, virtual stages, cut, attention, per-layer recompute)
CASES = {
    2: [(1, 2, "1F1B", 4, 1, None, "explicit", None),
        (1, 2, "GPipe", 3, 1, [3, 5], "explicit", MIX),
        (1, 2, "Interleaved1F1B", 4, 2, [1, 3, 3, 1], "flash", MIX),
        (1, 2, "GPipe", 3, 1, None, "explicit", ACT),
        (1, 2, "1F1B", 4, 1, [4, 4], "explicit", "plan")],
    4: [(1, 4, "1F1B", 5, 1, None, "explicit", MIX),
        (2, 2, "Interleaved1F1B", 4, 2, [2, 2, 2, 2], "explicit", MIX),
        (2, 2, "1F1B", 2, 1, [2, 6], "flash", [FULL] * LAYERS)],
}  # fmt: skip


def _planned() -> PipelinePlan:
    """The planner's recompute for the "plan" case: ZeRO-1 over 64 with small buckets, so the
    activations decide, and a limit that mixes none, selective and full on the stages."""
    setup = TrainingSetup(S, B, tp=1, dp=64, sequence_parallel=False, attention="explicit", bucket_cap_mb=0.01)
    return plan_pipeline(
        ModelShape.from_llama(tiny_config(**SIZES)),
        setup,
        PipelineSetup(2, 4, stage_layers=(4, 4)),
        1_750_000 / 2**30,
        reserve_gib=0,
        allowed=("none", "selective", "full"),
    )


def _measure(case: tuple) -> tuple:
    """This rank's (pp rank, the cut, most kept when a backward starts or a stage's forward
    ends, peak over the step, left after it) over its second step (the first sets torch's
    stages up)."""
    from neuron_ckpt.pipeline import LlamaPipeline, PipelineConfig, apply_pipeline_recompute

    t, p, schedule, m, v, cut, attention, layers = case
    nc.initialize_model_parallel(tensor_parallel_size=t, pipeline_parallel_size=p)
    pipe = LlamaPipeline(
        tiny_config(**SIZES),
        PipelineConfig(schedule, m, v, cut),
        B,
        S,
        sequence_parallel=t > 1,
        attention_implementation=attention,
        dtype=torch.bfloat16,
    )
    if layers == "plan":  # what the planner writes, as apply_pipeline_recompute takes it
        apply_pipeline_recompute(pipe, [[_reentrant(c) for c in stage] for stage in _planned().recompute()])
    elif layers is not None:
        apply_pipeline_recompute(pipe, [_reentrant(c) for c in layers])
    ids = torch.randint(0, VOCAB, (m * B, S), generator=torch.Generator().manual_seed(0))
    pipe.step(ids, ids.clone())
    masks = [
        x.causal_mask(S, torch.device("cpu"))
        for stage in pipe.modules
        for x in stage.modules()
        if isinstance(x, CoreAttention)
    ]
    got = measure_rank(
        lambda: pipe.step(ids, ids.clone()),
        pipe.modules,
        pipe.torch_stages,
        exclude_modules=pipe.modules,
        exclude_tensors=masks,
    )
    # torch's receive buffers, by distinct storage. Private attributes: PipelineStage keeps them
    # there and nowhere public (one per micro-batch, for the input and for the output's gradient).
    buffers = {
        info.buffer.untyped_storage().data_ptr(): info.buffer.untyped_storage().nbytes()
        for stage in pipe.torch_stages
        for infos in (*stage.args_recv_info.values(), *stage.grad_recv_info.values())
        for info in infos
        if getattr(info, "buffer", None) is not None
    }
    return (
        pipe.parallel_state.pp_rank,
        pipe.cut.layers_per_stage,
        got.most_after_forward,
        got.peak_bytes,
        got.after_step,
        sum(buffers.values()),
    )


def _measure_all(n: int) -> list[tuple]:
    results = []
    for case in CASES[n]:
        results.append(_measure(case))
        nc.destroy_model_parallel()
    return results


@pytest.fixture(scope="module")
def measured(world) -> dict[tuple[int, int], list[tuple]]:
    """Per case (world size, index), every rank's figures."""
    out = {}
    for n in CASES:
        w = world(n)
        before, w.timeout_s = w.timeout_s, BOUND_S
        try:
            per_rank = w.run(_measure_all, n)
        finally:
            w.timeout_s = before
        for i in range(len(CASES[n])):
            out[n, i] = [rank[i] for rank in per_rank]
    return out


@pytest.mark.parametrize("n, i", [(n, i) for n in CASES for i in range(len(CASES[n]))])
def test_measured_equals_analytic_per_stage(measured, n, i):
    """Every rank of every case, against ``stage_budgets`` with torch's runtime (its receive
    buffers too, counted off the stages). Two differences,
    asserted to the byte: the loss divides by one token count for the whole batch (int64, shared
    by the micro-batches; the model counts one per micro-batch, as ``LlamaForCausalLM`` keeps),
    and with ``mlp_act`` a backward holds the recomputed SwiGLU output, which output-discarding
    recompute hands to the down projection without packing it, so ``LiveSavedTensors`` never
    sees it (the model counts it: it is memory)."""
    t, p, schedule, m, v, cut, attention, layers = CASES[n][i]
    setup = TrainingSetup(S, B, tp=t, dp=1, sequence_parallel=t > 1, attention=attention)
    shape = ModelShape.from_llama(tiny_config(**SIZES))
    ranks = measured[n, i]
    pipeline = PipelineSetup(p, m, SCHEDULE_NAMES[schedule], v, ranks[0][1])
    if layers == "plan":
        plan = _planned()
        assert plan.fits and sorted(len(stage.counts) for stage in plan.stages) == [2, 3]  # mixes on both stages
        budgets = [stage.budget for stage in plan.stages]
    else:
        budgets = stage_budgets(
            shape, setup, pipeline, "none" if layers is None else [c or RecomputeConfig() for c in layers]
        )
    assert len(ranks) == t * p
    for pp_rank, _, most, peak, after, buffers in ranks:
        budget = budgets[pp_rank]
        assert buffers == RankModel(shape, setup, pipeline, pp_rank).buffers  # m per micro-batch, each way
        shared = 8 * max(budget.in_flight[-1] - 1, 0) if budget.chunks[-1].last else 0
        refill = 2 * S * B * 176 // t if layers is ACT and pp_rank == 0 else 0
        assert after == 0
        print(
            f"\nn={n} case {i} stage {pp_rank}: kept {most + shared} (analytic {budget.activation_bytes}), "
            f"peak {peak + shared + refill} (analytic {budget.budget.activation_peak_bytes})"
        )
        assert most + shared == budget.activation_bytes, f"stage {pp_rank}: kept {most}"
        assert peak + shared + refill == budget.budget.activation_peak_bytes, f"stage {pp_rank}: peak {peak}"


# ---------------------------------------------------------------------------------------------
# The planner per stage.


def test_stage_plan_is_the_cheapest_that_fits_against_brute_force():
    """p = 2, 1F1B, m = 4, 8 layers: for each stage, every assignment of the offered options to
    its 4 layers (in every order) is priced; none that fits recomputes fewer FLOPs than the plan,
    which fits. Several limits, from one where no recompute fits to one that needs the most (s 128,
    b 8, ZeRO-1 over 64: the activations outweigh the static bytes, so the choice matters)."""
    model = ModelShape.from_llama(tiny_config(**SIZES))
    setup = TrainingSetup(128, 8, tp=1, dp=64, sequence_parallel=False, attention="explicit")
    pipeline = PipelineSetup(2, 4, "1f1b")
    options = layer_options(model, setup)
    ranks = [RankModel(model, setup, pipeline, r) for r in range(2)]
    priced = [
        [
            (sum(o.recompute_flops for o in combo), rank.budget([list(combo)]).total_bytes)
            for combo in itertools.product(options.values(), repeat=4)
        ]
        for rank in ranks
    ]
    lows = [min(b for _, b in p) for p in priced]
    highs = [max(b for _, b in p) for p in priced]
    mixed = 0
    for frac in (0.0, 0.1, 0.2, 0.4, 0.6, 0.8, 1.0):
        limit = int(min(lows) + frac * (max(highs) - min(lows)))
        plan = plan_pipeline(model, setup, pipeline, limit / 2**30, reserve_gib=0)
        mixed += sum(len(stage.counts) > 1 for stage in plan.stages)
        for rank, stage in enumerate(plan.stages):
            fitting = [cost for cost, total in priced[rank] if total <= plan.limit_bytes]
            assert stage.fits == bool(fitting)
            if fitting:
                assert stage.recompute_flops == pytest.approx(min(fitting), rel=1e-12)
    assert mixed >= 4  # the limits ask for mixes, not only one option everywhere


def test_smallest_pp_is_the_first_degree_that_fits():
    model = ModelShape.from_llama(tiny_config(**SIZES))
    setup = TrainingSetup(S, B, tp=1, dp=1, sequence_parallel=False, attention="explicit")
    pipeline = PipelineSetup(2, 8, "gpipe")
    fits_at = {p: plan_pipeline(model, setup, PipelineSetup(p, 8, "gpipe"), 1.0, reserve_gib=0) for p in (2, 4, 8)}
    # A limit that two stages cannot keep, even recomputing, and four can.
    top = max(s.budget.total_bytes for s in fits_at[4].stages)
    limit = next(
        top * f / 100
        for f in range(100, 10, -1)
        if not plan_pipeline(model, setup, pipeline, top * f / 100 / 2**30, reserve_gib=0).fits
    )
    assert not all(s.budget.total_bytes <= limit for s in fits_at[2].stages)
    plan = plan_pipeline(model, setup, pipeline, limit / 2**30, reserve_gib=0)
    first = next(
        p
        for p in range(3, LAYERS + 1)
        if plan_pipeline(model, setup, PipelineSetup(p, 8, "gpipe"), limit / 2**30, reserve_gib=0).fits
    )
    assert not plan.fits and plan.smallest_pp == first <= 4
    assert smallest_pp(model, setup, pipeline, limit_bytes(limit / 2**30, 0)) == first
    assert f"would fit: pp={first}" in plan.message() and "\n" not in plan.message()
    tiny = plan_pipeline(model, setup, pipeline, 0.0001, reserve_gib=0)
    assert tiny.smallest_pp is None and "no pipeline degree above 2 fits" in tiny.message()


def test_nxd_70b_recipes_on_trn1():
    """NxD's trn1 recipes, TP 32 x PP 8 x DP 4, 1F1B, m = 1024 / 4 = 256, ZeRO-1, SP, 16 GiB per
    NeuronCore less the 10% reserve: every stage fits with no recompute (Llama-2 70B, s 4096,
    explicit attention; Llama-3.1 70B, s 8192, flash), stage i holding 8 - i micro-batches; with
    explicit attention Llama-3.1 70B needs selective recompute on the first six stages."""
    from neuron_ckpt.models.config_file import load_llama_config

    pipeline = PipelineSetup(8, 256, "1f1b")
    for name, seq, attention in (("llama2-70b", 4096, "explicit"), ("llama3.1-70b", 8192, "flash")):
        model = ModelShape.from_llama(load_llama_config(name))
        plan = plan_pipeline(model, TrainingSetup(seq, tp=32, dp=4, attention=attention), pipeline, "trn1")
        # the pipeline's own cut (9, 10, ..., 11, 10: the embedding and the head a layer each)
        assert plan.fits and [s.counts for s in plan.stages] == [{"none": n} for n in pipeline.cut(80)]
        assert [s.budget.microbatches_in_flight for s in plan.stages] == list(range(8, 0, -1))
    model = ModelShape.from_llama(load_llama_config("llama3.1-70b"))
    plan = plan_pipeline(model, TrainingSetup(8192, tp=32, dp=4, attention="explicit"), pipeline, "trn1")
    assert plan.fits and [s.overhead > 0 for s in plan.stages] == [True] * 6 + [False] * 2
