"""Tensor parallel on transformers mixture-of-experts models from their own plan (issue #35): at
TP 2 on gloo each family equals the dense model it was split from (loss, router aux loss, logits,
every gradient gathered by the plan) under the experts implementations transformers offers; the
router stays whole and its gradient is the dense one; bad plans fail before anything changes;
ZeRO-1's gradient norm counts the expert slices once.

Tolerances as in ``test_hf_tensor_parallel.py``: the split model sums the same products in
another order (each rank's experts see half the intermediate features; the two partial sums are
added), so fp32 results differ by rounding only, ~1e-7 relative per op. The bound 1e-5 is far
below any real error: a wrong slice, a gate paired with another feature's up, a missing or
doubled reduction, or a token routed to another expert is O(1). Routing is the same on both
sides because the router sees the same hidden state up to rounding, and no two router scores
of these seeded models are that close.
"""

import pytest
import torch

transformers = pytest.importorskip("transformers")

import neuron_ckpt as nc  # noqa: E402
from neuron_ckpt.distributed import collectives as C  # noqa: E402
from neuron_ckpt.parallel.params import is_tensor_parallel  # noqa: E402

from .helpers import rel_max  # noqa: E402

TOL = 1e-5
VOCAB = 64
MLA = dict(num_key_value_heads=4, n_shared_experts=1, n_group=2, topk_group=1, first_k_dense_replace=1, q_lora_rank=16,
           kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8)  # fmt: skip
FAMILIES = {  # 4 experts, top 2 (the defaults of several exceed 4), intermediate sizes even
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(intermediate_size=16, num_local_experts=4)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(moe_intermediate_size=16, num_experts=4, head_dim=8)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",  # shared expert and its sigmoid gate: replicated by the plan
                  dict(moe_intermediate_size=16, shared_expert_intermediate_size=32, num_experts=4)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(intermediate_size=16, num_experts=4, eos_token_id=2)),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    dict(moe_intermediate_size=16, n_routed_experts=4, **MLA)),
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM",
                    dict(moe_intermediate_size=16, n_routed_experts=4, **MLA)),
    # transposed expert weights [E, h, 2i] / [E, i, h]: packed_rowwise gate_up, colwise down
    "aria": ("AriaTextConfig", "AriaTextForCausalLM", dict(intermediate_size=16, moe_num_experts=4, moe_topk=2)),
    "llama4": ("Llama4TextConfig", "Llama4ForCausalLM",  # its own experts forward (batched bmm, no top_k_weights)
               dict(intermediate_size=16, intermediate_size_mlp=32, num_local_experts=4, head_dim=8)),
    # its plan splits only the embedding and the LM head: experts (biases, interleaved gate/up) stay whole
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(intermediate_size=16, num_local_experts=4, head_dim=8,
                                                          sliding_window=16)),
}  # fmt: skip
NO_AUX = ("deepseek_v3", "deepseek_v2", "aria", "llama4")  # no load-balancing loss: router logits only
CASES = [
    *[(family, "grouped_mm") for family in FAMILIES if family != "llama4"],  # transformers' default
    ("llama4", "own"),  # its experts class takes no experts implementation
    ("mixtral", "eager"), ("deepseek_v3", "eager"),  # the model class's own per-expert loop
    ("mixtral", "batched_mm"),
]  # fmt: skip


ROUTERS = ("mlp.gate.weight", "router.weight")


def tiny(family: str, experts: str = "grouped_mm", **overrides):
    config_cls, model_cls, extra = FAMILIES[family]
    base = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64, num_experts_per_tok=2, use_cache=False)  # fmt: skip
    config = getattr(transformers, config_cls)(**{**base, **extra, **overrides})
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config).train()
    if experts != "own":
        model.set_experts_implementation(experts)
    return model


def full(tensor: torch.Tensor, like: torch.Tensor, tp) -> torch.Tensor:
    """A sharded tensor gathered by the plan's split (``like`` carries the tags): along
    ``partition_dim``, each of the ``partition_stride`` packed parts (gate, up) on its own."""
    if not is_tensor_parallel(like):
        return tensor
    dim, parts = like.partition_dim, getattr(like, "partition_stride", 1)
    return torch.cat([C.all_gather(p.contiguous(), dim, tp) for p in tensor.chunk(parts, dim)], dim)


def step(model, ids, tp=None):
    out = model(input_ids=ids, labels=ids, output_router_logits=True)
    out.loss.backward()
    grads = {n: full(p.grad, p, tp) if tp is not None else p.grad.clone() for n, p in model.named_parameters()}
    logits = out.logits.detach()
    if tp is not None and logits.shape[-1] != VOCAB:  # loss_parallel: this rank's vocabulary slice
        logits = C.all_gather(logits.contiguous(), -1, tp)
    aux = out.aux_loss.detach() if getattr(out, "aux_loss", None) is not None else None
    model.zero_grad(set_to_none=True)
    return out.loss.detach(), aux, logits, grads


