"""``neuron-ckpt plan --config`` for every family ``apply_tensor_parallel`` splits (issues 50 and 44):
what the budget and the planner must guarantee for a transformers model.

* The budget's parameters are what a rank of a really split model holds (``numel``, and of it the
  ``expert_parallel`` ones), for every family at TP 2 + SP, and for the MoE families with an
  expert-parallel plan at EP 2 (TP 1, and TP 2 + SP), on 4 gloo ranks.
* The budget's activations are what a whole model keeps for backward (``SavedTensorRecorder``
  over a forward with labels: the layers, which ``tests/test_memory_families.py`` measures layer by
  layer, and the embedding, rotary tables, final norm, LM head and loss around them), to the byte,
  for every family at TP 1 (bf16 and fp32, sdpa and eager), and at TP 2 + SP on every rank for one
  family of each way the parts around the layers differ.
* The planner's choice fits and nothing cheaper fits: a brute force over every per-layer
  assignment of models with layers of two kinds (DeepSeek-V3's dense first layer and MoE layers,
  Gemma2's alternating windows) and of one kind, at every limit at and below each reachable total.
* ``plan --config`` of a Llama config.json plans this library's Llama as ``--model llama`` does;
  ``--model transformers`` on it prices the same parameters, gradients and optimizer state.
* Bad input is one line (exit 2), every problem of the job named at once; nothing fits: exit 1 and
  the smallest tensor- or expert-parallel degree that would.
"""

from __future__ import annotations

import functools
import itertools
import json
from dataclasses import replace

import pytest
import torch

transformers = pytest.importorskip("transformers")

import neuron_ckpt as nc  # noqa: E402
from neuron_ckpt.cli import main as cli_main  # noqa: E402
from neuron_ckpt.memory import NothingFits, TrainingSetup, memory_budget, plan_activations, plan_recompute  # noqa: E402
from neuron_ckpt.memory.budget import GIB, BudgetParts  # noqa: E402
from neuron_ckpt.memory.measure import SavedTensorRecorder  # noqa: E402
from neuron_ckpt.memory.moe import FAMILY, MoESetup, layer_memory, load_moe_config, moe_shape_from_dict  # noqa: E402
from neuron_ckpt.memory.moe.measure import build_model  # noqa: E402
from neuron_ckpt.memory.moe.model import Stage, TransformersModel  # noqa: E402
from neuron_ckpt.memory.moe.params import parameter_split  # noqa: E402
from neuron_ckpt.memory.moe.stages import stage_jobs  # noqa: E402
from neuron_ckpt.memory.options import layer_options  # noqa: E402
from neuron_ckpt.memory.pipeline.cut import PipelineSetup  # noqa: E402
from neuron_ckpt.parallel.params import is_expert_parallel  # noqa: E402

