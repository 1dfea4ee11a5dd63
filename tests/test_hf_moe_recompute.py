"""Megatron's recompute modules for mixture-of-experts and latent attention (issue #35) on tiny
transformers models built from configs (no downloads): ``moe``, ``moe_act``, ``shared_experts``,
``mla_up_proj``.

* Each is bit-exact against the same model without recompute: loss, router aux loss, every
  gradient, with attention dropout and Mixtral's router jitter (both replayed), on transformers'
  eager per-expert loop and on grouped_mm, in both checkpoint variants. One exception, kept
  equal to rounding: ``shared_experts`` in the reentrant variant on Qwen2-MoE, whose shared
  expert reads the block input twice and the block reads it three times more; the reentrant
  checkpoint returns the two inner gradients as one sum (docs/recompute.md, the reentrant
  ``norm`` case).
* Routing is never redone differently: with DeepSeek's ``e_score_correction_bias`` changed
  between forward and backward, ``moe`` (and full recompute) still give the gradients of no
  recompute; without the replay they differ.
* The aux loss counts each layer once and keeps its gradient in the reentrant variant, where
  the block's forward runs without grad (``moe`` and full recompute of a layer holding one).
* What each drops, to the byte (``SavedTensorRecorder``), and the one-line errors.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

transformers = pytest.importorskip("transformers")

from neuron_ckpt.memory import SavedTensorRecorder  # noqa: E402
from neuron_ckpt.recompute import Recompute, RecomputeConfig, apply_recompute, remove_recompute, unwrapped  # noqa: E402
from neuron_ckpt.recompute import moe as moe_recompute  # noqa: E402

H, F, S_F, T, K = 32, 16, 24, 24, 2  # hidden, expert ffn, Qwen2 shared-expert ffn, tokens (2 x 12), top-k
MLA = dict(num_key_value_heads=4, n_routed_experts=4, n_group=2, topk_group=1, first_k_dense_replace=1, q_lora_rank=16,
           kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, n_shared_experts=1,
           intermediate_size=48)  # fmt: skip
FAMILIES = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(num_key_value_heads=2, intermediate_size=F, num_local_experts=4, router_jitter_noise=0.1)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(num_key_value_heads=2, moe_intermediate_size=F, num_experts=4, head_dim=8)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(num_key_value_heads=2, moe_intermediate_size=F, shared_expert_intermediate_size=S_F,
                       num_experts=4)),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(moe_intermediate_size=F, **MLA)),
}  # fmt: skip
MODULES = {  # which of the four each family has
    "mixtral": ("moe", "moe_act"), "qwen3_moe": ("moe", "moe_act"),
    "qwen2_moe": ("moe", "moe_act", "shared_experts"),
    "deepseek_v3": ("moe", "moe_act", "shared_experts", "mla_up_proj"),
}  # fmt: skip
EXPERTS = ("eager", "grouped_mm")


def tiny(family: str, experts: str = "grouped_mm", attn: str = "eager", dtype=torch.float32, **extra):
    config_cls, model_cls, own = FAMILIES[family]
    config = getattr(transformers, config_cls)(
        vocab_size=64, hidden_size=H, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64,
        num_experts_per_tok=K, attention_dropout=0.1, use_cache=False, output_router_logits=True, **{**own, **extra},
    )  # fmt: skip
    config._attn_implementation = attn
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config).to(dtype).train()
    model.set_experts_implementation(experts)
    return model


def _ids() -> torch.Tensor:
    return torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))


def step(model, between=None, backwards: int = 1):
    """Loss, aux loss, router logits recorded and every gradient of one step (dropout and jitter
    drawn from seed 2). ``between(model)`` runs between forward and backward."""
    torch.manual_seed(2)
    out = model(input_ids=_ids(), labels=_ids())
    if between is not None:
        between(model)
    for i in range(backwards):
        model.zero_grad(set_to_none=True)
        out.loss.backward(retain_graph=i + 1 < backwards)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    aux = out.aux_loss.detach() if getattr(out, "aux_loss", None) is not None else None
    return out.loss.detach(), aux, len(out.router_logits), grads


def assert_equal(got, reference, exact: bool = True):
    assert torch.equal(got[0], reference[0]), (got[0], reference[0])
    assert (got[1] is None) == (reference[1] is None) and (got[1] is None or torch.equal(got[1], reference[1]))
    assert got[2] == reference[2], "router logits recorded"
    assert got[3].keys() == reference[3].keys()
    for name, g in got[3].items():
        if exact:
            assert torch.equal(g, reference[3][name]), name
        else:
            torch.testing.assert_close(g, reference[3][name], rtol=1e-6, atol=1e-7, msg=name)


_REFERENCE: dict = {}


def reference(family: str, experts: str, **kw):
    key = (family, experts, tuple(sorted(kw.items())))
    if key not in _REFERENCE:
        _REFERENCE[key] = step(tiny(family, experts, **kw))
    return _REFERENCE[key]


def selective(*modules: str, reentrant: bool | None = None) -> RecomputeConfig:
    return RecomputeConfig(granularity="selective", modules=list(modules), use_reentrant=reentrant)


CASES = [(f, m, e) for f in FAMILIES for m in MODULES[f] for e in EXPERTS]


@pytest.mark.parametrize("reentrant", [None, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("family,module,experts", CASES)
def test_each_module_is_bit_exact_with_dropout_and_jitter(family, module, experts, reentrant):
    model = tiny(family, experts)
    names = apply_recompute(model, selective(module, reentrant=reentrant))
    moe_layers = [1] if family == "deepseek_v3" else [0, 1]  # DeepSeek's first layer is dense: skipped
    where = {"moe": "mlp", "moe_act": "mlp.experts", "mla_up_proj": "self_attn",
             "shared_experts": "mlp.shared_expert" + "s" * (family != "qwen2_moe")}[module]  # fmt: skip
    assert names == [f"{i}.{where}" for i in ([0, 1] if module == "mla_up_proj" else moe_layers)]
    exact = not (family == "qwen2_moe" and module == "shared_experts" and reentrant)
    assert_equal(step(model), reference(family, experts), exact)


@pytest.mark.parametrize("reentrant", [None, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("family,modules", [
    ("mixtral", ("core_attn", "moe", "norm")),  # norm's output is written in place by the jitter
    ("mixtral", ("core_attn", "moe_act", "norm")),
    ("deepseek_v3", ("core_attn", "mla_up_proj", "norm", "moe_act", "shared_experts", "mlp", "mlp_act")),
    ("deepseek_v3", ("core_attn", "mla_up_proj", "norm", "moe")),
])  # fmt: skip
def test_modules_compose_with_core_attn_and_norm_in_bf16(family, modules, reentrant):
    """bf16: the output-discarding norm's fp32 rounding caveat (docs/recompute.md) does not apply."""
    reference = step(tiny(family, dtype=torch.bfloat16))
    model = tiny(family, dtype=torch.bfloat16)
    apply_recompute(model, selective(*modules, reentrant=reentrant))
    assert_equal(step(model), reference)


