"""Every selective module set keeps what ``layer_activation_terms`` says, measured to the byte.

(For the paper's GPT layer: to the byte once LayerNorm's statistics, which the paper leaves out,
are added; at t = 1, 2 and 2 with sequence parallel.)

All 15 non-empty subsets of ``core_attn``, ``mlp``, ``mlp_act``, ``norm`` on real
``LlamaDecoderLayer`` stacks (GQA with fewer kv heads than t = 4), at t = 1, 2, 4, with and
without sequence parallel, explicit and flash attention, bf16 and fp32, and with
``distribute_saved_activations`` (t > 1, no sequence parallel) where a module has a replicated
input to slice (``mlp``, ``norm``). One worker call per TP degree on the shared 4-rank world.
``norm`` and ``mlp_act`` are output-discarding recompute (docs/memory.md, "Every recompute
choice").
"""

from __future__ import annotations

import itertools

import pytest

from neuron_ckpt.memory import ModelShape, TrainingSetup, layer_activation_bytes
from neuron_ckpt.memory.layers import measure_on_ranks
from neuron_ckpt.recompute import DENSE_MODULES, RecomputeConfig

WORLD = 4
S, B, H, A, G, F = 32, 2, 64, 4, 2, 176
SUBSETS = [subset for n in range(1, 5) for subset in itertools.combinations(DENSE_MODULES, n)]


def _cases(t: int) -> list[tuple[tuple[str, ...], bool, str, str, bool]]:
    """(modules, sequence parallel, attention, dtype, distribute) measured at degree t."""
    cases = [
        (m, sp, attention, dtype, False)
        for m in SUBSETS
        for sp in ((False, True) if t > 1 else (False,))
        for attention in ("explicit", "flash")
        for dtype in ("bf16", "fp32")
    ]
    if t > 1:
        cases += [(m, False, "explicit", "bf16", True) for m in SUBSETS if {"mlp", "norm"} & set(m)]
    return cases


def _case(t: int, modules, sp: bool, attention: str, dtype: str, distribute: bool) -> tuple:
    """(model, setup, recompute) of two such layers."""
    setup = TrainingSetup(S, B, tp=t, dtype=dtype, sequence_parallel=sp, attention=attention)
    config = RecomputeConfig("selective", modules=modules, distribute_saved_activations=distribute)
    return ModelShape("llama", H, A, G, F, 2, vocab=32000), setup, config


# The paper's GPT layer (explicit attention, dropout, LayerNorm): every set at t = 1, 2, 2 + SP.
GPT_S, GPT_B, GPT_H, GPT_A = 32, 2, 64, 4


def _gpt_cases(t: int) -> list[tuple[tuple[str, ...], bool]]:
    return [(m, sp) for m in SUBSETS for sp in ((False, True) if t > 1 else (False,))] if t < 4 else []


def _gpt_case(t: int, modules, sp: bool) -> tuple:
    setup = TrainingSetup(GPT_S, GPT_B, tp=t, sequence_parallel=sp)
    return ModelShape.gpt(GPT_H, GPT_A, layers=2), setup, RecomputeConfig("selective", modules=modules)


_MEASURED: dict[int, dict] = {}


@pytest.fixture(scope="module")
def measured(world):
    """t -> {case: [per-rank LayerMeasurement]}, Llama's and GPT's cases in one worker call."""

    def get(t: int) -> dict:
        if t not in _MEASURED:
            keys = [("llama", *c) for c in _cases(t)] + [("gpt", *c) for c in _gpt_cases(t)]
            cases = [_case(t, *k[1:]) if k[0] == "llama" else _gpt_case(t, *k[1:]) for k in keys]
            per_rank = world(WORLD).run(measure_on_ranks, cases)
            _MEASURED[t] = {key: [rank[i] for rank in per_rank] for i, key in enumerate(keys)}
        return _MEASURED[t]

    return get


def _param(t: int, modules, sp: bool, attention: str, dtype: str, distribute: bool):
    name = f"t{t}-{'+'.join(modules)}-{'sp' if sp else 'nosp'}-{attention}-{dtype}" + (
        "-distributed" if distribute else ""
    )
    return pytest.param(t, modules, sp, attention, dtype, distribute, id=name)


@pytest.mark.parametrize(
    "t,modules,sp,attention,dtype,distribute", [_param(t, *c) for t in (1, 2, 4) for c in _cases(t)]
)
def test_measured_matches_analytic(measured, t, modules, sp, attention, dtype, distribute):
    analytic = layer_activation_bytes(*_case(t, modules, sp, attention, dtype, distribute))
    for m in measured(t)[("llama", modules, sp, attention, dtype, distribute)]:
        assert m.unscoped_bytes == 0
        assert m.per_layer_bytes == [analytic, analytic], f"rank {m.rank}: {m.per_layer_bytes} against {analytic}"


@pytest.mark.parametrize("t,modules,sp", [(t, *c) for t in (1, 2) for c in _gpt_cases(t)])
def test_gpt_measured_is_analytic_plus_the_layernorm_statistics(measured, t, modules, sp):
    """The paper leaves out LayerNorm's mean and 1/std (two [s, b, 1] tensors per norm, bf16 on
    CPU), and so does the model: they are the whole difference, and output-discarding norms
    keep none of them."""
    analytic = layer_activation_bytes(*_gpt_case(t, modules, sp))
    tokens = GPT_S * GPT_B // (t if sp else 1)
    statistics = 0 if "norm" in modules else 2 * 2 * tokens * 2
    for m in measured(t)[("gpt", modules, sp)]:
        assert m.per_layer_bytes == [analytic + statistics] * 2, f"rank {m.rank}: {m.per_layer_bytes}, {analytic}"
