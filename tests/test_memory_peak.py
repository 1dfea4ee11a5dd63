"""The peak of live activations over a whole step, measured, equals the budget's to the byte.

* ``LiveSavedTensors`` counts what autograd holds for backward from the forward's first save to
  the backward's last free: distinct storages, parameters and named tensors left out, the
  recompute inside backward seen (reentrant checkpoint), torch's non-reentrant one not.
* A tiny 8-layer ``LlamaForCausalLM`` run with grouped full recompute (k = 1, 2, 4), block, and
  selective module sets, at TP 1 and at TP 2 with sequence parallel (and TP 2 with distributed
  saved inputs), peaks at exactly ``memory_budget(...).activation_peak_bytes``; its forward ends
  at exactly ``activation_bytes``.
* Grouped full recompute keeps the least after the forward and peaks the highest: while a group
  of k layers recomputes, k layers' activations are alive, so the buffer is in ``total_bytes``.
"""

from __future__ import annotations

import pytest
import torch

import neuron_ckpt as nc
from neuron_ckpt.memory import ModelShape, TrainingSetup, memory_budget
from neuron_ckpt.memory.live import LiveSavedTensors
from neuron_ckpt.models.llama import LlamaForCausalLM
from neuron_ckpt.parallel import CoreAttention
from neuron_ckpt.recompute import RecomputeConfig, apply_recompute

from .helpers import tiny_config

S, B, LAYERS = 32, 2, 8
SIZES = {"vocab_size": 256, "intermediate_size": 176, "max_position_embeddings": S, "num_hidden_layers": LAYERS}
FULL = {f"uniform {k}": RecomputeConfig("full", "uniform", k) for k in (1, 2, 4)} | {
    "block 3": RecomputeConfig("full", "block", 3)
}
SELECTIVE = {
    "+".join(m): RecomputeConfig("selective", modules=m)
    for m in (("core_attn",), ("mlp",), ("core_attn", "mlp"), ("norm",), ("mlp_act",), ("mlp", "norm"))
}
CHOICES = {"none": RecomputeConfig()} | FULL | SELECTIVE
DISTRIBUTED = {
    f"{name}, distributed": RecomputeConfig(c.granularity, c.method, c.num_layers, distribute_saved_activations=True)
    for name, c in FULL.items()
    if name in ("uniform 2", "block 3")
}


# ---------------------------------------------------------------------------------------------
# The tracker on single ops.

N = 1000  # fp32 elements: 4000 bytes a tensor


