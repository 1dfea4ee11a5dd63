"""The Llama layer keeps what ``layer_activation_terms`` says: every recompute preset, both
attentions.

Real ``LlamaDecoderLayer`` stacks (bf16 and fp32; explicit attention with fp32 softmax, or
torch's SDPA flash kernel; RMSNorm, SwiGLU, GQA, rotary) on the shared 4-rank world, one worker
call per TP degree. Parameters, the causal
mask and the rotary tables (shared by all layers; a per-model term) are left out. The analytic
model counts RMSNorm's fp32 statistics too, so the match is exact, not just within 2%.
"""

from __future__ import annotations

import pytest

from neuron_ckpt.memory import ModelShape, TrainingSetup, layer_activation_bytes, layer_activation_terms
from neuron_ckpt.memory.layers import measure_on_ranks
from neuron_ckpt.memory.shape import default_ffn
from neuron_ckpt.recompute import RecomputeConfig

WORLD = 4
TOLERANCE = 0.02
# (s, b, h, a, g, f): GQA with g < t at t = 4 (replicated kv heads); MHA with an odd-sized FFN.
SHAPES = ((64, 2, 128, 8, 2, 344), (32, 3, 64, 4, 4, 176))
# row: (sequence parallel, recompute)
ROWS = {
    "none": (False, "none"),
    "sequence parallel": (True, "none"),
    "selective": (False, "selective"),
    "selective + sequence parallel": (True, "selective"),
    "selective+mlp_act": (False, "selective+mlp_act"),
    "full": (False, "full"),
    "full + distribute_saved_activations": (False, RecomputeConfig.preset("full", distribute_saved_activations=True)),
}
_CASES = [
    (shape, row, dtype, attention)
    for shape in SHAPES
    for row in ROWS
    for dtype in ("bf16", "fp32")
    for attention in ("explicit", "flash")
]
_MEASURED: dict[int, dict] = {}


def _llama(h: int, a: int, g: int, f: int, layers: int = 2) -> ModelShape:
    return ModelShape("llama", h, a, g, f, layers, vocab=32000)


def _case(shape, t: int, row: str, dtype: str, attention: str) -> tuple:
    """(model, setup, recompute) of two such layers."""
    s, b, h, a, g, f = shape
    sp, recompute = ROWS[row]
    setup = TrainingSetup(s, b, tp=t, dtype=dtype, sequence_parallel=sp, attention=attention)
    return _llama(h, a, g, f), setup, recompute


@pytest.fixture(scope="module")
def measured(world):
    def get(t: int) -> dict:
        if t not in _MEASURED:
            per_rank = world(WORLD).run(measure_on_ranks, [_case(*case[:1], t, *case[1:]) for case in _CASES])
            _MEASURED[t] = {case: [rank[i] for rank in per_rank] for i, case in enumerate(_CASES)}
        return _MEASURED[t]

    return get


@pytest.mark.parametrize("t", (1, 2, 4))
@pytest.mark.parametrize("shape,row,dtype,attention", _CASES)
def test_measured_matches_analytic(measured, t, shape, row, dtype, attention):
    analytic = layer_activation_bytes(*_case(shape, t, row, dtype, attention))
    for m in measured(t)[(shape, row, dtype, attention)]:
        assert m.unscoped_bytes == 0
        assert m.per_layer_bytes[0] == m.per_layer_bytes[1]
        ratio = m.bytes_per_layer / analytic
        assert abs(ratio - 1) <= TOLERANCE, (
            f"{row} {dtype} {attention}, t={t}, shape={shape}, rank {m.rank}: {ratio:.4f}"
        )
        assert m.bytes_per_layer == analytic  # nothing is left out of the Llama model


def _by_name(
    model: ModelShape, recompute: str = "none", s: int = 64, b: int = 2, t: int = 1, attention: str = "explicit"
) -> dict[str, int]:
    setup = TrainingSetup(s, b, tp=t, sequence_parallel=False, attention=attention)
    return {term.name: term.nbytes for term in layer_activation_terms(model, setup, recompute)}


def test_terms_follow_the_derivation():
    s, b, h, a, g, f = 64, 2, 128, 8, 2, 344
    d = h // a
    terms = _by_name(_llama(h, a, g, f), s=s, b=b)
    sbh = s * b * h
    norm = 2 * sbh + 4 * s * b  # the fused RMSNorm: its bf16 input, the fp32 1/rms
    assert terms["norm1_input"] + terms["norm1_rstd_fp32"] == norm
    assert terms["k"] == terms["v"] == 2 * s * b * g * d  # kv heads, not repeated
    assert terms["probs"] == 2 * a * s * s * b  # the fused masked softmax keeps only its bf16 output
    assert sum(terms[n] for n in ("gate", "up", "down_input")) == 6 * s * b * f  # silu(gate) recomputed
    assert (
        sum(terms.values())
        == 2 * norm + 2 * 2 * sbh + 2 * s * b * (2 * a * d + 2 * g * d) + 2 * a * s * s * b + 6 * s * b * f
    )
    selective = _by_name(_llama(h, a, g, f), "selective", s=s, b=b)
    assert set(terms) - set(selective) == {"probs"}
    mlp_act = _by_name(_llama(h, a, g, f), "selective+mlp_act", s=s, b=b)
    assert set(selective) - set(mlp_act) == {
        "down_input"
    }  # output-discarding SwiGLU: the down projection keeps nothing


def test_flash_keeps_a_logsumexp_instead_of_the_probabilities():
    s, b, h, a, g, f = 64, 2, 128, 8, 2, 344
    model = _llama(h, a, g, f)
    explicit, flash = _by_name(model, s=s, b=b), _by_name(model, s=s, b=b, attention="flash")
    assert set(explicit) - set(flash) == {"probs"} and set(flash) - set(explicit) == {"softmax_lse_fp32"}
    assert flash["softmax_lse_fp32"] == 4 * a * s * b  # fp32, one per query row and head
    assert flash["k"] == explicit["k"] == 2 * s * b * g * (h // a)  # enable_gqa: not expanded
    for recompute in ("selective", "selective+mlp_act", "full"):  # the recompute presets keep what explicit's do
        assert _by_name(model, recompute, s=s, b=b, attention="flash") == _by_name(model, recompute, s=s, b=b)


def test_flash_is_refused_for_the_papers_gpt_layer():
    with pytest.raises(ValueError, match="llama only.*dropout"):
        layer_activation_bytes(ModelShape.gpt(64, 4, 2), TrainingSetup(32, attention="flash"), "none")
    with pytest.raises(ValueError, match="attention must be one of"):
        TrainingSetup(32, attention="sdpa")


def test_gqa_kv_heads_are_replicated_when_fewer_than_tp():
    model = _llama(128, 8, 2, 344)
    assert model.local_kv_heads(4) == 1
    assert _by_name(model, t=4)["k"] == 2 * 64 * 2 * 1 * 16


def test_llama2_7b_default_ffn_and_shape_errors():
    assert default_ffn("llama", 4096) == 11008
    with pytest.raises(ValueError, match="kv_heads"):
        _llama(128, 8, 3, 344)
    with pytest.raises(ValueError, match="ffn"):
        _by_name(_llama(128, 8, 2, 342), t=4)
    with pytest.raises(ValueError, match="kv_heads.*tp"):
        _by_name(_llama(96, 6, 3, 96), t=2)
