"""transformers' MoE and MLA layers keep what ``neuron_ckpt.memory.moe`` says, to the byte.

Tiny models built from configs (no downloads): Mixtral (4 experts, top-2), Qwen3-MoE (per-head
q/k norms, renormalised top-k), Qwen2-MoE (a gated shared expert), DeepSeek-V3 (MLA with
kv heads = heads, 2 groups of which 1 is kept, a dense first layer, one shared expert, top-2).
Each decoder layer runs as the model's forward runs it and ``SavedTensorRecorder`` counts the
storages autograd keeps per layer (parameters, rotary tables, position ids and mask left out:
shared by the stack). Counts are exact integers, so the comparison is equality: a tensor
missed, counted twice or of another dtype is at least a few hundred bytes off.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

transformers = pytest.importorskip("transformers")

from neuron_ckpt.memory.moe import CHOICES, MLA, MoESetup, MoEShape, layer_memory, load_moe_config  # noqa: E402
from neuron_ckpt.memory.moe.compare import compare  # noqa: E402
from neuron_ckpt.memory.moe.layer import applies  # noqa: E402
from neuron_ckpt.memory.moe.measure import build_model, measure_layers  # noqa: E402
from neuron_ckpt.recompute import routing  # noqa: E402

S, B = 16, 2  # T = 32 tokens
SHAPES = {
    "mixtral": MoEShape("mixtral", 64, 2, 4, 2, 16, experts=4, top_k=2, moe_ffn=96, vocab=128),
    "qwen3_moe": MoEShape("qwen3_moe", 64, 2, 4, 2, 16, experts=4, top_k=2, moe_ffn=32, vocab=128),
    "qwen2_moe": MoEShape("qwen2_moe", 64, 2, 4, 2, 16, experts=4, top_k=2, moe_ffn=32, vocab=128, shared_ffn=48,
                          norm_topk_prob=False),
    "deepseek_v3": MoEShape("deepseek_v3", 64, 2, 4, 4, 16, experts=4, top_k=2, moe_ffn=32, vocab=128, dense_ffn=80,
                            dense_layers=(0,), shared_ffn=32, n_group=2, topk_group=1, mla=MLA(16, 16, 8, 8, 8)),
}  # fmt: skip
# transformers' defaults (bf16, sdpa, grouped_mm) and the other implementations (fp32, eager, eager)
SETUPS = {"bf16-sdpa-grouped_mm": ("bf16", "sdpa", "grouped_mm"), "fp32-eager-eager": ("fp32", "eager", "eager")}
COMBOS = ("core_attn+norm", "core_attn+mla_up_proj", "norm+moe", "core_attn+norm+moe_act+mla_up_proj+mlp_act",
          "norm+mlp+shared_experts+moe_act")  # fmt: skip


def kinds(shape: MoEShape) -> list[str]:
    return ["dense" if shape.is_dense(i) else "moe" for i in range(shape.layers)]


def choices(shape: MoEShape) -> list[str]:
    """Every single choice and combination that names something this model has (``mlp`` only on
    dense layers, ``mla_up_proj`` only with MLA...: apply_recompute refuses a name no layer has)."""
    have = [c for c in CHOICES if any(applies(shape, k, c) for k in kinds(shape))]
    combos = {"+".join(n for n in c.split("+") if n in have) for c in COMBOS}
    return have + sorted(combos - set(have))


def setup(name: str, tp: int = 1, sequence_parallel: bool = False) -> MoESetup:
    dtype, attention, experts = SETUPS[name]
    return MoESetup(S, B, tp, dtype, attention, experts, sequence_parallel)


CASES = [(f, s, c) for f in SHAPES for s in SETUPS for c in choices(SHAPES[f])]


def analytic(family: str, s: MoESetup, choice: str) -> list[int]:
    shape = SHAPES[family]
    return [layer_memory(shape, s, choice, kind).autograd_bytes for kind in kinds(shape)]


def measure_cases(cases, tp: int = 1, sequence_parallel: bool = False) -> list[list[int]]:
    """Per-layer bytes of each ``(family, setup name, choice)`` on this rank: one model per family
    and setup, each choice applied to it in turn (``compare``: ``apply_recompute`` replaces the
    previous one)."""
    if tp > 1:
        import neuron_ckpt as nc

        nc.initialize_model_parallel(tp)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: two threads on a loaded machine spin 100x longer
    try:
        groups: dict[tuple[str, str], list[str]] = {}
        for family, name, choice in cases:
            groups.setdefault((family, name), []).append(choice)
        per_case = {}
        for (family, name), names in groups.items():
            rows = compare(SHAPES[family], setup(name, tp, sequence_parallel), names)
            for choice in names:
                per_case[(family, name, choice)] = [r.measured for r in rows if r.choice == choice]
        return [per_case[case] for case in cases]
    finally:
        torch.set_num_threads(threads)


_TP1: dict = {}


@pytest.mark.parametrize("family,setup_name,choice", CASES)
def test_measured_equals_analytic_at_tp1(family, setup_name, choice):
    if not _TP1:
        _TP1.update(zip(CASES, measure_cases(CASES)))
    assert _TP1[(family, setup_name, choice)] == analytic(family, setup(setup_name), choice)


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "sequence_parallel"])
def test_measured_equals_analytic_at_tp2_on_every_rank(world, sequence_parallel):
    """The family's own plan at TP 2 (gloo): attention heads and the experts' intermediate size
    split, DeepSeek-V3's MLA and Qwen2's shared expert whole (their plans leave them out). With
    sequence parallel the layer's input, the norms and the residual hold s/t tokens, each region
    gathers the whole sequence back (keeping the norm's s/t-token output) and runs as under TP."""
    ranks = world(2).run(measure_cases, CASES, 2, sequence_parallel)
    for i, (family, name, choice) in enumerate(CASES):
        want = analytic(family, setup(name, 2, sequence_parallel), choice)
        assert [r[i] for r in ranks] == [want, want], (family, name, choice)


@pytest.mark.parametrize("experts", ["grouped_mm", "eager"])
@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3"])
def test_bytes_do_not_depend_on_how_tokens_spread_over_experts(family, experts):
    """Dropless: every token goes to k experts. With the router's weight zeroed every score ties
    and top-k sends all tokens to the same k experts (the others get none: the eager loop skips
    them, grouped_mm's groups are empty); seeded weights spread them. Same bytes either way."""
    s = MoESetup(S, B, 1, "bf16", "sdpa", experts)
    spread = build_model(SHAPES[family], s)
    tied = build_model(SHAPES[family], s)
    with torch.no_grad():
        for layer in tied.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.weight.zero_()
    used = []
    for model in (spread, tied):
        chosen: list = []
        handle = model.model.layers[1].mlp.gate.register_forward_hook(
            lambda m, a, out, chosen=chosen: chosen.append(out[2])
        )
        measured = measure_layers(model, s).per_layer_bytes
        handle.remove()
        used.append(chosen[0].unique().numel())
        assert measured == analytic(family, s, "none")
    assert used[0] == 4 and used[1] == 2  # all experts, then only two


@pytest.mark.parametrize("choice", ["moe", "full"])
@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3"])
def test_routing_replay_holds_its_indices_outside_autograd(family, choice, monkeypatch):
    """``moe`` and full recompute of an MoE layer replay the forward's routing: the int64 indices
    of each top-k call (DeepSeek: three) are held outside autograd until the block's backward,
    which the recorder cannot see; the analytic ``outside`` terms are exactly them."""
    replays = []
    original = routing.RoutingReplay.__init__

    def init(self):
        original(self)
        replays.append(self)

    monkeypatch.setattr(routing.RoutingReplay, "__init__", init)
    s = setup("bf16-sdpa-grouped_mm")
    measure_layers(build_model(SHAPES[family], s, choice), s, backward=False)
    held = [sum(t.numel() * t.element_size() for t in r.recorded) for r in replays]
    want = layer_memory(SHAPES[family], s, choice, "moe")
    moe_layers = kinds(SHAPES[family]).count("moe")  # a dense layer routes nothing: no replay
    assert (
        held == [want.nbytes - want.autograd_bytes] * moe_layers == [sum(t.nbytes for t in want.outside)] * moe_layers
    )
    assert len(replays[0].recorded) == len(want.outside) == (3 if family == "deepseek_v3" else 1)


@pytest.mark.parametrize("choice", ["none", "core_attn", "mla_up_proj", "core_attn+mla_up_proj"])
def test_mla_with_equal_head_sizes_runs_the_fused_kernel_sdpa_fused_prices(choice):
    """With qk_nope + qk_rope = v_head_dim torch's CPU sdpa runs the flash kernel on MLA (q, k,
    v's root, its output, an fp32 logsumexp): what ``sdpa-fused`` prices for any head sizes,
    as CUDA's memory-efficient kernel keeps the same for DeepSeek's unequal ones."""
    shape = replace(SHAPES["deepseek_v3"], mla=MLA(16, 16, 8, 8, 16))
    s = MoESetup(S, B, 1, "bf16", "sdpa")
    measured = measure_layers(build_model(shape, s, choice), s).per_layer_bytes
    for attention in ("sdpa", "sdpa-fused"):
        fused = replace(s, attention=attention)
        assert measured == [layer_memory(shape, fused, choice, kind).autograd_bytes for kind in kinds(shape)]
    assert "logsumexp_fp32" in _terms(shape, s) and "probs_fp32" not in _terms(shape, s)


def _terms(shape: MoEShape, s: MoESetup, choice: str = "none", kind: str = "moe") -> dict[str, int]:
    return {t.name: t.nbytes for t in layer_memory(shape, s, choice, kind).terms}


def test_the_routed_experts_cost_a_fixed_amount_per_routed_row():
    """grouped_mm keeps, per routed row (S = T k): three int64 indices, the gathered row (h), the
    gate/up output (2F), silu(gate) and the product (F each), the down output (h) and a routing
    weight (fp32 for Mixtral), plus int32 offsets per expert; the eager loop two int64 indices,
    the same F terms, the row three times (gathered, down output, weighted) and the weight."""
    shape, w = SHAPES["mixtral"], 2
    T, h, F, E, k = S * B, shape.hidden, shape.moe_ffn, shape.experts, shape.top_k

    def experts(terms):
        return sum(v for n, v in terms.items() if n.split(".")[0] in ("dispatch", "grouped_mm", "experts", "combine"))

    grouped = experts(_terms(shape, MoESetup(S, B, experts="grouped_mm")))
    eager = experts(_terms(shape, MoESetup(S, B, experts="eager")))
    assert grouped == T * k * (3 * 8 + w * (2 * h + 4 * F) + 4) + 4 * E
    assert eager == T * k * (2 * 8 + w * (3 * h + 4 * F) + 4)
    act = _terms(shape, MoESetup(S, B), "none").keys() - _terms(shape, MoESetup(S, B), "moe_act").keys()
    assert act == {"experts.act", "experts.product"}  # _apply_gate's act(gate) and its product
    loop = MoESetup(S, B, experts="eager")  # its SwiGLU run through _apply_gate under moe_act: the same two
    assert _terms(shape, loop).keys() - _terms(shape, loop, "moe_act").keys() == {"experts.act", "experts.product"}


def test_real_models_at_4096_tokens():
    """Mixtral 8x7B and DeepSeek-V3 (the presets: their public config.json), s 4096, b 1, bf16."""
    mixtral, deepseek = load_moe_config("mixtral-8x7b"), load_moe_config("deepseek-v3")
    T, MiB = 4096, 1 << 20
    for t in (1, 8):
        s = MoESetup(T, 1, t)
        none = layer_memory(mixtral, s, "none").nbytes
        # moe_act: act(gate) and the product, 2 F/t per routed row, k = 2 rows per token
        assert none - layer_memory(mixtral, s, "moe_act").nbytes == 2 * T * 2 * 14336 // t * 2
        assert layer_memory(mixtral, s, "full").nbytes == 2 * T * 4096 + 8 * T * 2  # input + replayed indices
        ds = MoESetup(T, 1, t)
        # MLA is replicated (DeepSeek-V3's plan has no attention entry): core attention's fp32
        # [a, s, s] probabilities (the CPU math path) are the same at TP 1 and 8
        assert _terms(deepseek, ds)["probs_fp32"] == 4 * 128 * T * T == 8192 * MiB
        assert _terms(deepseek, ds, kind="dense")["mlp.product"] == 2 * T * 18432 // t
        fused = _terms(deepseek, replace(ds, attention="sdpa-fused"))  # CUDA's memory-efficient kernel
        assert "probs_fp32" not in fused and fused["logsumexp_fp32"] == 4 * 128 * T
    assert (
        layer_memory(deepseek, MoESetup(T, 1, 8), "none", "dense").nbytes
        < layer_memory(deepseek, MoESetup(T, 1, 1), "none", "dense").nbytes
    )


@pytest.mark.parametrize("choice,kept", [
    ("none", {"norm1.out", "norm2.out"}),  # each region's entry keeps its norm's s/t tokens
    ("norm", set()),  # the norm's output discarded: the entry's kept input is a note
    ("moe", {"norm1.out", "norm2.out"}),  # the MoE checkpoint's input is the gathered copy: a note
    ("full", set()),  # the entries are inside the layer's checkpoint
])  # fmt: skip
def test_under_sequence_parallel_a_region_keeps_the_norm_output_chunk_never_the_gathered_copy(choice, kept):
    sp = MoESetup(S, B, 2, sequence_parallel=True)
    terms = _terms(SHAPES["mixtral"], sp, choice)
    assert {n for n in terms if n.endswith(".out") and n.startswith("norm")} == kept
    assert not any(n.endswith("gathered_input") for n in terms)
    assert all(terms[n] == 2 * S * B // 2 * 64 for n in kept)  # bf16 [b, s/t, h]
    assert terms.get("layer_input", 0) == (2 * S * B // 2 * 64 if choice in ("norm", "full") else 0)


@pytest.mark.parametrize("bad,match", [
    (dict(kind="shared"), "got 'shared'"),
    (dict(recompute="moe+full"), "'full' alone"),
    (dict(recompute="layernorm"), "is not one of"),
])  # fmt: skip
def test_bad_choices_are_one_line_value_errors(bad, match):
    args = dict(recompute="none", kind="moe") | bad
    with pytest.raises(ValueError, match=match):
        layer_memory(SHAPES["mixtral"], MoESetup(S, B), args["recompute"], args["kind"])
    with pytest.raises(ValueError, match=r"kinds \['moe'\], got 'dense'"):
        layer_memory(SHAPES["mixtral"], MoESetup(S, B), "none", "dense")
    with pytest.raises(ValueError, match="must divide kv_heads"):
        layer_memory(SHAPES["mixtral"], MoESetup(S, B, tp=4), "none")
    with pytest.raises(ValueError, match="sequence_parallel must be a bool"):
        MoESetup(S, B, 2, sequence_parallel="yes")
    with pytest.raises(ValueError, match=r"seq_len \(15\) must be a multiple of tp \(2\) when sequence_parallel"):
        MoESetup(15, B, 2, sequence_parallel=True)
