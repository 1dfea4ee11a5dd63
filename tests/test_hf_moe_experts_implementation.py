"""Which experts implementation runs a transformers MoE layer (issue #47), on tiny models built from
configs (no downloads).

* **moe_act on the eager loop frees what Megatron's moe_act frees**: transformers' eager loop
  writes ``act_fn(gate) * up`` inline, so ``moe_act`` used to discard ``act_fn``'s output only
  (half: ``F`` of ``2F`` per routed row). Under ``moe_act`` the loop now runs through
  ``_apply_gate`` (``recompute/experts_loop.py``): the bytes ``SavedTensorRecorder`` counts as
  freed on an OLMoE and a Mixtral layer are ``act(gate)`` and the product, ``2 F w`` per routed
  row, as on grouped_mm, and loss, aux loss and every gradient are bit-identical with and
  without. The loop is the class's own, op for op (the same bits forward and backward) on the
  common layout, Aria's transposed weights and MuseSpark's norm after each expert. Experts whose
  forward cannot be replaced (Llama 4's) get one warning naming what moe_act cannot save there.
* **grouped_mm's 16-byte stride rule** (``parallel/hf/grouped_mm.py``): Mixtral with intermediate
  36 at TP 2 (18 fp32 per rank) crashed mid-forward; ``apply_tensor_parallel`` now switches it to
  the eager loop with one warning naming the size and the TP sizes where grouped_mm runs, and it
  equals the dense model (1e-5 relative: the split sums the same products in another order). The
  rule is in bytes: intermediate 40 at TP 2 (20 per rank) runs grouped_mm in fp32 and switches in
  bf16. Under EP 2 whole experts break it alike (intermediate 18 in fp32, 36 in bf16), and there
  the switched eager loop also takes ``moe_act`` (bytes and gradients as above).
"""

from __future__ import annotations

import re
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

import neuron_ckpt as nc  # noqa: E402
from neuron_ckpt.memory import SavedTensorRecorder  # noqa: E402
from neuron_ckpt.parallel.hf.shards import shard_of  # noqa: E402
from neuron_ckpt.recompute import RecomputeConfig, apply_recompute, remove_recompute  # noqa: E402
from neuron_ckpt.recompute.experts_loop import eager_loop  # noqa: E402

from .helpers import rel_max  # noqa: E402

H, K, TOKENS = 32, 2, 24  # hidden, top-k, tokens (2 x 12)
FAMILIES = {
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(num_experts=4, eos_token_id=2)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4)),
}
MOE_ACT = RecomputeConfig(granularity="selective", modules=["moe_act"])
NOTICE = r"^apply_tensor_parallel: model\.layers\.0\.mlp\.experts \(MixtralExperts\) and 1 more experts modules: "


def tiny(family: str, intermediate: int, experts: str = "eager", dtype=torch.float32):
    config_cls, model_cls, own = FAMILIES[family]
    config = getattr(transformers, config_cls)(
        vocab_size=64, hidden_size=H, intermediate_size=intermediate, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, num_experts_per_tok=K, use_cache=False,
        output_router_logits=True, **own,
    )  # fmt: skip
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config).to(dtype).train()
    model.set_experts_implementation(experts)
    return model


def ids(batch: int = 2) -> torch.Tensor:
    return torch.randint(0, 64, (batch, 12), generator=torch.Generator().manual_seed(1))


def step(model, tokens: torch.Tensor) -> tuple:
    out = model(input_ids=tokens, labels=tokens)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out.loss.detach(), out.aux_loss.detach(), grads


def kept(model, tokens: torch.Tensor, layer: int = 1) -> int:
    """Bytes autograd keeps for one decoder layer's forward (parameters left out)."""
    with SavedTensorRecorder(exclude_modules=[model]) as rec:
        handles = rec.attach({"layer": model.model.layers[layer]})
        out = model(input_ids=tokens, labels=tokens)  # noqa: F841  (holds the graph until the count)
    for handle in handles:
        handle.remove()
    return rec.bytes_by_scope()["layer"]


def freed_by_moe_act(model, tokens: torch.Tensor) -> int:
    before = kept(model, tokens)
    apply_recompute(model, MOE_ACT)
    return before - kept(model, tokens)


