"""The paper's GPT layer, run for real, keeps what Table 2 says: every row, t = 1, 2, 4.

Each TP degree runs all its cases in one worker call (two shapes x seven rows, two layers each)
on the shared 4-rank world. Measured = distinct storages autograd keeps, leaving out parameters
and the shared causal mask. The one known difference is LayerNorm's saved mean and 1/std: two
[s, b, 1] tensors per norm (in the activation dtype, bf16, on CPU in torch 2.13), 8sb bytes per
layer (8sb/t under sequence parallel), which the paper leaves out: below 0.5% at these shapes.
"""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch

import neuron_ckpt as nc
from neuron_ckpt.memory import ModelShape, TrainingSetup, layer_activation_bytes
from neuron_ckpt.memory.layers import measure_on_ranks
from neuron_ckpt.models.gpt import GPTConfig, GPTStack
from neuron_ckpt.recompute import RecomputeConfig, apply_recompute
from tests.test_memory_analytic import _table2

WORLD = 4
TOLERANCE = 0.02
SHAPES = ((64, 2, 128, 8), (32, 3, 64, 4))  # (s, b, h, a): a and s divisible by every t
# row: (sequence parallel, recompute)
ROWS = {
    "tensor parallel": (False, "none"),
    "tensor + sequence parallel": (True, "none"),
    "tensor parallel + selective": (False, "selective"),
    "tensor + sequence parallel + selective": (True, "selective"),
    "full recompute": (False, "full"),
    "full recompute + sequence parallel": (True, "full"),
    "full recompute + distribute_saved_activations": (
        False,
        RecomputeConfig.preset("full", distribute_saved_activations=True),
    ),
}


def _case(shape: tuple[int, int, int, int], t: int, row: str) -> tuple:
    """(model, setup, recompute) of two such layers."""
    s, b, h, a = shape
    sp, recompute = ROWS[row]
    return ModelShape.gpt(h, a, layers=2), TrainingSetup(s, b, tp=t, sequence_parallel=sp), recompute


def _paper(shape: tuple[int, int, int, int], t: int, row: str) -> Fraction:
    """The paper's closed form for the row; the full-recompute variants keep 2sbh or 2sbh/t."""
    s, b, h, a = shape
    if row.startswith("full recompute"):
        return Fraction(2 * s * b * h, 1 if row == "full recompute" else t)
    return _table2(s, b, h, a, t)[row]


_CASES = [(shape, row) for shape in SHAPES for row in ROWS]
_MEASURED: dict[int, dict] = {}


@pytest.fixture(scope="module")
def measured(world):
    """t -> {(shape, row): [per-rank LayerMeasurement]}, one worker call per t."""

    def get(t: int) -> dict:
        if t not in _MEASURED:
            per_rank = world(WORLD).run(measure_on_ranks, [_case(shape, t, row) for shape, row in _CASES])
            _MEASURED[t] = {case: [rank[i] for rank in per_rank] for i, case in enumerate(_CASES)}
        return _MEASURED[t]

    return get


@pytest.mark.parametrize("t", (1, 2, 4))
@pytest.mark.parametrize("shape,row", _CASES)
def test_measured_matches_analytic_and_the_paper(measured, t, shape, row):
    model, setup, recompute = _case(shape, t, row)
    analytic = layer_activation_bytes(model, setup, recompute)
    assert analytic == _paper(shape, t, row)  # the analytic model is the paper's formula, to the byte
    if t == 1 and row == "tensor parallel":  # the "no parallelism" row: sbh(34 + 5as/h)
        s, b, h, a = shape
        assert analytic == Fraction(s * b * h) * (34 + Fraction(5 * a * s, h))
    for m in measured(t)[(shape, row)]:
        assert m.unscoped_bytes == 0
        assert m.per_layer_bytes[0] == m.per_layer_bytes[1], "identical layers keep identical bytes"
        ratio = m.bytes_per_layer / analytic
        assert abs(ratio - 1) <= TOLERANCE, f"{row}, t={t}, shape={shape}, rank {m.rank}: ratio {ratio:.4f}"
        # What is left over is exactly LayerNorm's mean and 1/std (2 x [s, b, 1] per norm).
        if not row.startswith("full"):
            s, b = shape[0], shape[1]
            tokens = s * b // t if setup.sequence_parallel else s * b
            assert m.bytes_per_layer - analytic == 2 * 2 * tokens * m_stat_bytes(m)


def m_stat_bytes(m) -> int:
    """Bytes per element of the saved LayerNorm statistics (the [s, b, 1] storages)."""
    widths = {dtype for _, dtype, shape, _ in m.storages if shape[-1:] == (1,)}
    assert len(widths) == 1, widths
    return torch.empty(0, dtype=getattr(torch, widths.pop())).element_size()


def test_gpt3_selective_saves_70_percent():
    gpt3 = ModelShape.gpt(12288, 96, layers=1), TrainingSetup(2048, 1, tp=8, sequence_parallel=True)
    kept_all = layer_activation_bytes(*gpt3, "none")
    selective = layer_activation_bytes(*gpt3, "selective")
    assert round(100 * (1 - selective / kept_all)) == 70


# --- the layer itself: the same function at every TP degree ---------------------------------


def _layer_output(t: int, sequence_parallel: bool, recompute: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    nc.destroy_model_parallel()
    state = nc.initialize_model_parallel(t)
    torch.manual_seed(0)
    config = GPTConfig(
        64, 4, hidden_dropout=0.0, attention_dropout=0.0, sequence_parallel=sequence_parallel, dtype=torch.float32
    )
    rc = (
        None
        if recompute is None
        else RecomputeConfig(
            granularity=recompute, **(dict(method="uniform", num_layers=1) if recompute == "full" else {})
        )
    )
    stack = GPTStack(2, config)
    if rc is not None:
        apply_recompute(stack, rc)
    x = torch.randn(16, 2, 64, generator=torch.Generator().manual_seed(1))
    local = x.chunk(t)[state.tp_rank].clone() if sequence_parallel else x.clone()
    local.requires_grad_()
    out = stack(local)
    out.square().sum().backward()
    if sequence_parallel:  # reassemble the sequence shards
        full_out = [torch.empty_like(out) for _ in range(t)]
        full_grad = [torch.empty_like(local.grad) for _ in range(t)]
        torch.distributed.all_gather(full_out, out.detach(), group=state.tp.process_group)
        torch.distributed.all_gather(full_grad, local.grad, group=state.tp.process_group)
        return torch.cat(full_out), torch.cat(full_grad)
    return out.detach(), local.grad


def _layer_outputs() -> dict:
    return {
        (t, sp, rc): _layer_output(t, sp, rc)
        for t in (1, 2, 4)
        for sp in (False, True)
        for rc in (None, "selective", "full")
        if torch.distributed.get_world_size() % t == 0
    }


def test_the_layer_computes_the_same_function_at_every_tp_degree(world):
    results = world(WORLD).run(_layer_outputs)
    ref_out, ref_grad = results[0][(1, False, None)]
    for rank in results:
        for key, (out, grad) in rank.items():
            torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5, msg=lambda m, key=key: f"{key}: {m}")
            torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-5, msg=lambda m, key=key: f"{key}: {m}")


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="num_heads"):
        GPTConfig(64, 3)
    with pytest.raises(ValueError, match="hidden_dropout"):
        GPTConfig(64, 4, hidden_dropout=1.0)
    with pytest.raises(ValueError, match="ffn"):
        ModelShape("gpt", 64, 4, 4, 100, 1, 128)
