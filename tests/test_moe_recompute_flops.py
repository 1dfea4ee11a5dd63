"""transformers layers of every family ``neuron_ckpt.memory.moe`` prices: what it prices a recompute
choice to rerun is what the backward reruns, to the FLOP.

``LayerMemory.rerun.matmul`` summed over the layers equals ``FlopCounterMode``'s count (FLOPs of a
forward + backward through the decoder layers with the choice, less the same step without;
``flop_counter`` adds formulas for the CPU flash kernel and ``_grouped_mm``, which torch does not
count) for every choice and combination each tiny model has. The models are the memory tests'
(tests/test_memory_families.py's configs and tests/test_memory_moe.py's Mixtral, Qwen2/3-MoE and
DeepSeek-V3), one case per distinct code path (Llama, Mistral and Qwen3 run no op the others do
not): sdpa's flash kernel with and without a mask (sliding, chunked),
eager attention with GQA, per-head, per-projection and L2 q/k norms, Gemma2's soft-capping,
GPT-OSS's sinks, fused q/k/v and MLP (Phi-3), Llama 4's NoPE layers, MLA split by heads
(DeepSeek-V2) and whole (V3, sdpa's math path and eager), every router, grouped_mm and the eager
experts loop (with ``moe_act`` on it), GPT-OSS's clamped experts, Llama 4's every-expert ``bmm``,
plain and gated shared experts; at TP 1, and on each rank at TP 2 with sequence parallel for the
plans that split differently (gathered projections; heads, MLA and experts split). One model per
case, each choice applied to it in turn. The counts are exact integers, and so is the comparison.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from neuron_ckpt.memory.flop_count import flop_counter  # noqa: E402
from neuron_ckpt.memory.moe import MoESetup, layer_memory  # noqa: E402
from neuron_ckpt.memory.moe.measure import build_model, layer_inputs, recompute_config  # noqa: E402
from neuron_ckpt.recompute import apply_recompute, remove_recompute  # noqa: E402

from . import test_memory_families as families  # noqa: E402
from . import test_memory_moe as moe  # noqa: E402

FAMILIES = {  # one case per distinct path (test_memory_families' models and setups), what it adds
    "qwen2": ("bf16", "sdpa", "grouped_mm"),  # the flash kernel, unmasked (full layer) and masked (sliding)
    "gemma2": ("fp32", "eager", "grouped_mm"),  # soft-capping, four norms (1 + w), GeGLU
    "phi3": ("bf16", "sdpa", "grouped_mm"),  # fused qkv_proj and gate_up_proj, RoPE's cat
    "olmoe": ("fp32", "eager", "eager"),  # q/k norms over the projection, the eager experts loop
    "deepseek_v2": ("bf16", "sdpa", "grouped_mm"),  # MLA split by heads, group-limited softmax, a dense layer
    "gpt_oss": ("bf16", "eager", "grouped_mm"),  # sinks, clamped experts with biases, top-k then softmax
    "aria_text": ("bf16", "sdpa", "grouped_mm"),  # top-k then softmax, plain shared experts
    "llama4_text": ("bf16", "sdpa", "grouped_mm"),  # chunked (masked), NoPE + temperature, L2 norms, every expert
}
MOE = {  # test_memory_moe's models
    "mixtral": ["bf16-sdpa-grouped_mm"],  # softmax router renormalised in fp32
    "qwen3_moe": ["fp32-eager-eager"],  # eager GQA with per-head q/k norms
    "qwen2_moe": ["bf16-sdpa-grouped_mm"],  # the shared expert first, gated after the routed experts
    "deepseek_v3": ["bf16-sdpa-grouped_mm", "fp32-eager-eager"],  # MLA: sdpa's math path and eager; sigmoid groups
}
CASES = [*FAMILIES.items()] + [(family, moe.SETUPS[name]) for family, names in MOE.items() for name in names]
# TP 2 + SP, the plans that split differently: gathered projections (Phi-3), MLA and shared experts
# split by heads and columns (DeepSeek-V2), experts split on the eager loop (Qwen2-MoE)
TP2 = [
    ("phi3", FAMILIES["phi3"]),
    ("deepseek_v2", FAMILIES["deepseek_v2"]),
    ("qwen2_moe", moe.SETUPS["fp32-eager-eager"]),
]


def _shape(family: str):
    return moe.SHAPES[family] if family in moe.SHAPES else families.shape(family)


def _choices(family: str, combinations: bool = True) -> list[str]:
    s = _shape(family)
    names = moe.choices(s) if family in moe.SHAPES else families.choices(s)
    return [c for c in names if c != "none" and (combinations or "+" not in c)]


def counted(cases, tp: int = 1, sequence_parallel: bool = False) -> list[dict[str, int]]:
    """Per case, each choice's extra FLOPs over none in one training step of the layers, on this
    rank (at TP > 1 the single modules: their sums are checked at TP 1)."""
    if tp > 1:
        import neuron_ckpt as nc

        nc.initialize_model_parallel(tp)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: two threads on a loaded machine spin 100x longer
    try:
        out = []
        for family, setup in cases:
            s = MoESetup(families.S, families.B, tp, *setup, sequence_parallel=sequence_parallel)
            model = build_model(_shape(family), s, "none")
            x, position_ids = layer_inputs(model, s)
            flops = {}
            for choice in ["none", *_choices(family, combinations=tp == 1)]:
                remove_recompute(model)
                config = recompute_config(choice)
                if config is not None:
                    apply_recompute(model, config)
                with flop_counter() as counter:
                    hidden = model.model(inputs_embeds=x, position_ids=position_ids).last_hidden_state
                    hidden.float().square().mean().backward()
                flops[choice] = counter.get_total_flops()
            out.append({c: n - flops["none"] for c, n in flops.items() if c != "none"})
        return out
    finally:
        torch.set_num_threads(threads)


def priced(family: str, setup: MoESetup, choice: str) -> float:
    shape = _shape(family)
    return sum(layer_memory(shape, setup, choice, shape.kind_of(i)).rerun.matmul for i in range(shape.layers))


@pytest.mark.filterwarnings("ignore:moe_act. Llama4TextExperts")  # Llama 4's experts keep the product: said once
@pytest.mark.parametrize("family,setup", CASES, ids=[f"{f}-{'-'.join(s)}" for f, s in CASES])
def test_priced_equals_counted_at_tp1(family, setup):
    (flops,) = counted([(family, setup)])
    s = MoESetup(families.S, families.B, 1, *setup)
    assert flops, family
    for choice, n in flops.items():
        assert priced(family, s, choice) == n, (family, setup, choice, priced(family, s, choice), n)
    if "core_attn" in flops:  # eager attention reruns QK^T, not probs @ V; a fused kernel all of it
        assert flops["core_attn"] > 0
    for discarding in ("norm", "mlp_act", "moe_act"):  # output-discarding: elementwise work only
        assert flops.get(discarding, 0) == 0, (family, discarding)


def test_priced_equals_counted_on_every_rank_at_tp2_with_sequence_parallel(world):
    for rank in world(2).run(counted, TP2, 2, True):
        for (family, setup), flops in zip(TP2, rank):
            s = MoESetup(families.S, families.B, 2, *setup, sequence_parallel=True)
            for choice, n in flops.items():
                assert priced(family, s, choice) == n, (family, setup, choice, priced(family, s, choice), n)


def test_what_each_unit_reruns_on_deepseek_v3():
    """The MoE block reruns its routed experts' down projection (the weighting keeps its output) but
    not the shared experts' (its input is kept, and they run last): more than the shared experts;
    the MLA up part (output-discarding) all of its matmuls."""
    s = moe.setup("bf16-sdpa-grouped_mm")
    moe_, shared, up = (priced("deepseek_v3", s, c) for c in ("moe", "shared_experts", "mla_up_proj"))
    assert moe_ > shared > 0 and up > 0
