"""The tensor-by-tensor activation model reproduces the paper's Table 2 to the byte."""

from __future__ import annotations

import itertools
from fractions import Fraction

import pytest

from neuron_ckpt.memory import (
    ActivationTerm,
    ModelShape,
    TrainingSetup,
    layer_activation_bytes,
    layer_activation_terms,
    model_activation_bytes,
)
from neuron_ckpt.memory.analytic import model_activation_peak_bytes
from neuron_ckpt.recompute import RecomputeConfig

TP_DEGREES = (1, 2, 4, 8)
# (s, b, h, a): small, GPT-3 and MT-NLG-like; every division by t in {1, 2, 4, 8} is exact.
SHAPES = ((64, 2, 64, 8), (2048, 1, 12288, 96), (2048, 1, 20480, 128))


def _table2(s: int, b: int, h: int, a: int, t: int) -> dict[str, Fraction]:
    """Table 2 of Korthikanti et al., written exactly as the paper prints it."""
    sbh, t_, r = Fraction(s * b * h), Fraction(t), Fraction(a * s, h)
    return {
        "tensor parallel": sbh * (10 + 24 / t_ + 5 * r / t_),
        "tensor + sequence parallel": sbh * (34 / t_ + 5 * r / t_),
        "tensor parallel + selective": sbh * (10 + 24 / t_),
        "tensor + sequence parallel + selective": sbh * (34 / t_),
        "full recompute": 2 * sbh,
    }


# row: (sequence parallel, recompute preset)
_ROW_CONFIGS = {
    "tensor parallel": (False, "none"),
    "tensor + sequence parallel": (True, "none"),
    "tensor parallel + selective": (False, "selective"),
    "tensor + sequence parallel + selective": (True, "selective"),
    "full recompute": (False, "full"),
}
FULL_DISTRIBUTED = RecomputeConfig.preset("full", distribute_saved_activations=True)


def _gpt(s: int, b: int, h: int, a: int, t: int = 1, sp: bool = False, layers: int = 1):
    """The paper's layer and how it runs: (ModelShape, TrainingSetup)."""
    return ModelShape.gpt(h, a, layers), TrainingSetup(s, b, tp=t, sequence_parallel=sp)


@pytest.mark.parametrize("s,b,h,a", SHAPES)
@pytest.mark.parametrize("t", TP_DEGREES)
@pytest.mark.parametrize("row", list(_ROW_CONFIGS))
def test_every_table2_row_to_the_byte(s, b, h, a, t, row):
    expected = _table2(s, b, h, a, t)[row]
    assert expected.denominator == 1, "pick shapes where the paper's divisions are exact"
    sp, recompute = _ROW_CONFIGS[row]
    got = layer_activation_bytes(*_gpt(s, b, h, a, t, sp), recompute)
    assert got == expected.numerator


@pytest.mark.parametrize("s,b,h,a", SHAPES)
def test_no_parallelism_row_is_34sbh_plus_5as2b(s, b, h, a):
    expected = Fraction(s * b * h) * (34 + Fraction(5 * a * s, h))
    assert layer_activation_bytes(*_gpt(s, b, h, a), "none") == expected


@pytest.mark.parametrize("t", TP_DEGREES)
def test_full_recompute_keeps_a_1_over_t_input_when_sharded(t):
    two_sbh = 2 * 64 * 2 * 64
    assert layer_activation_bytes(*_gpt(64, 2, 64, 8, t), FULL_DISTRIBUTED) == two_sbh // t
    assert layer_activation_bytes(*_gpt(64, 2, 64, 8, t, sp=True), "full") == two_sbh // t
    assert [term.name for term in layer_activation_terms(*_gpt(64, 2, 64, 8, t), FULL_DISTRIBUTED)] == ["layer_input"]


def test_gpt3_selective_recompute_saves_70_percent_under_tp_sp():
    gpt3 = _gpt(2048, 1, 12288, 96, t=8, sp=True)
    kept_all = layer_activation_bytes(*gpt3, "none")
    selective = layer_activation_bytes(*gpt3, "selective")
    saved = Fraction(kept_all - selective, kept_all)
    # The paper: 5as/(ht) = 10 against 34/t = 4.25, so 10 / 14.25 of the memory goes away.
    assert saved == Fraction(10, Fraction(57, 4))
    assert round(100 * saved) == 70