def _shift_bias(model) -> None:
    """DeepSeek's selection-only bias moved between forward and backward: a rerun that routed
    again would send every token to experts 0 and 1."""
    with torch.no_grad():
        model.model.layers[1].mlp.gate.e_score_correction_bias.copy_(torch.tensor([10.0, 10.0, 0.0, 0.0]))


@pytest.mark.parametrize(
    "config",
    [selective("moe"), selective("moe", reentrant=True), RecomputeConfig.preset("full")],
    ids=["moe", "moe-reentrant", "full"],
)
@pytest.mark.parametrize("experts", EXPERTS)
def test_rerun_replays_the_forward_routing(experts, config, monkeypatch):
    reference = step(tiny("deepseek_v3", experts), between=_shift_bias)
    model = tiny("deepseek_v3", experts)
    apply_recompute(model, config)
    assert_equal(step(model, between=_shift_bias), reference)

    # Without the replay the rerun routes again: other gradients (or, in torch's non-reentrant
    # checkpoint, a refusal when the rerun saves other tensors than the forward did).
    monkeypatch.setattr(moe_recompute, "RoutingReplay", contextlib.nullcontext)
    model = tiny("deepseek_v3", experts)
    apply_recompute(model, config)
    try:
        got = step(model, between=_shift_bias)
    except torch.utils.checkpoint.CheckpointError:
        return
    assert any(not torch.equal(got[3][n], reference[3][n]) for n in reference[3])