def assert_same(got: tuple, want: tuple) -> None:
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert got[2].keys() == want[2].keys() and all(torch.equal(g, want[2][n]) for n, g in got[2].items())


# --------------------------------------------------------------------------------------------
# moe_act on the eager loop.


@pytest.mark.parametrize("family,dtype", [("olmoe", torch.float32), ("olmoe", torch.bfloat16),
                                          ("mixtral", torch.float32)])  # fmt: skip
def test_moe_act_on_the_eager_loop_frees_the_activation_and_the_product(family, dtype):
    F, w = 16, torch.tensor([], dtype=dtype).element_size()
    megatron = TOKENS * K * 2 * F * w  # act(gate) and act(gate) * up, F each per routed row
    assert freed_by_moe_act(tiny(family, F, "grouped_mm", dtype), ids()) == megatron
    reference = step(tiny(family, F, "eager", dtype), ids())
    model = tiny(family, F, "eager", dtype)
    assert freed_by_moe_act(model, ids()) == megatron  # was TOKENS * K * F * w: act_fn's output only
    assert_same(step(model, ids()), reference)
    experts = model.model.layers[1].mlp.experts
    assert "forward" in experts.__dict__
    remove_recompute(model)
    assert "forward" not in experts.__dict__ and "_apply_gate" not in experts.__dict__
    assert_same(step(model, ids()), reference)