def test_breakdown_names_and_the_papers_attention_mlp_split():
    terms = {term.name: term.nbytes for term in layer_activation_terms(*_gpt(64, 2, 64, 8), "none")}
    assert set(terms) == {
        "ln1_input",
        "qkv_input",
        "q_k",
        "softmax_out",
        "softmax_dropout_mask",
        "attn_dropout_out",
        "v",
        "proj_input",
        "attn_dropout_mask",
        "ln2_input",
        "mlp_fc1_input",
        "gelu_input",
        "fc2_input",
        "mlp_dropout_mask",
    }
    sbh, as2b = 64 * 2 * 64, 8 * 64 * 64 * 2
    attention = (
        "qkv_input",
        "q_k",
        "softmax_out",
        "softmax_dropout_mask",
        "attn_dropout_out",
        "v",
        "proj_input",
        "attn_dropout_mask",
    )
    mlp = ("mlp_fc1_input", "gelu_input", "fc2_input", "mlp_dropout_mask")
    assert sum(terms[n] for n in attention) == 11 * sbh + 5 * as2b
    assert sum(terms[n] for n in mlp) == 19 * sbh
    assert terms["ln1_input"] + terms["ln2_input"] == 4 * sbh


@pytest.mark.parametrize("t", (2, 8))
def test_tp_without_sp_replicates_exactly_the_10sbh_terms(t):
    replicated = {term.name for term in layer_activation_terms(*_gpt(64, 2, 64, 8, t), "none") if not term.split_by_tp}
    assert replicated == {
        "ln1_input",
        "qkv_input",
        "attn_dropout_mask",
        "ln2_input",
        "mlp_fc1_input",
        "mlp_dropout_mask",
    }
    sp_terms = layer_activation_terms(*_gpt(64, 2, 64, 8, t, sp=True), "none")
    assert all(term.split_by_tp for term in sp_terms)


def test_selective_drops_only_the_attention_core():
    layer = _gpt(64, 2, 64, 8, t=2)
    full = {t.name for t in layer_activation_terms(*layer, "none")}
    selective = {t.name for t in layer_activation_terms(*layer, "selective")}
    assert full - selective == {"softmax_out", "softmax_dropout_mask", "attn_dropout_out"}


def test_model_bytes_are_layers_times_per_layer_plus_outside_terms():
    model, setup = _gpt(64, 2, 64, 8, t=2, layers=32)
    per_layer = layer_activation_bytes(model, setup, "selective")
    assert model_activation_bytes(model, setup, "selective") == 32 * per_layer
    head = ActivationTerm("lm_head_input", 1000, split_by_tp=False)
    assert model_activation_bytes(model, setup, "selective", [head]) == 32 * per_layer + 1000
    with pytest.raises(ValueError, match="layers"):
        ModelShape.gpt(64, 8, layers=0)


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(seq_len=0), "seq_len"),
        (dict(micro_batch=-1), "micro_batch"),
        (dict(hidden=64.0), "hidden"),
        (dict(heads=True), "heads"),
        (dict(hidden=60, heads=8), "heads"),
        (dict(tp=3), "tp"),
        (dict(tp=4, hidden=96, heads=6), "must divide heads"),
        (dict(tp=16, hidden=64, heads=8), "tp"),
        (dict(dtype="fp8"), "dtype must be one of"),
    ],
)
def test_shape_errors_name_the_field(kwargs, field):
    p = dict(seq_len=64, micro_batch=2, hidden=64, heads=8, tp=1, dtype="bf16") | kwargs
    with pytest.raises(ValueError, match=field):
        model = ModelShape.gpt(p["hidden"], p["heads"], layers=1)
        setup = TrainingSetup(p["seq_len"], p["micro_batch"], p["tp"], dtype=p["dtype"], sequence_parallel=False)
        layer_activation_bytes(model, setup, "none")


def test_recompute_errors_name_the_field():
    layer = _gpt(64, 2, 64, 8, t=2)
    with pytest.raises(ValueError, match="recompute must be one of"):
        layer_activation_bytes(*layer, "block")
    with pytest.raises(ValueError, match="distribute_saved_activations.*sequence_parallel"):
        layer_activation_bytes(*_gpt(64, 2, 64, 8, t=2, sp=True), FULL_DISTRIBUTED)
    with pytest.raises(
        ValueError, match="distribute_saved_activations: the selective modules \\['core_attn'\\] keep no"
    ):
        layer_activation_bytes(*layer, RecomputeConfig.preset("selective", distribute_saved_activations=True))
    with pytest.raises(ValueError, match="num_layers=2 is larger than the 1 layers"):
        layer_activation_bytes(*layer, RecomputeConfig(granularity="full", method="block", num_layers=2))
    with pytest.raises(ValueError, match="recompute must be a preset name"):
        layer_activation_bytes(*layer, None)


# --- every selective module set, and full recompute of any grouping --------------------------

# What each module drops from the GPT layer with no recompute (docs/memory.md, "Every recompute choice").
GPT_DROPS = {
    "core_attn": {"softmax_out", "softmax_dropout_mask", "attn_dropout_out"},
    "mlp": {"gelu_input", "fc2_input"},
    "mlp_act": {"fc2_input"},  # output-discarding GeLU: keeps its input, not fc2's
    "norm": {"qkv_input", "mlp_fc1_input"},  # output-discarding norms: their outputs are not kept
}
SUBSETS = [subset for n in range(1, 5) for subset in itertools.combinations(GPT_DROPS, n)]


