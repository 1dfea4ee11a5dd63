"""The memory model at context parallelism ``c``: what a rank keeps is what it says, to the byte.

At CP ``c`` each rank runs ``s/c`` of a sequence's tokens, so every per-token term is priced at
``s/c``; the attention's own terms are its two query chunks' (explicit: the probabilities,
``(2c + 1) L^2`` per head and sample, ``L = s/(2c)``; flash: each chunk's output and fp32
logsumexp), K and V are this rank's rows (the regather keeps them, not the gathered copy), plus
the ``2c``-element index that puts the gathered rows in order; the ``[L, s]`` mask is shared by
every layer (docs/context_parallel.md, "What backward keeps"). Checked on 4 gloo ranks at CP 2,
TP 1 (x DP 2) and TP 2 + SP, explicit and flash, bf16:

* per layer (``SavedTensorRecorder``, two real layers): ``layer_activation_bytes``;
* a whole ``LlamaForCausalLM`` (``LiveSavedTensors``, the reentrant checkpoint whose rerun it
  sees): the budget's activations after the forward and their peak over forward and backward,
  under no, selective, selective+mlp_act and full recompute; a layer stack whose core-attention
  rerun makes the peak (MHA, a narrow MLP), so the rerun's gathered K and V are seen;
* the rerun's price: the priced matmul FLOPs equal torch's count (``flop_counter``) of the step
  with the choice less the step without.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

import neuron_ckpt as nc
from neuron_ckpt.memory import (
    ModelShape,
    NothingFits,
    TrainingSetup,
    layer_activation_bytes,
    layer_activation_terms,
    memory_budget,
    plan_recompute,
)
from neuron_ckpt.memory.analytic import model_activation_peak_bytes, resolve
from neuron_ckpt.memory.flop_count import flop_counter
from neuron_ckpt.memory.layers import build_layers, layer_input, measure_layers
from neuron_ckpt.memory.live import LiveSavedTensors
from neuron_ckpt.memory.options import stack_options
from neuron_ckpt.memory.planner import longest_sequence
from neuron_ckpt.memory.rerun import rerun_flops
from neuron_ckpt.memory.shape import DEFAULT_VOCAB
from neuron_ckpt.models.llama import LlamaForCausalLM
from neuron_ckpt.parallel.context_parallel import chunk_mask
from neuron_ckpt.recompute import RecomputeConfig, apply_recompute, run_layers

from .helpers import neuron_ckpt_cli, tiny_config

WORLD, CP = 4, 2
S, B = 32, 2
SIZES = {"vocab_size": 256, "intermediate_size": 176, "max_position_embeddings": S, "num_hidden_layers": 2}
RUNS = ((1, False), (2, True))  # (t, sequence parallel): TP 1 x DP 2, TP 2 + SP
ATTENTIONS = ("explicit", "flash")
CHOICES = {
    "none": RecomputeConfig(),
    "selective": RecomputeConfig.preset("selective"),
    "selective+mlp_act": RecomputeConfig.preset("selective+mlp_act"),
    "full": RecomputeConfig.preset("full"),
}
# A layer stack whose core-attention rerun is its backward's peak: MHA, a narrow MLP.
RERUN_SHAPE = ModelShape("llama", 64, 4, 4, 16, 2, vocab=256)
RERUN_S = 64


def _model() -> ModelShape:
    return ModelShape.from_llama(tiny_config(**SIZES))


def _setup(t: int, sp: bool, attention: str, s: int = S, cp: int = CP) -> TrainingSetup:
    return TrainingSetup(s, B, tp=t, dp=WORLD // (t * cp), cp=cp, sequence_parallel=sp, attention=attention)


def _reentrant(config: RecomputeConfig) -> RecomputeConfig:
    return replace(config, use_reentrant=True) if config.enabled else config


def _mask(s: int, attention: str) -> torch.Tensor:
    """The shared ``[s/(2c), s]`` chunk mask (a per-model term, left out of the layers)."""
    return chunk_mask(
        s // (2 * CP), s, s, torch.bool if attention == "explicit" else torch.bfloat16, torch.device("cpu")
    )


def _whole_model(t: int, sp: bool, attention: str) -> dict:
    """Per choice: (live bytes after the forward, peak over forward and backward), and the extra
    FLOPs of a step with the choice (torch's count, the default non-reentrant checkpoint)."""
    ids = torch.randint(0, SIZES["vocab_size"], (B, S), generator=torch.Generator().manual_seed(0))

    def llama(config: RecomputeConfig) -> LlamaForCausalLM:
        torch.manual_seed(0)
        model = LlamaForCausalLM(
            tiny_config(**SIZES), sequence_parallel=sp, attention_implementation=attention, dtype=torch.bfloat16
        ).train()
        if config.enabled:
            apply_recompute(model, config, sequence_parallel=sp)
        return model

    def flops(model: LlamaForCausalLM) -> int:
        with flop_counter() as counted:
            model(ids, labels=ids).loss.backward()
        return counted.get_total_flops()

    out: dict = {}
    base = flops(llama(RecomputeConfig()))
    for label, config in CHOICES.items():
        model = llama(_reentrant(config))
        with LiveSavedTensors(exclude_modules=[model], exclude_tensors=[_mask(S, attention)]) as live:
            loss = model(ids, labels=ids.clone()).loss
            live.mark("forward")
            loss.backward()
        del loss
        out[label] = (live.marks["forward"], live.peak_bytes, flops(llama(config)) - base)
    return out


def _rerun_peak(attention: str) -> tuple[int, int]:
    """(kept after the forward, peak) of a RERUN_SHAPE stack under selective, reentrant."""
    setup = _setup(1, False, attention, RERUN_S)
    layers, extra = build_layers(RERUN_SHAPE, setup, _reentrant(CHOICES["selective"]))
    state = nc.initialize_model_parallel(1, context_parallel_size=CP)
    x = layer_input(RERUN_SHAPE, setup, 0, 0, state.cp_rank)
    with LiveSavedTensors(exclude_modules=[layers], exclude_tensors=[*extra, _mask(RERUN_S, attention)]) as live:
        out = run_layers(layers, x, *extra)
        live.mark("forward")
        out.sum().backward()  # keeps nothing: the peak is the layers'
    return live.marks["forward"], live.peak_bytes


def _measure_all() -> dict:
    results: dict = {}
    for t, sp in RUNS:
        nc.initialize_model_parallel(t, context_parallel_size=CP)
        for attention in ATTENTIONS:
            for label, config in CHOICES.items():
                m = measure_layers(_model(), _setup(t, sp, attention), config, backward=False)
                results[("layers", t, sp, attention, label)] = m.per_layer_bytes
            results[("model", t, sp, attention)] = _whole_model(t, sp, attention)
        nc.destroy_model_parallel()
    for attention in ATTENTIONS:
        results[("rerun", attention)] = _rerun_peak(attention)
        nc.destroy_model_parallel()
    return results


@pytest.fixture(scope="module")
def measured(world) -> list[dict]:
    """Every rank's measurements, one worker call."""
    return world(WORLD).run(_measure_all)


@pytest.mark.parametrize("t,sp", RUNS)
@pytest.mark.parametrize("attention", ATTENTIONS)
def test_each_layer_keeps_what_the_model_says(measured, t, sp, attention):
    for label, config in CHOICES.items():
        analytic = layer_activation_bytes(_model(), _setup(t, sp, attention), config)
        for rank, per_rank in enumerate(measured):
            kept = per_rank[("layers", t, sp, attention, label)]
            assert kept == [analytic, analytic], f"{label}, rank {rank}: measured {kept}, analytic {analytic}"


@pytest.mark.parametrize("t,sp", RUNS)
@pytest.mark.parametrize("attention", ATTENTIONS)
def test_a_whole_model_keeps_and_peaks_at_the_budget(measured, t, sp, attention):
    for label, config in CHOICES.items():
        budget = memory_budget(_model(), _setup(t, sp, attention), config)
        for rank, per_rank in enumerate(measured):
            forward, peak, _ = per_rank[("model", t, sp, attention)][label]
            assert forward == budget.activation_bytes, (
                f"{label}, rank {rank}: forward {forward}, budget {budget.activation_bytes}"
            )
            assert peak == budget.activation_peak_bytes, (
                f"{label}, rank {rank}: peak {peak}, budget {budget.activation_peak_bytes}"
            )


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_the_core_attention_rerun_keeps_the_gathered_keys_and_values(measured, attention):
    """Inside a checkpoint's rerun the regather steps aside: the rerun keeps ``c`` times this
    rank's K and V, which the peak shows (it is the rerun's, above what the forward kept)."""
    peak = model_activation_peak_bytes(RERUN_SHAPE, _setup(1, False, attention, RERUN_S), "selective")
    for rank, per_rank in enumerate(measured):
        forward, live_peak = per_rank[("rerun", attention)]
        assert live_peak > forward, f"rank {rank}: the rerun should make the peak here"
        assert live_peak == peak, f"rank {rank}: peak {live_peak}, model {peak}"


@pytest.mark.parametrize("t,sp", RUNS)
@pytest.mark.parametrize("attention", ATTENTIONS)
def test_the_rerun_is_priced_as_torch_counts_it(measured, t, sp, attention):
    """On each rank: the rerun stops at the last save, so explicit core attention reruns its
    first query chunk's ``probs @ V``, whose keys depend on the CP rank; the planner's price
    (:class:`LayerOption`) is the costliest rank's."""
    model, setup, first_chunk_matters = _model(), _setup(t, sp, attention), False
    for label, config in CHOICES.items():
        layers = [resolve(model, setup, config).layer(i, model.layers) for i in range(model.layers)]
        by_cp_rank = [sum(rerun_flops(model, setup, spec, cp_rank=r).matmul for spec in layers) for r in range(CP)]
        for rank, per_rank in enumerate(measured):
            counted, priced = per_rank[("model", t, sp, attention)][label][2], by_cp_rank[(rank // t) % CP]
            assert counted == priced, f"{label}, rank {rank}: counted {counted}, priced {priced}"
        planned = sum(o.recompute_matmul_flops for o in stack_options(model, setup, config))
        assert planned == max(by_cp_rank)
        first_chunk_matters |= by_cp_rank[1] > by_cp_rank[0]  # rank 1's first chunk reads 2L keys, rank 0's L
    assert first_chunk_matters == (attention == "explicit")


# ---------------------------------------------------------------------------------------------
# The terms, against their closed forms (no processes).


def _by_name(setup: TrainingSetup, recompute: str = "none", model: ModelShape | None = None) -> dict[str, int]:
    return {t.name: t.nbytes for t in layer_activation_terms(model or _model(), setup, recompute)}


@pytest.mark.parametrize("c", (2, 4, 8))
def test_explicit_keeps_the_chunks_probabilities_not_s_squared(c):
    model = ModelShape("llama", 4096, 32, 8, 14336, 32, 128256)  # Llama-3 8B
    s, t = 65536, 8
    one = _by_name(TrainingSetup(s, tp=t, cp=1), model=model)
    at_c = _by_name(TrainingSetup(s, tp=t, cp=c), model=model)
    a_loc = 32 // t
    assert at_c["probs"] == 2 * a_loc * s * s * (2 * c + 1) // (4 * c * c)  # a b s^2 (2c+1)/(4c^2), bf16
    assert one["probs"] == 2 * a_loc * s * s
    for name in ("q", "k", "v", "proj_input", "gate", "up", "down_input", "norm1_input", "mlp_input"):
        assert at_c[name] * c == one[name], name  # per-token terms at s/c
    assert at_c["cp_index_int64"] == 8 * 2 * c


def test_flash_keeps_each_chunks_output_and_logsumexp():
    setup = TrainingSetup(S, B, tp=2, cp=2, attention="flash")
    terms, a_loc = _by_name(setup), 4 // 2
    local = S // 2
    assert terms["attention_out"] == terms["q"] == 2 * local * B * a_loc * 16
    assert terms["softmax_lse_fp32"] == 4 * a_loc * local * B
    assert "attention_out" not in _by_name(
        replace(setup, cp=1)
    )  # at CP 1 the kernel's output is the projection's input


def test_context_parallel_1_is_the_model_without_it():
    for attention in ATTENTIONS:
        plain = TrainingSetup(S, B, tp=2, attention=attention)
        assert _by_name(plain) == _by_name(replace(plain, cp=1))


def test_the_budget_shares_one_chunk_mask_and_shards_the_optimizer_over_dp_x_cp():
    model = _model()
    explicit = memory_budget(model, TrainingSetup(S, B, tp=1, dp=2, cp=2), "none")
    flash = memory_budget(model, TrainingSetup(S, B, tp=1, dp=2, cp=2, attention="flash"), "none")
    mask = {b.setup.attention: next(i.nbytes for i in b.items if i.name == "attention mask") for b in (explicit, flash)}
    assert mask == {"explicit": (S // 4) * S, "flash": (S // 4) * S * 2}
    sharded = {
        b.setup.cp: next(i.nbytes for i in b.items if i.name == "optimizer moments")
        for b in (explicit, memory_budget(model, TrainingSetup(S, B, tp=1, dp=2), "none"))
    }
    n = model.local_parameters(1)
    assert sharded == {2: 2 * 4 * -(-n // 4), 1: 2 * 4 * -(-n // 2)}


@pytest.mark.parametrize("setup,message", [
    (dict(seq_len=36, tp=2, cp=2, sequence_parallel=True), "tensor_parallel_size = 2 x 2 x 2 = 8"),
    (dict(seq_len=30, cp=4, sequence_parallel=False), "multiple of 2 x context_parallel_size = 2 x 4 = 8"),
    (dict(seq_len=32, cp=0), "cp"),
])  # fmt: skip
def test_a_sequence_that_does_not_split_is_refused_in_one_line(setup, message):
    with pytest.raises(ValueError, match=message) as info:
        TrainingSetup(**setup)
    assert "\n" not in str(info.value)


def test_the_papers_gpt_layer_is_refused_at_cp():
    with pytest.raises(ValueError, match="llama only"):
        layer_activation_bytes(ModelShape.gpt(64, 4, 2), TrainingSetup(S, B, cp=2), "none")


# ---------------------------------------------------------------------------------------------
# The planner and the commands.


def _plan(capsys, *argv: str) -> tuple[int, str, str]:
    return neuron_ckpt_cli(capsys, "plan", *argv)


def test_the_planner_names_the_smallest_cp_that_fits():
    """A job that fits at no recompute choice at CP 1 (nor at a TP degree of its kv heads):
    the message names --cp, and planning at that degree fits."""
    model = ModelShape("llama", 256, 8, 2, 512, 4, 2048)
    setup = TrainingSetup(4096, tp=2, attention="explicit")
    gib = 0.15
    with pytest.raises(NothingFits, match="fits with --cp 4 ") as info:
        plan_recompute(model, setup, gib, reserve_gib=0)
    assert info.value.smallest_cp == 4 and "\n" not in str(info.value)
    with pytest.raises(NothingFits):
        plan_recompute(model, setup.at_context_parallel(2), gib, reserve_gib=0)
    assert plan_recompute(model, setup.at_context_parallel(4), gib, reserve_gib=0).fits
    longest = longest_sequence(model, setup.at_context_parallel(4), gib, reserve_gib=0)
    assert longest is not None and longest >= 4096 and longest % (2 * 4 * 2) == 0
    with pytest.raises(NothingFits):
        plan_recompute(model, replace(setup.at_context_parallel(4), seq_len=longest + 16), gib, reserve_gib=0)


TINY_PLAN = ["--config", "llama2-7b", "--tp", "8", "--seq", "8192", "--device-memory", "trn1"]


@pytest.mark.parametrize("argv,message", [
    ([*TINY_PLAN, "--cp", "0"], "--cp (the context-parallel degree) must be an integer >= 1, got 0"),
    ([*TINY_PLAN[:-3], "8200", "--device-memory", "trn1", "--cp", "2"],
     "sequence length 8200 must be a multiple of 2 x context_parallel_size x tensor_parallel_size = 2 x 2 x 8 = 32"),
    ([*TINY_PLAN, "--cp", "2", "--pp", "2", "--micro-batches", "4"], "--cp 2 --pp 2: context parallelism"),
])  # fmt: skip
def test_plan_refuses_bad_cp_in_one_line(capsys, argv, message):
    code, out, err = _plan(capsys, *argv)
    assert code == 2 and message in err and err.count("\n") == 1, err


def test_memory_takes_cp_and_refuses_what_does_not_split(capsys):
    code, out, _ = neuron_ckpt_cli(
        capsys,
        "memory",
        "--model",
        "llama",
        "--hidden",
        "64",
        "--heads",
        "4",
        "--kv-heads",
        "2",
        "--ffn",
        "176",
        "--seq",
        "32",
        "--micro-batch",
        "2",
        "--cp",
        "2",
        "--json",
    )
    report = json.loads(out)
    assert code == 0 and report["spec"]["cp"] == 2
    assert report["analytic_bytes_per_layer"] == layer_activation_bytes(
        ModelShape("llama", 64, 4, 2, 176, 1, DEFAULT_VOCAB),
        TrainingSetup(32, 2, cp=2, sequence_parallel=False),
        "none",
    )
    code, _, err = neuron_ckpt_cli(
        capsys, "memory", "--model", "gpt", "--hidden", "64", "--heads", "4", "--seq", "32", "--cp", "2"
    )
    assert code == 2 and "--model llama only" in err


def test_plan_json_carries_cp_and_trn1_runs_explicit_under_cp(capsys):
    code, out, _ = _plan(
        capsys,
        "--config",
        "llama3.1-8b",
        "--tp",
        "8",
        "--seq",
        "32768",
        "--device-memory",
        "trn1",
        "--cp",
        "8",
        "--json",
    )
    data = json.loads(out)
    assert code == 0 and data["cp"] == 8 and data["attention"] == "explicit"
    assert any("trn1 runs the explicit attention" in note for note in data["attention_notes"])


# ---------------------------------------------------------------------------------------------
# Issue 47: on trn1 the NKI kernel's k and v, repeated to the query heads, are in the total.


def test_plan_on_trn1_counts_the_nki_kernels_repeated_keys_and_values(capsys):
    argv = ["--config", "llama3-8b", "--tp", "8", "--dp", "16", "--seq", "8192", "--json"]
    code, out, _ = _plan(capsys, *argv, "--device-memory", "trn1")
    trn1 = json.loads(out)
    code_16, out_16, _ = _plan(capsys, *argv, "--device-memory", "16")  # the same GiB, torch's kernel
    torch_kernel = json.loads(out_16)
    assert code == code_16 == 0 and trn1["layers"] == torch_kernel["layers"]
    keeping = sum(name != "full" for name in trn1["layers"])  # layers that keep k and v
    extra = 2 * 2 * 8192 * (4 - 1) * 128  # bf16 k and v, 32/8 query heads against 8/8 kv heads: 12 MiB
    assert keeping > 0 and extra == 12 * 2**20
    assert trn1["budget"]["total_bytes"] - torch_kernel["budget"]["total_bytes"] == keeping * extra
    assert any("counted here, 12.0 MiB per layer more" in note for note in trn1["attention_notes"])