@pytest.mark.parametrize("reentrant", [None, True], ids=["non-reentrant", "reentrant"])
def test_two_retain_graph_backwards_replay_routing_and_jitter_each_time(reentrant):
    shifted = step(tiny("deepseek_v3"), between=_shift_bias)
    model = tiny("deepseek_v3")
    apply_recompute(model, selective("moe", "moe_act", reentrant=reentrant))
    assert_equal(step(model, between=_shift_bias, backwards=2), shifted)
    model = tiny("mixtral")
    apply_recompute(model, selective("moe", reentrant=reentrant))
    assert_equal(step(model, backwards=2), reference("mixtral", "grouped_mm"))


@pytest.mark.parametrize(
    "config",
    [selective("moe", reentrant=True), RecomputeConfig("full", "uniform", 1, use_reentrant=True)],
    ids=["moe", "full"],
)
def test_aux_loss_counts_each_layer_once_and_trains_the_router_in_the_reentrant_variant(config, monkeypatch):
    model = tiny("mixtral")
    apply_recompute(model, config)
    calls = []
    for layer in model.model.layers:
        unwrapped(unwrapped(layer).mlp).gate.register_forward_hook(lambda *_: calls.append(1))
    got = step(model)
    assert len(calls) == 4  # each router ran in the forward and once more in the rerun
    assert_equal(got, reference("mixtral", "grouped_mm"))  # 2 router logits, the same aux loss and gradients

    # Why the router's outputs leave the checkpoint: recorded inside a forward without grad, the
    # aux loss would not reach the router (nor anything before it).
    monkeypatch.setattr(moe_recompute, "_capture", lambda *_: None)
    model = tiny("mixtral")
    apply_recompute(model, config)
    got = step(model)
    assert torch.equal(got[1], reference("mixtral", "grouped_mm")[1])
    assert not torch.equal(
        got[3]["model.layers.0.mlp.gate.weight"],
        reference("mixtral", "grouped_mm")[3]["model.layers.0.mlp.gate.weight"],
    )


def _kept(model, layer: int) -> int:
    """Bytes autograd keeps for one layer's forward (parameters left out)."""
    torch.manual_seed(2)
    with SavedTensorRecorder(exclude_modules=[model]) as rec:
        handles = rec.attach({"layer": unwrapped(model.model.layers[layer])})
        out = model(input_ids=_ids(), labels=_ids())  # noqa: F841  (holds the graph until the count)
    for handle in handles:
        handle.remove()
    return rec.bytes_by_scope()["layer"]


def _block_bytes(model, layer: int) -> int:
    """Bytes the MoE block of ``layer`` keeps without recompute, its input (kept by the checkpoint) left out."""
    torch.manual_seed(2)
    block = model.model.layers[layer].mlp
    with SavedTensorRecorder(exclude_modules=[model]) as rec:
        handles = rec.attach({"block": block})
        out = model(input_ids=_ids(), labels=_ids())  # noqa: F841  (holds the graph until the count)
    for handle in handles:
        handle.remove()
    return rec.bytes_by_scope()["block"] - T * H * 4