@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("modules", SUBSETS, ids="+".join)
def test_gpt_module_sets_drop_the_union_of_what_each_drops(modules, sp):
    layer = _gpt(64, 2, 64, 8, t=2, sp=sp)
    none = {t.name: t.nbytes for t in layer_activation_terms(*layer, "none")}
    kept = {t.name: t.nbytes for t in layer_activation_terms(*layer, RecomputeConfig("selective", modules=modules))}
    assert set(none) - set(kept) == set().union(*(GPT_DROPS[m] for m in modules))
    assert all(kept[name] == none[name] for name in kept)  # what stays keeps its bytes
    assert list(kept) == [n for n in none if n in kept]  # in forward order


def test_mlp_encloses_mlp_act_and_distributing_keeps_a_slice_of_the_replicated_inputs():
    layer = _gpt(64, 2, 64, 8, t=4)
    both = RecomputeConfig("selective", modules=("mlp", "mlp_act"))
    assert layer_activation_terms(*layer, both) == layer_activation_terms(
        *layer, RecomputeConfig("selective", modules=["mlp"])
    )
    sbh = 64 * 2 * 64
    sliced = {
        t.name: t.nbytes
        for t in layer_activation_terms(
            *layer, RecomputeConfig("selective", modules=("mlp", "norm"), distribute_saved_activations=True)
        )
    }
    assert sliced["ln1_input"] == sliced["ln2_input"] == 2 * sbh // 4  # 1/t of each norm's input
    assert "mlp_fc1_input" not in sliced  # the MLP checkpoint's input is the discarded norm output
    plain = {
        t.name: t.nbytes
        for t in layer_activation_terms(
            *layer, RecomputeConfig("selective", modules=["mlp"], distribute_saved_activations=True)
        )
    }
    assert plain["mlp_fc1_input"] == 2 * sbh // 4 and plain["ln2_input"] == 2 * sbh


def test_grouped_and_block_full_recompute_read_layer_by_layer():
    model, setup = _gpt(64, 2, 64, 8, t=2, sp=True, layers=8)
    two_sbh_t = 2 * 64 * 2 * 64 // 2
    none = layer_activation_bytes(model, setup, "none")
    uniform = RecomputeConfig("full", "uniform", 3)  # groups 0-2, 3-5, 6-7
    with pytest.raises(ValueError, match="layer: recompute 'full\\(uniform 3\\)' keeps different bytes.*layer=0..7"):
        layer_activation_bytes(model, setup, uniform)
    assert [layer_activation_bytes(model, setup, uniform, i) for i in range(8)] == [two_sbh_t, 0, 0] * 2 + [
        two_sbh_t,
        0,
    ]
    assert model_activation_bytes(model, setup, uniform) == 3 * two_sbh_t
    block = RecomputeConfig("full", "block", 3)
    assert [layer_activation_bytes(model, setup, block, i) for i in range(8)] == [two_sbh_t] * 3 + [none] * 5
    assert model_activation_bytes(model, setup, block) == 3 * two_sbh_t + 5 * none
    assert layer_activation_bytes(model, setup, RecomputeConfig("full", "block", 8)) == two_sbh_t  # every layer alike


def test_the_peak_adds_the_recompute_buffer_of_a_group():
    """While a group of k layers recomputes, k layers' no-recompute activations are alive on top
    of the group inputs the earlier groups hold (the group's own input is the rerun's input)."""
    model, setup = _gpt(64, 2, 64, 8, t=2, sp=True, layers=8)
    two_sbh_t, none = 2 * 64 * 2 * 64 // 2, layer_activation_bytes(model, setup, "none")
    for k in (1, 2, 4, 8):
        grouped = RecomputeConfig("full", "uniform", k)
        assert model_activation_bytes(model, setup, grouped) == 8 // k * two_sbh_t
        assert model_activation_peak_bytes(model, setup, grouped) == 8 // k * two_sbh_t + k * none - two_sbh_t
    assert model_activation_peak_bytes(model, setup, "none") == 8 * none  # nothing comes back
    head = [ActivationTerm("lm_head_input", 10**9, split_by_tp=False)]  # freed before the layers' backward
    assert model_activation_peak_bytes(model, setup, "full", after=head) == 8 * two_sbh_t + 10**9


def test_sequence_parallel_needs_seq_len_divisible_by_tp():
    assert layer_activation_bytes(*_gpt(60, 1, 64, 8, t=8), "none") > 0
    with pytest.raises(ValueError, match="seq_len"):
        layer_activation_bytes(*_gpt(60, 1, 64, 8, t=8, sp=True), "none")
