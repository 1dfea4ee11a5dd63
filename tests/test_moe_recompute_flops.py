"""transformers' MoE and MLA layers: what ``neuron_ckpt.memory.moe`` prices a recompute choice to
rerun is what the backward reruns, to the FLOP.

``LayerMemory.rerun.matmul`` summed over the layers equals ``FlopCounterMode``'s count (FLOPs of a
forward + backward through the decoder layers with the choice, less the same step without;
``flop_counter`` adds formulas for the CPU flash kernel and ``_grouped_mm``, which torch does not
count) for every choice and combination each tiny model has (tests/test_memory_moe.py's models
and choices): eager attention and experts in fp32, sdpa (flash kernel, MLA's math path) and
grouped_mm in bf16, at TP 1 and on each rank at TP 2 with sequence parallel.
"""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")

from neuron_ckpt.memory.flop_count import flop_counter  # noqa: E402
from neuron_ckpt.memory.moe import layer_memory  # noqa: E402
from neuron_ckpt.memory.moe.measure import build_model, layer_inputs  # noqa: E402

from .test_memory_moe import SHAPES, choices, kinds, setup  # noqa: E402

TOLERANCE = 0.005


def _counted(family: str, setup_name: str, tp: int = 1, sequence_parallel: bool = False, only=None) -> dict[str, int]:
    """Each choice's (``only`` these) extra FLOPs over none in one training step of the layers, on this rank."""
    import neuron_ckpt as nc

    nc.initialize_model_parallel(tp)
    shape, s = SHAPES[family], setup(setup_name, tp, sequence_parallel)

    def step(choice: str) -> int:
        model = build_model(shape, s, choice)
        x, position_ids, _ = layer_inputs(model, s)
        with flop_counter() as counted:
            model.model(inputs_embeds=x, position_ids=position_ids).last_hidden_state.float().square().mean().backward()
        return counted.get_total_flops()

    base = step("none")
    return {c: step(c) - base for c in choices(shape) if c != "none" and (only is None or c in only)}


def _check(family: str, setup_name: str, counted: dict[str, int], tp: int = 1, sequence_parallel: bool = False):
    shape, s = SHAPES[family], setup(setup_name, tp, sequence_parallel)
    for choice, flops in counted.items():
        priced = sum(layer_memory(shape, s, choice, kind).rerun.matmul for kind in kinds(shape))
        assert priced == pytest.approx(flops, rel=TOLERANCE, abs=0), (family, setup_name, tp, choice, priced, flops)


def test_deepseek_v3_every_choice_at_tp1(world):
    # MLA (sdpa's math path on CPU: the head sizes differ), grouped_mm experts, shared experts, a
    # dense first layer; bf16.
    counted = world(1).run(_counted, "deepseek_v3", "bf16-sdpa-grouped_mm")[0]
    _check("deepseek_v3", "bf16-sdpa-grouped_mm", counted)
    # The MoE block reruns its routed experts' down projection (the weighting keeps its output) but
    # not the shared experts' (its input is kept, and they run last): more than the shared experts.
    assert counted["moe"] > counted["shared_experts"] > 0 and counted["mla_up_proj"] > 0
    assert counted["moe_act"] == counted["mlp_act"] == counted["norm"] == 0  # output-discarding: elementwise


def test_qwen3_eager_attention_and_experts_at_tp1(world):
    only = ("core_attn", "moe", "full", "norm+moe")
    _check("qwen3_moe", "fp32-eager-eager", world(1).run(_counted, "qwen3_moe", "fp32-eager-eager", only=only)[0])


def test_qwen2_every_choice_on_every_rank_at_tp2_with_sequence_parallel(world):
    # Its shared expert runs first and is gated after the routed experts: the MoE block reruns all.
    for counted in world(2).run(_counted, "qwen2_moe", "fp32-eager-eager", 2, True):
        _check("qwen2_moe", "fp32-eager-eager", counted, 2, True)