@pytest.mark.parametrize("family,module,experts,attn", [
    ("mixtral", "moe_act", "grouped_mm", "eager"), ("mixtral", "moe_act", "eager", "eager"),
    ("deepseek_v3", "moe_act", "grouped_mm", "eager"), ("deepseek_v3", "moe_act", "eager", "eager"),
    ("deepseek_v3", "shared_experts", "grouped_mm", "eager"), ("qwen2_moe", "shared_experts", "grouped_mm", "eager"),
    ("mixtral", "moe", "grouped_mm", "eager"), ("deepseek_v3", "moe", "eager", "eager"),
    ("deepseek_v3", "mla_up_proj", "grouped_mm", "eager"), ("deepseek_v3", "mla_up_proj", "grouped_mm", "sdpa"),
])  # fmt: skip
def test_what_each_module_drops_to_the_byte(family, module, experts, attn):
    """fp32, T = 24 tokens, k = 2 (S = 48 routed rows), h = 32, expert ffn F = 16.

    * ``moe_act``: ``act(gate)`` and the product the down projection keeps (2 F per routed row),
      on grouped_mm and on the eager loop alike (run through ``_apply_gate``, .experts_loop).
    * ``shared_experts``: the shared MLP's gate, up, activation and product (4 T F_shared; its
      output is kept by what follows either way).
    * ``moe``: everything the block keeps but its input, which the checkpoint keeps.
    * ``mla_up_proj`` alone: what the attention keeps of q/k/v, less the copy of the rope part
      it keeps (T x qk_rope_head_dim): eager keeps q and k (its matmul copies the strided v);
      torch's CPU sdpa math path keeps scaled copies, so nothing (the copy is a net cost there);
      with ``core_attn`` (its checkpoint saves q/k/v as notes): q, k and v's root.
    """
    layer = 1
    ROPE_COPY = T * 8 * 4
    model = tiny(family, experts, attn=attn)
    base = _kept(model, layer)
    expected = {
        ("moe_act", "grouped_mm"): T * K * 2 * F * 4, ("moe_act", "eager"): T * K * 2 * F * 4,
        ("shared_experts", "deepseek_v3"): 4 * T * F * 4, ("shared_experts", "qwen2_moe"): 4 * T * S_F * 4,
        ("mla_up_proj", "eager"): 2 * (2 * 4 * 12 * 16 * 4) - ROPE_COPY, ("mla_up_proj", "sdpa"): -ROPE_COPY,
    }  # fmt: skip
    want = (
        _block_bytes(model, layer)
        if module == "moe"
        else expected.get((module, experts)) or expected.get((module, family)) or expected[(module, attn)]
    )
    apply_recompute(model, selective(module))
    dropped = base - _kept(model, layer)
    assert dropped == want
    assert dropped > 0 or (module, attn) == ("mla_up_proj", "sdpa")
    if module == "mla_up_proj":  # with core_attn: q, k and v's root (kv_b_proj's output) become notes
        remove_recompute(model)
        apply_recompute(model, selective("core_attn"))
        attn_only = _kept(model, layer)
        apply_recompute(model, selective("core_attn", "mla_up_proj"))
        assert attn_only - _kept(model, layer) == 2 * (2 * 4 * 12 * 16 * 4) + 2 * 12 * 4 * (8 + 8) * 4 - ROPE_COPY


@pytest.mark.parametrize(
    "extra", [{}, {"q_lora_rank": None}, {"rope_interleave": False}], ids=["q-latent", "no-q-latent", "rope-halves"]
)
def test_mla_forward_is_transformers_forward_op_for_op(extra):
    """Bit-identical logits in evaluation (no grad: the up part runs plainly) and loss and
    gradients in training."""
    plain, ours = tiny("deepseek_v3", **extra), tiny("deepseek_v3", **extra)
    assert apply_recompute(ours, selective("mla_up_proj")) == ["0.self_attn", "1.self_attn"]
    attn = ours.model.layers[0].self_attn
    assert (
        "forward" in attn.__dict__
        and type(attn) is transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3Attention
    )
    with torch.no_grad():
        plain.eval(), ours.eval()
        assert torch.equal(ours(input_ids=_ids()).logits, plain(input_ids=_ids()).logits)
    plain.train(), ours.train()
    assert_equal(step(ours), step(plain))
    remove_recompute(ours)
    assert "forward" not in attn.__dict__


def test_remove_recompute_restores_the_experts():
    model = tiny("deepseek_v3")
    apply_recompute(model, selective("moe_act", "shared_experts"))
    experts = model.model.layers[1].mlp.experts
    assert "_apply_gate" in experts.__dict__ and isinstance(experts.act_fn, Recompute)
    remove_recompute(model)
    assert "_apply_gate" not in experts.__dict__ and not any(isinstance(m, Recompute) for m in model.modules())
    assert_equal(step(model), reference("deepseek_v3", "grouped_mm"))


def test_names_apply_where_layers_have_them():
    model = tiny("deepseek_v3")  # layer 0 dense, layer 1 MoE
    assert apply_recompute(model, selective("moe")) == ["1.mlp"]
    assert apply_recompute(model, selective("mlp", "mlp_act")) == ["0.mlp"]  # the dense MLP only
    assert apply_recompute(model, selective("mlp_act")) == ["0.mlp.act_fn"]  # not the experts' nor the shared experts'
    assert apply_recompute(model, [None, selective("moe")]) == ["1.mlp"]
    with pytest.raises(ValueError, match=r"^modules: 'moe' matched no submodule of any layer of DeepseekV3ForCausalLM"):
        apply_recompute(model, [selective("moe"), None])  # asked only where there is none