def _experts(family: str) -> torch.nn.Module:
    if family == "aria":  # transposed weights [E, h, 2F] / [E, F, h]
        from transformers.models.aria.modeling_aria import AriaExperts

        module = AriaExperts(transformers.AriaTextConfig(hidden_size=H, intermediate_size=16, moe_num_experts=4))
    elif family == "muse_spark":  # a norm after each expert
        from transformers.models.muse_spark import modeling_muse_spark as ms

        config = ms.MuseSparkTextConfig(hidden_size=H, moe_hidden_size=H, moe_intermediate_size=16,
                                        num_local_experts=4, num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
        module = ms.MuseSparkExperts(config)
    else:
        module = tiny(family, 16).model.layers[0].mlp.experts
    torch.manual_seed(3)
    for p in module.parameters():
        torch.nn.init.normal_(p)
    return module


@pytest.mark.parametrize("family", ["mixtral", "olmoe", "aria", "muse_spark"])
def test_the_loop_is_the_class_loop_op_for_op(family):
    experts = _experts(family)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(10, H, generator=g)
    index = torch.stack([torch.randperm(4, generator=g)[:K] for _ in range(10)])
    weights = torch.rand(10, K, generator=g)
    results = []
    for forward in (type(experts).forward.__wrapped__, eager_loop):  # the class's own loop, ours
        inputs = [x.clone().requires_grad_(), weights.clone().requires_grad_()]
        y = forward(experts, inputs[0], index, inputs[1])
        y.pow(2).sum().backward()
        results.append([y.detach(), *(t.grad for t in inputs), *(p.grad.clone() for p in experts.parameters())])
        experts.zero_grad(set_to_none=True)
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_experts_whose_forward_keeps_the_product_are_named_in_one_warning():
    config = transformers.Llama4TextConfig(
        vocab_size=64, hidden_size=H, intermediate_size=16, intermediate_size_mlp=32, num_local_experts=4, head_dim=8,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    model = transformers.Llama4ForCausalLM(config).train()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        apply_recompute(model, MOE_ACT)
    lines = {str(w.message) for w in caught if "moe_act" in str(w.message)}
    assert lines == {
        (
            "moe_act: Llama4TextExperts.forward writes act_fn(gate) * up inline, so only act_fn's output is "
            "discarded there, not the product the down projection keeps (the same size again: half of what "
            "Megatron's moe_act frees)"
        )
    }
    assert "forward" not in model.model.layers[0].feed_forward.experts.__dict__


# --------------------------------------------------------------------------------------------
# grouped_mm's stride rule under TP and EP (one gloo world of 2).


def _split(model, **kw):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        nc.apply_tensor_parallel(model, **kw)
    return model, [str(w.message) for w in caught if "grouped_mm" in str(w.message)]


def _tp2() -> dict:
    ps = nc.initialize_model_parallel(2)
    tokens = ids()
    dense = step(tiny("mixtral", 36, "grouped_mm"), tokens)  # 36 fp32 per expert: 144 bytes, grouped_mm runs
    model, notices = _split(tiny("mixtral", 36, "grouped_mm"))
    loss, aux, grads = step(model, tokens)
    sliced = {"gate_up_proj": (1, 2), "down_proj": (2, 1)}  # (dim, stride) of the intermediate size
    errors = [rel_max(loss, dense[0]), rel_max(aux, dense[1])]
    for name, g in grads.items():
        dim, stride = sliced.get(name.rpartition(".")[2], (None, 1))
        want = dense[2][name] if dim is None else shard_of(dense[2][name], dim, 2, ps.tp_rank, stride)
        if not name.startswith(("model.embed_tokens", "lm_head")) and ".self_attn." not in name:
            errors.append(rel_max(g, want))  # the router, the norms, the expert slices
    width = {dtype: _split(tiny("mixtral", 40, "grouped_mm", dtype))[0].config._experts_implementation
             for dtype in (torch.float32, torch.bfloat16)}  # fmt: skip
    return {"notices": notices, "implementation": model.config._experts_implementation, "error": max(errors),
            "width": width}  # fmt: skip


def test_tp2_slices_that_break_grouped_mm_run_the_eager_loop_with_a_notice(world):
    for r in world(2).run(_tp2):
        assert len(r["notices"]) == 1 and re.match(
            NOTICE + r"intermediate size 18 per rank \(36 over tensor-parallel size 2\) is 72 bytes in float32, not "
            r"a multiple of the 16 bytes transformers' grouped_mm needs .*; running transformers' 'eager' experts "
            r"loop instead .*; grouped_mm would run at tensor-parallel sizes \[1, 3, 9\]$",
            r["notices"][0],
        ), r["notices"]
        assert r["implementation"] == "eager" and r["error"] < 1e-5, r
        assert r["width"] == {torch.float32: "grouped_mm", torch.bfloat16: "eager"}  # 20 per rank: 80 / 40 bytes


def _ep2() -> dict:
    ps = nc.initialize_model_parallel(1, expert_model_parallel_size=2)
    tokens = ids(4)[2 * ps.dp_rank : 2 * ps.dp_rank + 2]  # this DP rank's half of the batch
    width = {dtype: _split(tiny("mixtral", 36, "grouped_mm", dtype))[0].config._experts_implementation
             for dtype in (torch.float32, torch.bfloat16)}  # fmt: skip
    model, notices = _split(tiny("mixtral", 18, "grouped_mm"))
    experts = model.model.layers[1].mlp.experts
    rows: list[int] = []
    experts.register_forward_pre_hook(lambda m, args: rows.append(args[0].shape[0]))  # after the dispatch's
    reference = step(model, tokens)
    before = kept(model, tokens)
    apply_recompute(model, MOE_ACT)
    freed = before - kept(model, tokens)
    return {"notices": notices, "width": width, "freed": freed, "rows": rows[-1],
            "same": (lambda got: all(torch.equal(a, b) for a, b in zip(got[:2], reference[:2])) and all(
                torch.equal(g, reference[2][n]) for n, g in got[2].items()))(step(model, tokens))}  # fmt: skip


def test_ep2_whole_experts_that_break_grouped_mm_run_the_eager_loop_and_moe_act_frees_both(world):
    for r in world(2).run(_ep2):
        assert len(r["notices"]) == 1 and re.match(
            NOTICE + r"intermediate size 18 is 72 bytes in float32, .*; grouped_mm needs the intermediate size to be "
            r"a multiple of 4 in float32$",
            r["notices"][0],
        ), r["notices"]
        assert r["width"] == {torch.float32: "grouped_mm", torch.bfloat16: "eager"}  # 36: 144 / 72 bytes
        assert r["rows"] > 0 and r["freed"] == r["rows"] * 2 * 18 * 4  # the rows this rank's experts computed
        assert r["same"]
