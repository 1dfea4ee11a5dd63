"""The recompute's price in FLOPs is what the backward reruns: what it must guarantee.

* For every choice the memory model prices (presets, other module sets, full ``uniform`` and
  ``block`` with several k, per-layer mixes as the planner and the pipeline stages produce them),
  with explicit and flash attention, at TP 1 and on each rank at TP 2 with sequence parallel:
  the priced matmul FLOPs (:attr:`LayerOption.recompute_matmul_flops` over the stack) equal torch's
  own count, ``FlopCounterMode``'s FLOPs of a forward + backward with the choice less the same
  step without, to 0.5% (in fact exactly). The paper's GPT layer too, and the eager reentrant
  checkpoint, which reruns every region to its end (``rerun_flops(whole=True)``).
* A plan's ``recompute_matmul_flops`` is what its ``recompute`` reruns when applied; likewise the
  stages of a pipeline plan, each planned on its own.
* torch's plain ``FlopCounterMode`` does not count the CPU flash kernel; ``flop_counter`` does,
  with torch's formulas for the other SDPA kernels.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import neuron_ckpt as nc
from neuron_ckpt.memory import ModelShape, TrainingSetup, plan_recompute
from neuron_ckpt.memory.analytic import resolve
from neuron_ckpt.memory.flop_count import flop_counter
from neuron_ckpt.memory.options import layer_options, per_layer_options, stack_options
from neuron_ckpt.memory.pipeline import PipelineSetup, plan_pipeline
from neuron_ckpt.memory.rerun import rerun_flops
from neuron_ckpt.models.gpt import GPTConfig, GPTStack
from neuron_ckpt.models.llama import LlamaForCausalLM
from neuron_ckpt.models.llama_args import LlamaArgs
from neuron_ckpt.recompute import RecomputeConfig, apply_recompute

TOLERANCE = 0.005
S, B = 96, 2
ARGS = LlamaArgs(vocab_size=256, hidden_size=160, intermediate_size=432, num_hidden_layers=4,
                 num_attention_heads=10, num_key_value_heads=5, max_position_embeddings=S)  # fmt: skip
"""The issue's shape: h 160, 10 heads, 5 kv heads, ffn 432, 4 layers, s 96, b 2, fp32; at TP 2 with
2 kv heads (5 do not split over 2 ranks)."""


def _args(t: int) -> LlamaArgs:
    return ARGS if t == 1 else replace(ARGS, num_key_value_heads=2)


def _selective(*modules: str) -> RecomputeConfig:
    return RecomputeConfig(granularity="selective", modules=modules)


def _full(method: str, k: int, **kw) -> RecomputeConfig:
    return RecomputeConfig(granularity="full", method=method, num_layers=k, **kw)


PRESETS = ("selective", "selective+mlp_act", "selective+mlp_act+norm", "full")
CHOICES: dict[str, RecomputeConfig | list] = {
    **{name: RecomputeConfig.preset(name) for name in PRESETS},
    "selective[core_attn,mlp]": _selective("core_attn", "mlp"),
    "selective[mlp,norm]": _selective("mlp", "norm"),
    "selective[mlp_act,norm]": _selective("mlp_act", "norm"),
    "full(uniform 2)": _full("uniform", 2),
    "full(uniform 3)": _full("uniform", 3),  # groups of 3 and 1
    "full(block 2)": _full("block", 2),
    "per layer": [_full("uniform", 1), RecomputeConfig.preset("selective+mlp_act+norm"), None, _selective("mlp")],
}
RUNS = {
    (1, False, "explicit"): tuple(CHOICES),
    # The core attention is one kernel, rerun whole: where flash differs.
    (1, False, "flash"): ("selective", "full", "full(uniform 2)"),
    (2, True, "explicit"): ("selective+mlp_act+norm", "full(uniform 2)", "selective[mlp,norm]", "per layer"),
    (2, True, "flash"): ("selective", "full"),
}
"""The choices counted at each (t, sequence parallel, attention): every one at TP 1 with explicit
attention; elsewhere those the setting changes (flash: the kernel reruns whole; TP 2 + SP: this
rank's heads and columns, the norms on s/t tokens, the gathers inside the reruns)."""


def _setup(t: int, sp: bool, attention: str) -> TrainingSetup:
    return TrainingSetup(S, B, tp=t, dtype="fp32", sequence_parallel=sp, attention=attention)


def _priced(name: str, t: int, sp: bool, attention: str, whole: bool = False) -> float:
    """The stack's priced matmul FLOPs on one rank (``whole``: as the eager reentrant checkpoint reruns)."""
    model, setup, choice = ModelShape.from_llama(_args(t)), _setup(t, sp, attention), CHOICES[name]
    if whole:
        priced = resolve(model, setup, choice)
        return sum(
            rerun_flops(model, setup, priced.layer(i, model.layers), whole=True).matmul for i in range(model.layers)
        )
    if isinstance(choice, list):
        options = per_layer_options(model, setup, choice, layer_options(model, setup))
    else:
        options = stack_options(model, setup, choice)
    return sum(o.recompute_matmul_flops for o in options)


def _step_flops(model: torch.nn.Module, ids: torch.Tensor, counter=flop_counter) -> int:
    with counter() as counted:
        model(ids, labels=ids).loss.backward()
    return counted.get_total_flops()


def _llama(t: int, sp: bool, attention: str) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(_args(t), sequence_parallel=sp, attention_implementation=attention).train()


def _counted(t: int, sp: bool, attention: str, names: tuple[str, ...], **config) -> dict[str, int]:
    """Extra FLOPs of one training step with each choice, on this rank (torch's count)."""
    nc.initialize_model_parallel(t)
    ids = torch.randint(0, ARGS.vocab_size, (B, S), generator=torch.Generator().manual_seed(0))
    base = _step_flops(_llama(t, sp, attention), ids)
    out = {}
    for name in names:
        model = _llama(t, sp, attention)
        choice = CHOICES[name]
        if config and isinstance(choice, RecomputeConfig):
            choice = replace(choice, **config)
        apply_recompute(model, choice, sequence_parallel=sp)
        out[name] = _step_flops(model, ids) - base
    return out


@pytest.mark.parametrize("t, sp, attention", RUNS)
def test_priced_matmul_flops_are_torchs_count(world, t, sp, attention):
    for rank, counted in enumerate(world(t).run(_counted, t, sp, attention, RUNS[(t, sp, attention)])):
        for name, flops in counted.items():
            priced = _priced(name, t, sp, attention)
            assert priced == pytest.approx(flops, rel=TOLERANCE, abs=0), (
                f"{name}, t={t}, sp={sp}, {attention}, rank {rank}: priced {priced:.4g}, counted {flops:.4g}"
            )
    if t == 1 and attention == "explicit":
        assert counted["selective[mlp_act,norm]"] == 0  # output-discarding: elementwise only
        # A group reruns its inner layers to their end: more than each layer on its own.
        assert counted["full(uniform 2)"] > counted["full"] > counted["full(block 2)"] > 0


def test_the_eager_reentrant_checkpoint_reruns_every_region_to_its_end(world):
    # distribute_saved_activations (TP 2 without sequence parallel) runs the reentrant checkpoint,
    # which reruns the down projection too; so does use_reentrant=True at TP 1.
    names = ("full", "selective[mlp,norm]")
    for rank, counted in enumerate(
        world(2).run(_counted, 2, False, "explicit", names, distribute_saved_activations=True)
    ):
        for name, flops in counted.items():
            assert flops == pytest.approx(_priced(name, 2, False, "explicit", whole=True), rel=TOLERANCE), (name, rank)
            assert flops > _priced(name, 2, False, "explicit")
    counted = world(1).run(_counted, 1, False, "explicit", ("full", "selective"), use_reentrant=True)[0]
    assert counted["full"] == pytest.approx(_priced("full", 1, False, "explicit", whole=True), rel=TOLERANCE)
    # Core attention reruns probs @ V too: the selective price doubles.
    assert counted["selective"] == pytest.approx(2 * _priced("selective", 1, False, "explicit"), rel=TOLERANCE)


def _gpt_counted(names: tuple[str, ...]) -> dict[str, int]:
    nc.initialize_model_parallel(1)
    config = GPTConfig(hidden_size=128, num_heads=8, sequence_parallel=False, dtype=torch.float32)
    x = torch.randn(64, 2, 128, generator=torch.Generator().manual_seed(0))

    def step(choice) -> int:
        nc.model_parallel_manual_seed(0)
        stack = GPTStack(4, config).train()
        if choice is not None:
            apply_recompute(stack, choice)
        with flop_counter() as counted:
            stack(x.clone().requires_grad_()).square().sum().backward()
        return counted.get_total_flops()

    base = step(None)
    return {name: step(CHOICES[name]) - base for name in names}


def test_gpt_layer_priced_matmul_flops_are_torchs_count(world):
    # Its last op keeps a dropout mask, made after fc2 runs: a full rerun goes to the layer's end.
    model = ModelShape.gpt(128, 8, 4, vocab=256)
    setup = TrainingSetup(64, 2, dtype="fp32", sequence_parallel=False)
    names = ("selective", "selective+mlp_act+norm", "full", "full(uniform 2)")
    counted = world(1).run(_gpt_counted, names)[0]
    for name in names:
        priced = sum(o.recompute_matmul_flops for o in stack_options(model, setup, CHOICES[name]))
        assert abs(priced / counted[name] - 1) <= TOLERANCE, (name, priced, counted[name])


def _applied_counted(choices: list) -> list[int]:
    """Extra FLOPs of a training step with each recompute applied (what ``apply_recompute`` takes)."""
    nc.initialize_model_parallel(1)
    ids = torch.randint(0, ARGS.vocab_size, (B, S), generator=torch.Generator().manual_seed(0))
    base = _step_flops(_llama(1, False, "explicit"), ids)
    out = []
    for choice in choices:
        model = _llama(1, False, "explicit")
        apply_recompute(model, choice)
        out.append(_step_flops(model, ids) - base)
    return out


def test_plans_price_what_their_recompute_reruns(world):
    model, setup = ModelShape.from_llama(ARGS), _setup(1, False, "explicit")
    # A byte short of keeping everything: some layers recompute.
    everything = plan_recompute(model, setup, 1.0, reserve_gib=0).budget.total_bytes
    plan = plan_recompute(model, setup, (everything - 1) / 2**30, reserve_gib=0)
    assert set(plan.layers) != {"none"}
    # Per pipeline stage (2 stages of 2 layers, 8 micro-batches): each stage planned on its own.
    stages = plan_pipeline(model, setup, PipelineSetup(pp=2, microbatches=8), 0.018, reserve_gib=0)
    assert [s.describe() for s in stages.stages] == [
        "1 x full + 1 x selective+mlp_act", "1 x selective+mlp_act + 1 x selective"]  # fmt: skip
    per_layer = [c for stage in stages.stages for chunk in stage.recompute() for c in chunk]
    counted = world(1).run(_applied_counted, [plan.recompute, per_layer])[0]
    assert plan.recompute_matmul_flops == pytest.approx(counted[0], rel=TOLERANCE)
    assert sum(s.recompute_matmul_flops for s in stages.stages) == pytest.approx(counted[1], rel=TOLERANCE)


def _flash_counts() -> tuple[int, int, int]:
    nc.initialize_model_parallel(1)
    ids = torch.randint(0, ARGS.vocab_size, (B, S), generator=torch.Generator().manual_seed(0))
    plain = _step_flops(_llama(1, False, "flash"), ids, lambda: FlopCounterMode(display=False))
    ours = _step_flops(_llama(1, False, "flash"), ids)
    explicit = _step_flops(_llama(1, False, "explicit"), ids)
    return plain, ours, explicit


def test_torchs_counter_misses_the_cpu_flash_kernel_and_ours_counts_it(world):
    plain, ours, explicit = world(1).run(_flash_counts)[0]
    # Forward QK^T and probs @ V, backward five such matmuls: 7 x 2 b a s^2 d per layer.
    square = 4 * 2 * B * ARGS.num_attention_heads * S * S * ARGS.head_dim  # one [s, s] matmul, 4 layers
    assert ours - plain == 7 * square
    # The explicit attention's six bmms (2 forward, 4 backward); the kernel's backward reruns QK^T.
    assert ours - explicit == square