def test_names_no_layer_has_are_one_line_errors_before_anything_changes():
    import neuron_ckpt as nc
    from neuron_ckpt.models import LlamaForCausalLM
    from neuron_ckpt.models.llama_args import LlamaArgs

    with pytest.raises(
        ValueError,
        match=r"^modules: unknown module 'moes'; known modules: \[.*'moe', 'moe_act', "
        r"'shared_experts', 'mla_up_proj'\]$",
    ):
        selective("moes")
    cases = [
        (transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=64, hidden_size=H, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)), "moe"),
        (LlamaForCausalLM(LlamaArgs(vocab_size=64, hidden_size=H, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4), parallel_state=nc.initialize_model_parallel(1)), "moe"),
        (tiny("mixtral"), "mla_up_proj"),
        (tiny("mixtral"), "mlp"),  # every layer is MoE: mlp means the dense MLP
        (tiny("mixtral"), "shared_experts"),
    ]  # fmt: skip
    for model, name in cases:
        before = [type(m) for m in model.modules()]
        with pytest.raises(
            ValueError,
            match=rf"^modules: '{name}' matched no submodule of any layer of "
            rf"{type(model).__name__} .*\(.*\); pass module_map",
        ) as error:
            apply_recompute(model, selective(name))
        assert "\n" not in str(error.value)
        assert [type(m) for m in model.modules()] == before
    nc.destroy_model_parallel()


def test_an_attention_class_mla_up_proj_does_not_mirror_is_refused():
    model = tiny("deepseek_v3")
    cls = type(model.model.layers[0].self_attn)
    model.model.layers[0].self_attn.__class__ = type("MyAttention", (cls,), {"forward": cls.forward.__wrapped__})
    with pytest.raises(
        ValueError,
        match=r"^modules: 'mla_up_proj' matched 'self_attn' in layer 0 \(MyAttention\), "
        r"which is not supported: only \['DeepseekV3Attention'\]",
    ):
        apply_recompute(model, selective("mla_up_proj"))
    assert "forward" not in model.model.layers[1].self_attn.__dict__


# --- TP 2 (gloo): the experts split by the model's own plan, recompute against none ---------------


def _tp2_recompute(
    family: str, experts: str, modules: tuple[str, ...], reentrant: bool | None, distribute: bool = False
) -> list[str]:
    """At TP 2 each rank's loss, aux loss and local gradients with ``modules`` recomputed equal
    (bit for bit) those of the same split model without recompute; returns what differs.
    ``distribute``: keep half of the (replicated) input of each ``moe`` checkpoint per rank."""
    import neuron_ckpt as nc

    nc.initialize_model_parallel(2)
    results = []
    recompute = RecomputeConfig(
        "selective", modules=modules, use_reentrant=reentrant, distribute_saved_activations=distribute
    )
    for config in (None, recompute):
        nc.model_parallel_manual_seed(1234)
        model = nc.apply_tensor_parallel(tiny(family, experts))
        if config is not None:
            apply_recompute(model, config)
        nc.model_parallel_manual_seed(7)  # attention dropout (tracker stream) and jitter (default generator)
        results.append(step(model))
    got, want = results
    bad = [
        k
        for k, a, b in (("loss", got[0], want[0]), ("aux", got[1], want[1]))
        if not (a is None and b is None or torch.equal(a, b))
    ]
    return bad + [n for n in want[3] if not torch.equal(got[3][n], want[3][n])]


TP_CASES = [  # (family, experts implementation, modules, use_reentrant)
    ("mixtral", "grouped_mm", ("moe",), None), ("mixtral", "grouped_mm", ("moe",), True),
    ("mixtral", "eager", ("moe_act",), None), ("mixtral", "grouped_mm", ("moe_act",), True),
    ("qwen2_moe", "grouped_mm", ("shared_experts",), None),  # reentrant: equal to rounding (module docstring)
    ("deepseek_v3", "grouped_mm", ("shared_experts", "moe_act"), None),
    ("deepseek_v3", "grouped_mm", ("shared_experts", "moe_act"), True),
    ("deepseek_v3", "grouped_mm", ("mla_up_proj", "core_attn"), None),
    ("deepseek_v3", "eager", ("moe", "mla_up_proj"), True),
    ("mixtral", "grouped_mm", ("moe",), "distributed"),
]  # fmt: skip


@pytest.mark.parametrize("family,experts,modules,reentrant", TP_CASES)
def test_tp2_recompute_is_bit_exact(world, family, experts, modules, reentrant):
    distribute = reentrant == "distributed"
    reentrant = True if distribute else reentrant
    for differs in world(2).run(_tp2_recompute, family, experts, modules, reentrant, distribute):
        assert differs == []