def _parity(family: str, experts: str) -> dict:
    ps = nc.initialize_model_parallel(2)
    torch.manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, 12))
    ref_loss, ref_aux, ref_logits, ref_grads = step(tiny(family, experts), ids)
    model = nc.apply_tensor_parallel(tiny(family, experts))
    loss, aux, logits, grads = step(model, ids, ps.tp)
    assert grads.keys() == ref_grads.keys()
    errors = {n: rel_max(grads[n], ref_grads[n]) for n in grads}
    worst = max(errors, key=errors.get)
    return {
        "loss": abs(float(loss - ref_loss)),
        "aux": None if ref_aux is None else abs(float(aux - ref_aux)),
        "logits": rel_max(logits, ref_logits),
        "grad": errors[worst],
        "worst": worst,
        "router": max(e for n, e in errors.items() if n.endswith(ROUTERS)),
        "experts": max(e for n, e in errors.items() if ".experts." in n),
        "split": sorted(n for n, p in model.named_parameters() if is_tensor_parallel(p)),
        "router_split": any(is_tensor_parallel(p) for n, p in model.named_parameters() if n.endswith(ROUTERS)),
    }


@pytest.mark.parametrize("family,experts", CASES)
def test_tp2_equals_the_dense_model(world, family, experts):
    for r in world(2).run(_parity, family, experts):
        assert r["loss"] < TOL and r["logits"] < TOL and r["grad"] < TOL, r
        assert (r["aux"] is None) == (family in NO_AUX) and (r["aux"] is None or r["aux"] < TOL), r
        assert r["router"] < TOL and not r["router_split"], r  # replicated, its gradient whole (not t or 1/t times)
        if family == "gpt_oss":
            assert r["split"] == ["lm_head.weight", "model.embed_tokens.weight"], r["split"]
            continue
        moe = "model.layers.1.feed_forward.experts" if family == "llama4" else "model.layers.1.mlp.experts"
        assert {f"{moe}.gate_up_proj", f"{moe}.down_proj"} <= set(r["split"]), r["split"]
        if family.startswith("deepseek"):  # shared experts and the dense first layer split by the plan
            assert {"model.layers.1.mlp.shared_experts.up_proj.weight", "model.layers.0.mlp.up_proj.weight"} <= set(
                r["split"]
            )
            attention_split = "model.layers.1.self_attn.kv_b_proj.weight" in r["split"]
            assert attention_split == (family == "deepseek_v2")  # V3's plan leaves MLA whole, V2's splits the heads


def _snapshot(model) -> list:
    """What applying a plan would change: parameter shapes and tags, module types, hooks."""
    params = [(n, tuple(p.shape), is_tensor_parallel(p)) for n, p in model.named_parameters()]
    modules = [(type(m), len(m._forward_hooks), len(m._forward_pre_hooks)) for m in model.modules()]
    return params + modules


def _errors() -> dict:
    nc.initialize_model_parallel(2)
    model, gpt_oss = tiny("mixtral"), tiny("gpt_oss")
    plan = dict(model.tp_plan)
    moe = "model.layers.*.mlp.experts"
    without = lambda key: {k: v for k, v in plan.items() if k != key}  # noqa: E731
    before = _snapshot(model), _snapshot(gpt_oss)
    out = {}
    for key, call in {
        # a 5.24 style not mapped
        "style": lambda: nc.apply_tensor_parallel(model, {**plan, moe: "moe_identity_expert"}),
        "divisible": lambda: nc.apply_tensor_parallel(tiny("mixtral", intermediate_size=15)),
        "unsummed": lambda: nc.apply_tensor_parallel(model, without(moe)),
        "unsplit": lambda: nc.apply_tensor_parallel(model, without(f"{moe}.down_proj")),
        "dim": lambda: nc.apply_tensor_parallel(model, {**plan, f"{moe}.gate_up_proj": "rowwise"}),
        "module": lambda: nc.apply_tensor_parallel(model, {**plan,
                                                            "model.layers.*.self_attn.q_proj": "packed_colwise"}),
        "biases": lambda: nc.apply_tensor_parallel(gpt_oss, {**gpt_oss.tp_plan, moe: "moe_tp_experts",
                                                            f"{moe}.gate_up_proj": "packed_rowwise",
                                                            f"{moe}.down_proj": "colwise"}),
    }.items():  # fmt: skip
        with pytest.raises(ValueError) as e:
            call()
        out[key] = str(e.value)
    out["unchanged"] = (_snapshot(model), _snapshot(gpt_oss)) == before
    return out


