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
case, each choice applied to it in turn. Under expert parallelism (EP 2, both dispatch forms) on
each rank, at the rows its experts received. The counts are exact integers, and so is the comparison.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

transformers = pytest.importorskip("transformers")

from neuron_ckpt.memory.flop_count import flop_counter  # noqa: E402
from neuron_ckpt.memory.moe import MoESetup, layer_memory  # noqa: E402
from neuron_ckpt.memory.moe.measure import build_model, layer_inputs, received_rows, recompute_config  # noqa: E402
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


def counted(cases, tp: int = 1, sequence_parallel: bool = False, **ep) -> list[tuple[dict[str, int], list]]:
    """Per case, each choice's extra FLOPs over none in one training step of the layers, on this
    rank (at TP > 1 the single modules: their sums are checked at TP 1; under EP those of
    :data:`EP_CHOICES`), and the rows each layer's experts received under expert parallelism
    (``ep``: ``MoESetup``'s ``ep``, ``ep_dispatch``, ``capacity_factor``)."""
    if tp > 1 or ep:
        import neuron_ckpt as nc

        nc.initialize_model_parallel(tp, expert_model_parallel_size=ep.get("ep", 1))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: two threads on a loaded machine spin 100x longer
    try:
        out = []
        for family, setup in cases:
            s = MoESetup(families.S, families.B, tp, *setup, sequence_parallel=sequence_parallel, **ep)
            model = build_model(_shape(family), s, "none")
            x, position_ids = layer_inputs(model, s)
            flops, received = {}, []
            names = _choices(family, combinations=tp == 1 and not ep)
            for choice in ["none", *(c for c in names if not ep or c in EP_CHOICES)]:
                remove_recompute(model)
                config = recompute_config(choice)
                if config is not None:
                    apply_recompute(model, config)
                with flop_counter() as counter:
                    hidden = model.model(inputs_embeds=x, position_ids=position_ids).last_hidden_state
                    hidden.float().square().mean().backward()
                flops[choice] = counter.get_total_flops()
                received = received or received_rows(model)  # the same routing under every choice
            out.append(({c: n - flops["none"] for c, n in flops.items() if c != "none"}, received))
        return out
    finally:
        torch.set_num_threads(threads)


def priced(family: str, setup: MoESetup, choice: str, received: list | None = None) -> float:
    """The priced rerun matmul FLOPs of the layers; under the all-to-all at the rows each layer's
    experts ``received`` on this rank (routing's choice; the all-gather form's are its slots)."""
    shape = _shape(family)
    total = 0.0
    for i in range(shape.layers):
        s = setup
        if received and received[i] is not None and setup.ep_dispatch == "all_to_all":
            s = replace(setup, ep_rows=received[i])
        total += layer_memory(shape, s, choice, shape.kind_of(i)).rerun.matmul
    return total


@pytest.mark.filterwarnings("ignore:moe_act. Llama4TextExperts")  # Llama 4's experts keep the product: said once
@pytest.mark.parametrize("family,setup", CASES, ids=[f"{f}-{'-'.join(s)}" for f, s in CASES])
def test_priced_equals_counted_at_tp1(family, setup):
    ((flops, _),) = counted([(family, setup)])
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
        for (family, setup), (flops, _) in zip(TP2, rank):
            s = MoESetup(families.S, families.B, 2, *setup, sequence_parallel=True)
            for choice, n in flops.items():
                assert priced(family, s, choice) == n, (family, setup, choice, priced(family, s, choice), n)


# Expert parallelism at EP 2 (2 gloo ranks; at TP 2 the EP group is the TP group): the routers,
# Qwen2's shared expert and gate, DeepSeek-V3's dense layer and shared experts, grouped_mm and the
# eager loop; each form at TP 1 and at TP 2 + SP, the all-gather form dropless and at a capacity
EP = [
    ("mixtral", moe.SETUPS["bf16-sdpa-grouped_mm"]),
    ("qwen2_moe", moe.SETUPS["fp32-eager-eager"]),
    ("deepseek_v3", moe.SETUPS["bf16-sdpa-grouped_mm"]),
]
EP_CHOICES = ("moe", "moe_act", "shared_experts", "full")  # what holds the experts (the rest EP does not change)
EP_RUNS = [(1, False, "all_to_all", None), (2, True, "all_to_all", None), (1, False, "all_gather", None),
           (2, True, "all_gather", 1.0)]  # fmt: skip


@pytest.mark.parametrize("tp,sp,form,cf", EP_RUNS, ids=["a2a", "a2a-tp2-sp", "ag", "ag-tp2-sp-cf1"])
def test_priced_equals_counted_on_every_rank_under_expert_parallelism(world, tp, sp, form, cf):
    """Each rank's experts run the rows they received (the all-to-all: routing's choice, so the
    ranks' counts differ; the all-gather: ``E/e x capacity`` slots): what each choice reruns on
    each rank, priced at those rows, is what ``FlopCounterMode`` counts there."""
    ep = {"ep": 2, "ep_dispatch": form, "capacity_factor": cf}
    ranks = world(2).run(counted, EP, tp, sp, **ep)
    for rank in ranks:
        for (family, setup), (flops, received) in zip(EP, rank):
            s = MoESetup(families.S, families.B, tp, *setup, sequence_parallel=sp, **ep)
            assert {"moe", "moe_act", "full"} <= set(flops), family
            for choice, n in flops.items():
                assert priced(family, s, choice, received) == n, (
                    family,
                    choice,
                    priced(family, s, choice, received),
                    n,
                )
    if form == "all_to_all":  # routing spread the rows unevenly: the ranks reran different FLOPs
        assert [r[0][0]["moe"] for r in ranks][0] != [r[0][0]["moe"] for r in ranks][1]


def test_what_each_unit_reruns_on_deepseek_v3():
    """The MoE block reruns its routed experts' down projection (the weighting keeps its output) but
    not the shared experts' (its input is kept, and they run last): more than the shared experts;
    the MLA up part (output-discarding) all of its matmuls."""
    s = moe.setup("bf16-sdpa-grouped_mm")
    moe_, shared, up = (priced("deepseek_v3", s, c) for c in ("moe", "shared_experts", "mla_up_proj"))
    assert moe_ > shared > 0 and up > 0
