"""The tensor-by-tensor activation model reproduces the paper's Table 2 to the byte."""

from __future__ import annotations

from fractions import Fraction

import pytest

from neuron_ckpt.memory.analytic import (
    ActivationConfig,
    ActivationTerm,
    LayerShape,
    layer_activation_bytes,
    layer_activation_terms,
    model_activation_bytes,
)

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


_ROW_CONFIGS = {
    "tensor parallel": ActivationConfig(),
    "tensor + sequence parallel": ActivationConfig(sequence_parallel=True),
    "tensor parallel + selective": ActivationConfig(recompute="selective"),
    "tensor + sequence parallel + selective":
        ActivationConfig(sequence_parallel=True, recompute="selective"),
    "full recompute": ActivationConfig(recompute="full"),
}


@pytest.mark.parametrize("s,b,h,a", SHAPES)
@pytest.mark.parametrize("t", TP_DEGREES)
@pytest.mark.parametrize("row", list(_ROW_CONFIGS))
def test_every_table2_row_to_the_byte(s, b, h, a, t, row):
    expected = _table2(s, b, h, a, t)[row]
    assert expected.denominator == 1, "pick shapes where the paper's divisions are exact"
    got = layer_activation_bytes(LayerShape(s, b, h, a, tp=t), _ROW_CONFIGS[row])
    assert got == expected.numerator


@pytest.mark.parametrize("s,b,h,a", SHAPES)
def test_no_parallelism_row_is_34sbh_plus_5as2b(s, b, h, a):
    expected = Fraction(s * b * h) * (34 + Fraction(5 * a * s, h))
    assert layer_activation_bytes(LayerShape(s, b, h, a), ActivationConfig()) == expected


@pytest.mark.parametrize("t", TP_DEGREES)
def test_full_recompute_keeps_a_1_over_t_input_when_sharded(t):
    shape = LayerShape(64, 2, 64, 8, tp=t)
    two_sbh = 2 * 64 * 2 * 64
    distributed = ActivationConfig(recompute="full", distribute_saved_activations=True)
    sequence_shard = ActivationConfig(recompute="full", sequence_parallel=True)
    assert layer_activation_bytes(shape, distributed) == two_sbh // t
    assert layer_activation_bytes(shape, sequence_shard) == two_sbh // t
    assert [term.name for term in layer_activation_terms(shape, distributed)] == ["layer_input"]


def test_gpt3_selective_recompute_saves_70_percent_under_tp_sp():
    shape = LayerShape(seq_len=2048, micro_batch=1, hidden=12288, heads=96, tp=8)
    kept_all = layer_activation_bytes(shape, ActivationConfig(sequence_parallel=True))
    selective = layer_activation_bytes(
        shape, ActivationConfig(sequence_parallel=True, recompute="selective"))
    saved = Fraction(kept_all - selective, kept_all)
    # The paper: 5as/(ht) = 10 against 34/t = 4.25, so 10 / 14.25 of the memory goes away.
    assert saved == Fraction(10, Fraction(57, 4))
    assert round(100 * saved) == 70


def test_breakdown_names_and_the_papers_attention_mlp_split():
    shape = LayerShape(64, 2, 64, 8)
    terms = {term.name: term.nbytes for term in layer_activation_terms(shape, ActivationConfig())}
    assert set(terms) == {
        "ln1_input", "qkv_input", "q_k", "softmax_out", "softmax_dropout_mask",
        "attn_dropout_out", "v", "proj_input", "attn_dropout_mask", "ln2_input",
        "mlp_fc1_input", "gelu_input", "fc2_input", "mlp_dropout_mask",
    }
    sbh, as2b = shape.sbh, shape.as2b
    attention = ("qkv_input", "q_k", "softmax_out", "softmax_dropout_mask", "attn_dropout_out",
                 "v", "proj_input", "attn_dropout_mask")
    mlp = ("mlp_fc1_input", "gelu_input", "fc2_input", "mlp_dropout_mask")
    assert sum(terms[n] for n in attention) == 11 * sbh + 5 * as2b
    assert sum(terms[n] for n in mlp) == 19 * sbh
    assert terms["ln1_input"] + terms["ln2_input"] == 4 * sbh


@pytest.mark.parametrize("t", (2, 8))
def test_tp_without_sp_replicates_exactly_the_10sbh_terms(t):
    shape = LayerShape(64, 2, 64, 8, tp=t)
    replicated = {term.name for term in layer_activation_terms(shape, ActivationConfig())
                  if not term.split_by_tp}
    assert replicated == {"ln1_input", "qkv_input", "attn_dropout_mask", "ln2_input",
                          "mlp_fc1_input", "mlp_dropout_mask"}
    sp_terms = layer_activation_terms(shape, ActivationConfig(sequence_parallel=True))
    assert all(term.split_by_tp for term in sp_terms)


def test_selective_drops_only_the_attention_core():
    shape = LayerShape(64, 2, 64, 8, tp=2)
    full = {t.name for t in layer_activation_terms(shape, ActivationConfig())}
    selective = {t.name for t in layer_activation_terms(shape, ActivationConfig(recompute="selective"))}
    assert full - selective == {"softmax_out", "softmax_dropout_mask", "attn_dropout_out"}


def test_model_bytes_are_layers_times_per_layer_plus_outside_terms():
    shape, config = LayerShape(64, 2, 64, 8, tp=2), ActivationConfig(recompute="selective")
    per_layer = layer_activation_bytes(shape, config)
    assert model_activation_bytes(shape, config, num_layers=32) == 32 * per_layer
    head = ActivationTerm("lm_head_input", 1000, split_by_tp=False)
    assert model_activation_bytes(shape, config, 32, [head]) == 32 * per_layer + 1000
    with pytest.raises(ValueError, match="num_layers"):
        model_activation_bytes(shape, config, num_layers=0)


@pytest.mark.parametrize("kwargs,field", [
    (dict(seq_len=0), "seq_len"),
    (dict(micro_batch=-1), "micro_batch"),
    (dict(hidden=64.0), "hidden"),
    (dict(heads=True), "heads"),
    (dict(hidden=60, heads=8), "heads"),
    (dict(tp=3), "tp"),
    (dict(tp=4, hidden=96, heads=6), "must divide heads"),
    (dict(tp=16, hidden=64, heads=8), "tp"),
    (dict(bytes_per_element=0), "bytes_per_element"),
])
def test_shape_errors_name_the_field(kwargs, field):
    base = dict(seq_len=64, micro_batch=2, hidden=64, heads=8)
    with pytest.raises(ValueError, match=field):
        LayerShape(**{**base, **kwargs})


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="recompute must be one of"):
        ActivationConfig(recompute="block")
    with pytest.raises(ValueError, match="distribute_saved_activations.*sequence_parallel"):
        ActivationConfig(sequence_parallel=True, recompute="full",
                         distribute_saved_activations=True)
    with pytest.raises(ValueError, match="distribute_saved_activations requires recompute"):
        ActivationConfig(recompute="selective", distribute_saved_activations=True)


def test_sequence_parallel_needs_seq_len_divisible_by_tp():
    shape = LayerShape(seq_len=60, micro_batch=1, hidden=64, heads=8, tp=8)
    assert layer_activation_bytes(shape, ActivationConfig()) > 0
    with pytest.raises(ValueError, match="seq_len"):
        layer_activation_bytes(shape, ActivationConfig(sequence_parallel=True))