S, B = 16, 2
BASE = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=128)  # fmt: skip
MLA = dict(num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8)
MOE = dict(num_experts_per_tok=2)
TINY = {  # family: (config keys, (dtype, attention, experts)); windows of 8 make sdpa and eager take masks
    "llama": ({"intermediate_size": 96}, ("bf16", "sdpa", "grouped_mm")),
    "mistral": ({"intermediate_size": 96, "sliding_window": 8}, ("fp32", "sdpa", "grouped_mm")),
    "qwen2": ({"intermediate_size": 96, "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1},
              ("bf16", "eager", "grouped_mm")),
    "qwen3": ({"intermediate_size": 96, "head_dim": 16}, ("bf16", "sdpa", "grouped_mm")),
    "gemma2": ({"intermediate_size": 96, "head_dim": 16, "sliding_window": 8}, ("fp32", "eager", "grouped_mm")),
    "phi3": ({"intermediate_size": 96, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2},
             ("bf16", "sdpa", "grouped_mm")),
    "mixtral": ({"intermediate_size": 96, "num_local_experts": 4, **MOE}, ("bf16", "sdpa", "grouped_mm")),
    "qwen2_moe": ({"moe_intermediate_size": 32, "num_experts": 4, "shared_expert_intermediate_size": 48, **MOE},
                  ("fp32", "eager", "eager")),
    "qwen3_moe": ({"moe_intermediate_size": 32, "num_experts": 4, "head_dim": 16, **MOE},
                  ("bf16", "sdpa", "grouped_mm")),
    "olmoe": ({"intermediate_size": 32, "num_experts": 4, "eos_token_id": 2, **MOE}, ("fp32", "eager", "eager")),
    "deepseek_v2": ({**MLA, "intermediate_size": 80, "moe_intermediate_size": 32, "n_routed_experts": 4,
                     "n_shared_experts": 1, "first_k_dense_replace": 1, **MOE}, ("bf16", "sdpa", "grouped_mm")),
    "deepseek_v3": ({**MLA, "intermediate_size": 80, "moe_intermediate_size": 32, "n_routed_experts": 4,
                     "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 2, "topk_group": 1, **MOE},
                    ("fp32", "eager", "grouped_mm")),
    "gpt_oss": ({"intermediate_size": 32, "num_local_experts": 4, "head_dim": 16, "sliding_window": 8, **MOE},
                ("bf16", "eager", "grouped_mm")),
    "aria_text": ({"intermediate_size": 32, "moe_num_experts": 4, "moe_topk": 2}, ("bf16", "sdpa", "grouped_mm")),
    "llama4_text": ({"num_hidden_layers": 4, "interleave_moe_layer_step": 2, "intermediate_size": 32,
                     "intermediate_size_mlp": 48, "num_local_experts": 4, "num_experts_per_tok": 1, "head_dim": 16,
                     "attention_chunk_size": 8}, ("fp32", "eager", "grouped_mm")),
}  # fmt: skip
EXPERT_PARALLEL = [f for f in TINY if FAMILY[f].experts not in (None, "all")]
# One family for each way the parts around the layers differ at TP > 1: the norm (Llama's, GPT-OSS's
# fp32 weight, Gemma2's 1 + w and its soft-capped logits), the rotary tables (cos/sin, a half head,
# complex), the dtype, the attention's masks.
AROUND = ("llama", "mistral", "gemma2", "deepseek_v2", "gpt_oss")


def config_dict(family: str, **overrides) -> dict:
    extra, _ = TINY[family]
    return getattr(transformers, FAMILY[family].config_class)(**{**BASE, **extra, **overrides}).to_dict()


@functools.cache
def shape(family: str):
    return moe_shape_from_dict(config_dict(family), family, notices=[])


def job(family: str, tp: int = 1, sp: bool = False, ep: int = 1) -> tuple[TransformersModel, TrainingSetup]:
    dtype, attention, experts = TINY[family][1]
    model = TransformersModel(shape(family), attention, experts, ep)
    return model, TrainingSetup(S, B, tp=tp, dp=4 // tp, dtype=dtype, sequence_parallel=sp)


def split_model(family: str, tp: int = 1, sp: bool = False, ep: int = 1):
    """The family's tiny model, split as ``apply_tensor_parallel`` splits it (on an initialised world)."""
    dtype, attention, experts = TINY[family][1]
    return build_model(shape(family), MoESetup(S, B, tp, dtype, attention, experts, sp, ep))


def whole_model_bytes(model) -> int:
    """What a whole model keeps for backward over a forward with labels, on this rank."""
    ids = torch.randint(0, BASE["vocab_size"], (B, S), generator=torch.Generator().manual_seed(0))
    rec = SavedTensorRecorder(exclude_modules=[model])
    with rec:
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return rec.total_bytes


def test_activations_are_what_a_whole_model_keeps_at_tp1():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for family in TINY:
            model, setup = job(family)
            kept = whole_model_bytes(split_model(family))
            assert kept == memory_budget(model, setup, "none").activation_bytes, family
    finally:
        torch.set_num_threads(threads)


def _split_models() -> dict:
    """Per layout and family, this rank's parameters (all, and expert-parallel) and, at TP 2 + SP,
    what the whole model keeps (:data:`AROUND`'s)."""
    torch.set_num_threads(1)
    out: dict = {}
    for tp, ep, sp in [(2, 1, True), (1, 2, False), (2, 2, True)]:
        nc.initialize_model_parallel(tp, expert_model_parallel_size=ep)
        nc.model_parallel_manual_seed(0)
        for family in TINY if ep == 1 else EXPERT_PARALLEL:
            model = split_model(family, tp, sp, ep)
            params = list(model.parameters())
            counts = (sum(p.numel() for p in params), sum(p.numel() for p in params if is_expert_parallel(p)))
            kept = whole_model_bytes(model) if ep == 1 and family in AROUND else None  # (EP: rows follow routing)
            out[(tp, ep, family)] = (*counts, kept)
        nc.destroy_model_parallel()
    return out


def test_parameters_and_activations_are_what_split_models_hold(world):
    ranks = world(4).run(_split_models)
    for (tp, ep, family), (numel, expert_numel, kept) in ranks[0].items():
        model, setup = job(family, tp, sp=tp > 1, ep=ep)
        dense, experts = model.parameters(setup)
        assert (dense + experts, experts) == (numel, expert_numel), (family, tp, ep)
        assert all(r[(tp, ep, family)][:2] == (numel, expert_numel) for r in ranks), (family, tp, ep)
        if kept is not None:
            assert [r[(tp, ep, family)][2] for r in ranks] == [memory_budget(model, setup, "none").activation_bytes] * 4
    model, setup = job("mixtral", 1, False, 2)  # ZeRO-1: dense over dp 4, experts over tp dp / ep = 2
    items = {i.name: i.nbytes for i in memory_budget(model, setup, "none").items}
    dense, experts = model.parameters(setup)
    assert items["optimizer moments"] == 8 * (-(-dense // 4) + -(-experts // 2))


def test_whole_models_have_the_published_sizes():
    assert parameter_split(load_moe_config("mixtral-8x7b", [])).total == 46_702_792_704  # "46.7B"
    assert parameter_split(load_moe_config("deepseek-v3", [])).total == 671_026_404_352  # "671B"
    assert parameter_split(load_moe_config("qwen3-8b", [])).total == 8_190_735_360  # "8.2B"


# --- the search ---------------------------------------------------------------------------------


def _brute_force(model: TransformersModel, setup: TrainingSetup, limit_on: str = "total"):
    """Every per-layer assignment: (bytes used, recompute FLOPs)."""
    options = layer_options(model, setup)
    per_layer = model.options_by_layer(options)
    parts, m = BudgetParts.of(model, setup), setup.microbatches_in_flight
    return [
        (parts.used([(options[n], 1) for n in names], m, limit_on), sum(options[n].recompute_flops for n in names))
        for names in itertools.product(*per_layer)
    ]


@pytest.mark.parametrize(
    "family, layers, kinds, stage",
    [
        ("deepseek_v3", 3, ("dense", "moe"), None),
        ("gemma2", 3, ("dense/sliding", "dense"), None),
        ("qwen3_moe", 3, ("moe",), None),
        ("deepseek_v3", 4, ("dense", "moe"), (Stage(0, 3, embedding=True, head=False), 3)),  # 3 micro-batches held
    ],
)
def test_planner_is_optimal_against_brute_force(family, layers, kinds, stage):
    s = moe_shape_from_dict(config_dict(family, num_hidden_layers=layers), family, notices=[])
    dtype, attention, experts = TINY[family][1]
    model = TransformersModel(s, attention, experts, stage=stage[0] if stage else None)
    setup = TrainingSetup(64, 2, tp=1, dp=1, dtype=dtype, sequence_parallel=False)
    if stage:
        setup = replace(setup, microbatches_in_flight=stage[1])
    assert s.kinds == kinds
    every = _brute_force(model, setup)
    totals = sorted({u for u, _ in every})
    for limit in sorted({t + d for t in totals[:: max(1, len(totals) // 40)] + totals[-2:] for d in (-1, 0)}):
        fitting = [f for u, f in every if u <= limit]
        if not fitting:
            with pytest.raises(NothingFits, match="nothing fits"):
                plan_recompute(model, setup, limit / GIB, reserve_gib=0)
            continue
        plan = plan_recompute(model, setup, limit / GIB, reserve_gib=0)
        assert plan.fits and plan.budget.total_bytes <= limit
        assert plan.recompute_flops == pytest.approx(min(fitting), rel=1e-12), (limit, plan.layers)
    least = plan_recompute(model, setup, totals[0] / GIB, reserve_gib=0)  # the least memory is found
    assert least.budget.total_bytes == totals[0]
    acts = sorted({u for u, _ in _brute_force(model, setup, "activations")})
    plan = plan_activations(model, setup, acts[len(acts) // 2])
    best = min(f for u, f in _brute_force(model, setup, "activations") if u <= acts[len(acts) // 2])
    assert plan.recompute_flops == pytest.approx(best, rel=1e-12)


def test_a_deepseek_v3_plan_counts_layers_per_option_per_kind():
    model = TransformersModel(load_moe_config("deepseek-v3", []), ep=64)
    setup = TrainingSetup(4096, 1, tp=8, dp=8)
    options = layer_options(model, setup)
    assert {n.partition(":")[0] for n in options} == {"dense", "moe"}
    plan = plan_recompute(model, setup, 1000, reserve_gib=0)  # a large device: no recompute
    assert plan.counts == {"dense:none": 3, "moe:none": 58} and plan.recompute_flops == 0
    least = plan_recompute(model, setup, plan.budget.total_gib - 5, reserve_gib=0)
    assert least.fits and 0 < least.recompute_flops and len(least.recompute) == 61  # a per-layer list


# --- the command ----------------------------------------------------------------------------------


def _run(argv: list[str]) -> int:
    try:
        return cli_main(["plan", *argv])
    except SystemExit as exc:
        return exc.code


def _json(capsys, argv: list[str]) -> tuple[int, dict]:
    code = _run([*argv, "--json"])
    return code, json.loads(capsys.readouterr().out)


def _write(tmp_path, family: str, name: str | None = None, **changes):
    path = tmp_path / (name or family)
    path.mkdir()
    (path / "config.json").write_text(json.dumps({**config_dict(family), **changes}))
    return str(path)


def test_a_llama_config_plans_this_library_s_llama(tmp_path, capsys):
    path = _write(tmp_path, "llama", intermediate_size=256)
    argv = ["--config", path, "--tp", "2", "--dp", "2", "--seq", "64", "--device-memory", "1"]
    code, auto = _json(capsys, argv)
    assert (code, auto) == _json(capsys, ["--model", "llama", *argv])
    assert "counts_by_kind" not in auto  # the Llama plan, not a transformers one
    code, hf = _json(capsys, ["--model", "transformers", *argv])
    assert code == 0 and hf["family"] == "llama"
    static = ("parameters", "gradients", "master weights", "optimizer moments")
    mine = {i["name"]: i["bytes"] for i in auto["budget"]["items"] if i["name"] in static}
    assert mine == {i["name"]: i["bytes"] for i in hf["budget"]["items"] if i["name"] in static}


def test_cli_plans_an_moe_job_with_expert_parallelism(tmp_path, capsys):
    path = _write(tmp_path, "deepseek_v3")
    code, out = _json(capsys, ["--config", path, "--tp", "2", "--dp", "2", "--ep", "2", "--seq", "64",
                               "--device-memory", "1"])  # fmt: skip
    assert code == 0 and out["ep"] == 2 and out["edp"] == 2 and out["fits"]
    assert set(out["counts_by_kind"]) == {"dense", "moe"} and sum(out["counts"].values()) == 2
    assert {"none", "full"} <= set(out["alternatives"])
    assert _run(["--config", path, "--tp", "2", "--dp", "2", "--ep", "2", "--seq", "64", "--device-memory", "1"]) == 0
    text = capsys.readouterr().out
    assert "ep=2 edp=2" in text and "experts /edp=2" in text and "plan: " in text


@pytest.mark.parametrize("cf", [None, 1.0])
def test_the_all_gather_form_is_planned_at_its_slots(tmp_path, capsys, cf):
    """``--ep-dispatch all_gather``: every MoE layer keeps what the layer model prices for the
    form (measured = analytic in tests/test_memory_expert_parallel.py), the dropped routes named."""
    path = _write(tmp_path, "mixtral")
    argv = ["--config", path, "--tp", "2", "--dp", "2", "--ep", "2", "--seq", "64", "--device-memory", "1"]
    form = ["--ep-dispatch", "all_gather"] + (["--capacity-factor", str(cf)] if cf else [])
    code, out = _json(capsys, [*argv, *form])
    assert code == 0 and out["ep_dispatch"] == "all_gather" and out["capacity_factor"] == cf
    ms = MoESetup(64, 1, 2, "bf16", "sdpa", "grouped_mm", True, 2, "balanced", "all_gather", cf)
    per_layer = layer_memory(shape("mixtral"), ms).nbytes
    act = [i for i in out["budget"]["items"] if i["name"].startswith("act: ") and "layers x" in i["name"]]
    assert [i["bytes"] for i in act] == [2 * per_layer]
    _, a2a = _json(capsys, [*argv])
    a2a_act = [i["bytes"] for i in a2a["budget"]["items"] if "layers x" in i["name"]]
    assert a2a_act != [2 * per_layer]  # the forms keep different bytes, so the test can tell them apart
    assert _run([*argv, *form]) == 0
    text = capsys.readouterr().out
    assert "all-gather dispatch" in text and "routes dropped per MoE layer at worst" in text


def _least(model: TransformersModel, setup: TrainingSetup) -> int:
    with pytest.raises(NothingFits) as info:
        plan_recompute(model, setup, 1 / GIB, reserve_gib=0)
    return info.value.least.budget.total_bytes


def test_cli_nothing_fits_names_the_smallest_expert_parallel_degree(tmp_path, capsys):
    path = _write(tmp_path, "mixtral")
    setup = TrainingSetup(64, 1, tp=1, dp=4, dtype="bf16", sequence_parallel=False)
    at = [_least(TransformersModel(shape("mixtral"), ep=e), setup) for e in (1, 2)]
    assert at[1] < at[0]  # half the experts per rank
    argv = ["--config", path, "--dp", "4", "--seq", "64", "--no-sequence-parallel", "--reserve", "0"]
    assert _run([*argv, "--device-memory", str((at[0] + at[1]) / 2 / GIB)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "nothing fits" in err and "fits with --ep 2" in err
    assert _run([*argv, "--ep", "2", "--device-memory", str((at[0] + at[1]) / 2 / GIB)]) == 0


def test_stages_hold_the_model_once_and_the_schedule_s_micro_batches(tmp_path, capsys):
    model, setup = job("deepseek_v3", 2, True, 2)
    stages = stage_jobs(model, setup, PipelineSetup(2, 4))
    assert [m.indices for m, _ in stages] == [range(0, 1), range(1, 2)]  # LlamaPipeline's cut: 1 + 1
    assert [s.microbatches_in_flight for _, s in stages] == [2, 1]  # 1F1B: min(m, p - i)
    held = [sum(m.parameters(s)) for m, s in stages]
    assert sum(held) == sum(model.parameters(setup))  # untied: every parameter on one stage
    path = _write(tmp_path, "deepseek_v3")
    argv = ["--config", path, "--tp", "2", "--dp", "2", "--ep", "2", "--seq", "64", "--pp", "2", "--micro-batches", "4"]
    code, out = _json(capsys, [*argv, "--device-memory", "1"])
    assert code == 0 and out["fits"] and [st["microbatches_in_flight"] for st in out["stages"]] == [2, 1]
    code, out = _json(capsys, [*argv, "--reserve", "0", "--device-memory", str(1 / GIB)])
    assert code == 1 and not out["fits"] and out["smallest_pp"] is None
    capsys.readouterr()
    limit = max(st["least_memory"]["budget"]["total_bytes"] for st in out["stages"]) - 1  # one stage falls short
    assert _run([*argv, "--reserve", "0", "--device-memory", str(limit / GIB)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "nothing fits on stage(s)" in err


@pytest.mark.parametrize(
    "family, extra, message",
    [
        ("mixtral", ["--ep", "3"], "ep (3) must divide experts (4); allowed: [1, 2, 4]"),
        ("mixtral", ["--ep", "4", "--tp", "1", "--dp", "2"], "ep (4) must divide tp x dp = 2"),
        ("mixtral", ["--tp", "3", "--seq", "64"], "tp (3) must divide"),
        ("mixtral", ["--tp", "2", "--seq", "63"], "seq_len (63) must be a multiple of tp (2)"),
        ("llama4_text", ["--ep", "2"], "no expert-parallel plan"),
        ("qwen3", ["--ep", "2"], "no expert-parallel plan"),
        ("mixtral", ["--pp", "2", "--micro-batches", "4", "--pipeline-buffers", "torch"], "without a runtime's"),
        (
            "mixtral",
            ["--pp", "2", "--micro-batches", "4", "--schedule", "interleaved", "--virtual-stages", "2"],
            "one stage per rank",
        ),
        ("mixtral", ["--cp", "2"], "context parallelism runs this library's Llama only"),
        ("mixtral", ["--attention", "flash"], "a transformers model takes transformers' implementation"),
        ("gemma2", ["--attention", "sdpa"], "eager only"),
        ("qwen3", ["--experts", "eager"], "qwen3 has no experts"),
        ("mixtral", ["--ep-rows", "worst"], "give --ep above 1"),
        ("mixtral", ["--ep-dispatch", "all_gather"], "--ep-dispatch: how tokens reach"),
        ("mixtral", ["--ep", "2", "--capacity-factor", "2"], "give --ep-dispatch all_gather"),
        ("mixtral", ["--ep", "2", "--ep-dispatch", "all_gather", "--ep-rows", "worst"], "applies to ep_dispatch"),
        ("llama", ["--ep-dispatch", "all_gather"], "--ep-dispatch: for transformers MoE models"),
        ("llama", ["--ep", "2"], "--ep: for transformers MoE models"),
        ("llama", ["--attention", "sdpa"], "--attention sdpa is transformers'"),
    ],
)
def test_cli_bad_input_is_one_line_and_exit_2(tmp_path, capsys, family, extra, message):
    path = _write(tmp_path, family)
    argv = ["--config", path, "--tp", "2", "--dp", "2", "--seq", "64", "--device-memory", "16"]
    assert _run([*argv, *extra]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


def test_every_problem_of_the_job_is_named_at_once(tmp_path, capsys):
    path = _write(tmp_path, "mixtral")
    assert _run(["--config", path, "--tp", "3", "--dp", "1", "--ep", "3", "--seq", "64", "--device-memory", "16"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "tp (3) must divide" in err and "ep (3) must divide experts" in err