def test_bad_moe_plans_fail_in_one_line_before_anything_changes(world):
    r = world(2).run(_errors)[0]
    assert r.pop("unchanged")
    assert all("\n" not in v for v in r.values()), r
    assert r["style"].startswith(
        "apply_tensor_parallel: plan entry 'model.layers.*.mlp.experts' has style 'moe_identity_expert', which "
        "neuron_ckpt does not map (supported: colwise, "
    ) and r["style"].endswith(
        "moe_tp_experts, mla_kv_a_proj, ep_dispatch_experts, packed_colwise, packed_rowwise, grouped_gemm)"
    )
    assert r["divisible"] == (
        "apply_tensor_parallel: model.layers.0.mlp.experts.gate_up_proj (packed_colwise): intermediate_dim=15 is not "
        "divisible by the tensor-parallel size 2"
    )
    assert r["unsummed"].startswith(
        "apply_tensor_parallel: model.layers.0.mlp.experts.down_proj is split but model.layers.0.mlp.experts is not "
        "planned 'moe_tp_experts'"
    )
    assert r["unsplit"].startswith(
        "apply_tensor_parallel: model.layers.0.mlp.experts (moe_tp_experts): down_proj not split"
    )
    assert r["dim"] == (
        "apply_tensor_parallel: model.layers.0.mlp.experts.gate_up_proj (rowwise): slices dim 2 of gate_up_proj "
        "[4, 32, 32], whose intermediate size is dim 1 (gate and up packed): its style is 'packed_colwise'"
    )
    assert r["module"] == (
        "apply_tensor_parallel: model.layers.0.self_attn.q_proj (packed_colwise): neuron_ckpt maps this style on "
        "parameters (3-D expert weights), not on a module"
    )
    assert r["biases"].startswith(
        "apply_tensor_parallel: model.layers.0.mlp.experts (moe_tp_experts): experts with biases "
        "(gate_up_proj_bias, down_proj_bias) are not split"
    )


def _slices_and_loading() -> dict:
    ps = nc.initialize_model_parallel(2)
    r, i = ps.tp_rank, 8  # this rank's share of the intermediate size 16
    whole = {k: v.clone() for k, v in tiny("mixtral").state_dict().items()}
    model = nc.apply_tensor_parallel(tiny("mixtral"))
    experts = model.model.layers[0].mlp.experts
    gate_up, down = whole["model.layers.0.mlp.experts.gate_up_proj"], whole["model.layers.0.mlp.experts.down_proj"]
    mine = torch.cat(
        [gate_up[:, r * i : (r + 1) * i], gate_up[:, 16 + r * i : 16 + (r + 1) * i]], 1
    )  # gate rows, up rows
    out = {
        "gate_up": torch.equal(experts.gate_up_proj, mine),
        "down": torch.equal(experts.down_proj, down[:, :, r * i : (r + 1) * i]),
        "tags": (
            experts.gate_up_proj.partition_dim,
            experts.gate_up_proj.partition_stride,
            experts.down_proj.partition_dim,
        ),
        "intermediate_dim": experts.intermediate_dim,
        "keys": list(model.state_dict()) == list(whole),
        "router": torch.equal(model.model.layers[0].mlp.gate.weight, whole["model.layers.0.mlp.gate.weight"]),
    }
    other = tiny("mixtral")  # after the split: a whole state dict is sliced on the way in
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(-1)
    model.load_state_dict(other.state_dict())
    out["loaded_whole"] = torch.equal(experts.gate_up_proj, -mine) and torch.equal(
        experts.down_proj, -down[:, :, r * i : (r + 1) * i]
    )
    model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()})  # its own slices load as they are
    out["loaded_own"] = torch.equal(experts.gate_up_proj, -mine)
    return out


def test_expert_weights_are_sliced_tagged_and_load_whole_or_sliced(world):
    for r in world(2).run(_slices_and_loading):
        assert r.pop("tags") == (1, 2, 2) and r.pop("intermediate_dim") == 8
        assert all(r.values()), r


def _zero1_norm() -> dict:
    """ZeRO-1 AdamW with clipping at TP 2 equals dense AdamW: the norm counts each expert slice once."""
    from neuron_ckpt.optim import Zero1Optimizer

    ps = nc.initialize_model_parallel(2)
    torch.manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, 12))
    dense = tiny("mixtral")
    ref_opt = torch.optim.AdamW(dense.parameters(), lr=1e-2, eps=1e-4)
    dense(input_ids=ids, labels=ids, output_router_logits=True).loss.backward()
    ref_norm = float(torch.nn.utils.clip_grad_norm_(dense.parameters(), 0.5))
    ref_opt.step()
    model = nc.apply_tensor_parallel(tiny("mixtral"))
    opt = Zero1Optimizer(model.parameters(), torch.optim.AdamW, grad_clip_norm=0.5, lr=1e-2, eps=1e-4)
    model(input_ids=ids, labels=ids, output_router_logits=True).loss.backward()
    norm = float(opt.step())
    err = max(rel_max(full(p.detach(), p, ps.tp), q.detach()) for p, q in zip(model.parameters(), dense.parameters()))
    return {"norm": norm, "ref_norm": ref_norm, "err": err}


def test_zero1_grad_norm_counts_each_expert_slice_once(world):
    for r in world(2).run(_zero1_norm):
        assert r["norm"] == pytest.approx(r["ref_norm"], rel=1e-5) and r["ref_norm"] > 0.5, r  # and clipping happened
        assert r["err"] < TOL, r  # AdamW eps 1e-4, as in test_hf_tensor_parallel