def test_live_bytes_follow_saves_and_frees_one_storage_once():
    x = torch.randn(N, requires_grad=True)
    with LiveSavedTensors() as live:
        y = x.exp()  # keeps its output y
        z = y[: N // 2].sin()  # keeps its input: a view of y, whose whole storage it keeps alive
        live.mark("forward")
        z.sum().backward()
    assert live.marks["forward"] == 4 * N  # y's storage, once
    assert live.peak_bytes == 4 * N and live.live_bytes == 0


def test_parameters_and_named_tensors_are_left_out():
    linear = torch.nn.Linear(N, 8)
    x, shared = torch.randn(2, N, requires_grad=True), torch.randn(2, N)
    with LiveSavedTensors(exclude_modules=[linear], exclude_tensors=[shared]) as live:
        out = linear(x * shared)  # keeps shared (the mul), x * shared and the weight (the linear)
        live.mark("forward")
        out.sum().backward()
    assert live.marks["forward"] == 4 * 2 * N  # x * shared only
    assert live.live_bytes == 0


def test_a_branch_dropped_in_the_forward_is_freed_but_its_peak_stays():
    x = torch.randn(N, requires_grad=True)
    with LiveSavedTensors() as live:
        dropped = x.exp()
        del dropped  # its graph goes, and with it the saved output
        kept = x.sin()  # keeps x: a leaf, its own storage
        live.mark("forward")
        kept.sum().backward()
    assert live.peak_bytes == 4 * N and live.marks["forward"] == 4 * N


@pytest.mark.parametrize("use_reentrant,rerun_seen", [(True, True), (False, False)])
def test_recompute_in_backward_is_seen_through_the_reentrant_checkpoint_only(use_reentrant, rerun_seen):
    from neuron_ckpt.recompute import checkpoint

    x = torch.randn(N, requires_grad=True)
    with LiveSavedTensors() as live:
        out = checkpoint(lambda v: v.exp().sin(), x, use_reentrant=use_reentrant)  # keeps x only
        live.mark("forward")
        out.sum().backward()  # the rerun keeps exp's output and sin's input: one storage
    assert live.marks["forward"] == 4 * N
    assert live.peak_bytes == 4 * N + (4 * N if rerun_seen else 0)


# ---------------------------------------------------------------------------------------------
# A whole Llama, forward and backward.


def _reentrant(config: RecomputeConfig) -> RecomputeConfig:
    """The same recompute through the reentrant checkpoint, whose rerun the tracker sees."""
    return RecomputeConfig(
        config.granularity,
        config.method,
        config.num_layers,
        config.modules,
        config.distribute_saved_activations,
        use_reentrant=True,
    )


def _peaks(t: int, sp: bool, attention: str, choices: dict[str, RecomputeConfig]) -> dict[str, tuple[int, int, int]]:
    """(live bytes when the forward ends, peak over forward and backward, live bytes when the
    backward ends) of each choice."""
    nc.initialize_model_parallel(t)
    out = {}
    for label, config in choices.items():
        torch.manual_seed(0)
        model = LlamaForCausalLM(
            tiny_config(**SIZES), sequence_parallel=sp, attention_implementation=attention, dtype=torch.bfloat16
        ).train()
        if config.enabled:
            apply_recompute(model, _reentrant(config), sequence_parallel=sp)
        masks = [m.causal_mask(S, torch.device("cpu")) for m in model.modules() if isinstance(m, CoreAttention)]
        ids = torch.randint(0, SIZES["vocab_size"], (B, S), generator=torch.Generator().manual_seed(0))
        with LiveSavedTensors(exclude_modules=[model], exclude_tensors=masks) as live:
            loss = model(ids, labels=ids.clone()).loss
            live.mark("forward")
            loss.backward()
            live.mark("backward")
        del loss  # the graph, and whatever its nodes still hold
        assert live.live_bytes == 0, f"{label}: {live.live_bytes} bytes outlive the graph"
        out[label] = (live.marks["forward"], live.peak_bytes, live.marks["backward"])
    return out


def _budget(t: int, sp: bool, attention: str, config: RecomputeConfig):
    model = ModelShape.from_llama(tiny_config(**SIZES))
    return memory_budget(model, TrainingSetup(S, B, tp=t, dp=2 // t, sequence_parallel=sp, attention=attention), config)


RUNS = [
    (1, False, "explicit", CHOICES),
    (1, False, "flash", FULL),
    (2, True, "explicit", CHOICES),
    (2, False, "explicit", DISTRIBUTED),
]


def _all_peaks() -> list[dict[str, tuple[int, int, int]]]:
    results = []
    for t, sp, attention, choices in RUNS:
        results.append(_peaks(t, sp, attention, choices))
        nc.destroy_model_parallel()
    return results


@pytest.fixture(scope="module")
def measured(world) -> dict[tuple, list[dict[str, tuple[int, int, int]]]]:
    """(t, sp, attention) -> per rank {label: (forward, peak, after)}: one worker call for every run."""
    per_rank = world(2).run(_all_peaks)
    return {run[:3]: [rank[i] for rank in per_rank] for i, run in enumerate(RUNS)}


@pytest.mark.parametrize("t,sp,attention,label", [(*run[:3], label) for run in RUNS for label in run[3]])
def test_measured_peak_equals_the_budget(measured, t, sp, attention, label):
    config = next(run[3][label] for run in RUNS if run[:3] == (t, sp, attention))
    budget = _budget(t, sp, attention, config)
    for rank, by_label in enumerate(measured[(t, sp, attention)]):
        forward, peak, after = by_label[label]
        assert forward == budget.activation_bytes, (
            f"rank {rank}: forward keeps {forward}, budget {budget.activation_bytes}"
        )
        assert peak == budget.activation_peak_bytes, f"rank {rank}: peak {peak}, budget {budget.activation_peak_bytes}"
        assert after == 0, f"rank {rank}: {after} bytes held after the backward"
