"""Tensor parallel on transformers models from their own plan (issue #27): at TP 2 on gloo the
model equals the dense one it was split from (loss, logits, every gradient gathered by the plan),
with each recompute preset; dropout is bit-exact between recompute and none at TP 2; ZeRO-1 and
the checkpoint manager work on the result; bad plans fail before anything changes.

Tolerances: the split model sums the same products in a different order (a row-parallel layer
adds two partial sums; the vocab-parallel loss adds two partial softmax sums), so fp32 results
differ by rounding only: relative max-abs differences of ~1e-7 per op, a few ulps through two
layers. The bound 1e-5 is a hundred times that and far below any real error (a wrong slice or a
missing reduction is O(1)).
"""

import pytest
import torch

transformers = pytest.importorskip("transformers")

import neuron_ckpt as nc  # noqa: E402
from neuron_ckpt.distributed import collectives as C  # noqa: E402
from neuron_ckpt.parallel.params import is_tensor_parallel  # noqa: E402
from neuron_ckpt.recompute import RecomputeConfig, apply_recompute  # noqa: E402

from .helpers import rel_max  # noqa: E402

TOL = 1e-5
VOCAB = 64
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 8}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"head_dim": 8, "pad_token_id": 0}),  # tied, soft-capped
    "phi3": (
        "Phi3Config",
        "Phi3ForCausalLM",
        {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2},
    ),  # fused qkv / gate_up, gather-split styles
}
PRESETS = ["none", "selective", "full"]


def tiny(family: str, dropout: float = 0.0, kv_heads: int = 2, attn: str = "eager"):
    config_cls, model_cls, extra = FAMILIES[family]
    config = getattr(transformers, config_cls)(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=kv_heads, max_position_embeddings=64, attention_dropout=dropout, use_cache=False,
        **extra,
    )  # fmt: skip
    config._attn_implementation = attn
    torch.manual_seed(0)
    return getattr(transformers, model_cls)(config).train()


def full(param_or_grad: torch.Tensor, like: torch.Tensor, tp) -> torch.Tensor:
    """A sharded tensor gathered along the dim the plan split it on (``like`` carries the tag)."""
    return (
        C.all_gather(param_or_grad.contiguous(), like.partition_dim, tp) if is_tensor_parallel(like) else param_or_grad
    )


def step(model, ids, tp=None, seed: int = 2):
    if tp is None:
        torch.manual_seed(seed)  # the dropout masks
    else:  # and the TP stream's, which split attention heads draw from
        nc.model_parallel_manual_seed(seed)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    named = dict(model.named_parameters())
    grads = {n: full(p.grad, p, tp) if tp is not None else p.grad.clone() for n, p in named.items()}
    logits = out.logits.detach()
    if tp is not None and logits.shape[-1] != VOCAB:  # loss_parallel: this rank's vocabulary slice
        logits = C.all_gather(logits.contiguous(), -1, tp)
    model.zero_grad(set_to_none=True)
    return out.loss.detach(), logits, grads


def _parity(family: str, preset: str, loss_parallel: bool) -> dict:
    ps = nc.initialize_model_parallel(2)
    torch.manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, 12))
    ids[0, 3] = 0  # Gemma2's and Phi-3's padding_idx: its embedding row gets no gradient
    ref_loss, ref_logits, ref_grads = step(tiny(family), ids)
    model = nc.apply_tensor_parallel(tiny(family), loss_parallel=loss_parallel)
    apply_recompute(model, RecomputeConfig.preset(preset))
    loss, logits, grads = step(model, ids, ps.tp)
    assert grads.keys() == ref_grads.keys()
    worst = max(grads, key=lambda n: rel_max(grads[n], ref_grads[n]))
    return {
        "loss": abs(float(loss - ref_loss)),
        "logits": rel_max(logits, ref_logits),
        "grad": rel_max(grads[worst], ref_grads[worst]),
        "worst": worst,
        "split": sorted(n for n, p in model.named_parameters() if is_tensor_parallel(p)),
    }


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_tp2_equals_the_dense_model(world, family, preset):
    for r in world(2).run(_parity, family, preset, True):
        assert r["loss"] < TOL and r["logits"] < TOL and r["grad"] < TOL, r
        assert any("layers.0." in n for n in r["split"])  # the plan did split the layers


@pytest.mark.parametrize("family", ["llama", "gemma2", "phi3"])
def test_tp2_with_the_plan_as_written_gathers_the_logits(world, family):
    for r in world(2).run(_parity, family, "none", False):
        assert r["loss"] < TOL and r["logits"] < TOL and r["grad"] < TOL, r


def _dropout_exact(family: str, preset: str) -> bool:
    ps = nc.initialize_model_parallel(2)
    nc.model_parallel_manual_seed(5)
    torch.manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, 12))
    plain = step(nc.apply_tensor_parallel(tiny(family, dropout=0.1)), ids, ps.tp)
    model = nc.apply_tensor_parallel(tiny(family, dropout=0.1))
    apply_recompute(model, RecomputeConfig.preset(preset))
    again = step(model, ids, ps.tp)
    other_seed = step(model, ids, ps.tp, seed=3)
    assert not torch.equal(other_seed[0], plain[0])  # the dropout is on: another mask, another loss
    return torch.equal(again[0], plain[0]) and all(torch.equal(again[2][n], plain[2][n]) for n in plain[2])


@pytest.mark.parametrize("preset", ["selective", "full"])
@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma2", "phi3"])
def test_tp2_recompute_is_bit_exact_with_dropout(world, family, preset):
    assert world(2).run(_dropout_exact, family, preset) == [True, True]


def _dropout_masks(family: str) -> list[torch.Tensor]:
    """The first attention dropout's kept positions on this rank, and the next default draw."""
    nc.initialize_model_parallel(2)
    nc.model_parallel_manual_seed(5)
    model = nc.apply_tensor_parallel(tiny(family, dropout=0.5))
    masks, dropout = [], torch.nn.functional.dropout

    def recorded(x, p=0.5, training=True, inplace=False):
        out = dropout(x, p, training, inplace)
        masks.append(out != 0)
        return out

    torch.nn.functional.dropout = recorded
    try:
        model(input_ids=torch.arange(12).reshape(1, 12))
    finally:
        torch.nn.functional.dropout = dropout
    return [masks[0], torch.rand(4)]


@pytest.mark.parametrize("family", ["llama", "phi3"])
def test_split_heads_draw_their_own_dropout_mask_per_rank(world, family):
    (mask0, after0), (mask1, after1) = world(2).run(_dropout_masks, family)
    # Llama: heads split, each rank its own mask; Phi-3: qkv gathered, every rank all heads, one mask
    assert torch.equal(mask0, mask1) == (family == "phi3")
    assert torch.equal(after0, after1)  # the default stream stays the same on every rank


def _names_slices_and_loading() -> dict:
    ps = nc.initialize_model_parallel(2)
    dense = tiny("qwen2")  # q/k/v biases: the column bias is split too
    before = {n: tuple(p.shape) for n, p in dense.named_parameters()}
    full_state = {k: v.clone() for k, v in dense.state_dict().items()}
    model = nc.apply_tensor_parallel(tiny("qwen2"))
    after = {n: tuple(p.shape) for n, p in model.named_parameters()}
    q = model.model.layers[0].self_attn.q_proj
    rows = slice(ps.tp_rank * 16, (ps.tp_rank + 1) * 16)
    sliced_right = torch.equal(q.weight, full_state["model.layers.0.self_attn.q_proj.weight"][rows])
    sliced_right &= torch.equal(q.bias, full_state["model.layers.0.self_attn.q_proj.bias"][rows])
    # after the swap: a full state dict (another model's weights) is sliced on the way in
    other = tiny("qwen2")
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(-1)
    model.load_state_dict(other.state_dict())
    loaded_full = torch.equal(q.weight, -full_state["model.layers.0.self_attn.q_proj.weight"][rows])
    # and its own (sliced) state dict loads back as it is
    model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()})
    return {
        "keys": list(model.state_dict()) == list(full_state),
        "names": after.keys() == before.keys(),
        "halved": {n for n in after if after[n] != before[n]},
        "sliced_right": sliced_right,
        "loaded_full": loaded_full
        and torch.equal(q.weight, -full_state["model.layers.0.self_attn.q_proj.weight"][rows]),
        "print": str(model.model.layers[0].self_attn),
    }


def test_names_unchanged_weights_sliced_and_full_or_sliced_state_dicts_load(world):
    for r in world(2).run(_names_slices_and_loading):
        assert r["keys"] and r["names"] and r["sliced_right"] and r["loaded_full"], r
        assert r["halved"] == {
            f"model.layers.{i}.{m}" for i in range(2) for m in (
                "self_attn.q_proj.weight", "self_attn.q_proj.bias", "self_attn.k_proj.weight", "self_attn.k_proj.bias",
                "self_attn.v_proj.weight", "self_attn.v_proj.bias", "self_attn.o_proj.weight", "mlp.gate_proj.weight",
                "mlp.up_proj.weight", "mlp.down_proj.weight")
        } | {"model.embed_tokens.weight", "lm_head.weight"}  # fmt: skip
        assert "ColumnParallelLinear" in r["print"] and "RowParallelLinear" in r["print"]


def _tied_stays_tied() -> bool:
    nc.initialize_model_parallel(2)
    model = nc.apply_tensor_parallel(tiny("gemma2"))
    return model.lm_head.weight is model.model.embed_tokens.weight and model.lm_head.weight.shape[0] == VOCAB // 2


def test_tied_embedding_and_head_stay_one_split_parameter(world):
    assert world(2).run(_tied_stays_tied) == [True, True]


def _errors() -> dict:
    nc.initialize_model_parallel(2)
    out = {}
    model = tiny("llama")
    before = [type(m) for m in model.modules()]
    for key, call in {
        "style": lambda: nc.apply_tensor_parallel(model, {"model.layers.*.self_attn.q_proj": "local_colwise",
                                                            "model.layers.*.mlp.down_proj": "rowwise"}),
        "kind": lambda: nc.apply_tensor_parallel(model, {"model.norm": "colwise"}),
        "heads": lambda: nc.apply_tensor_parallel(tiny("llama", kv_heads=1)),
        "seed": lambda: nc.apply_tensor_parallel(tiny("llama", dropout=0.1)),
        "none": lambda: nc.apply_tensor_parallel(torch.nn.Linear(2, 2)),
    }.items():  # fmt: skip
        with pytest.raises(ValueError) as e:
            call()
        out[key] = str(e.value)
    out["unchanged"] = [type(m) for m in model.modules()] == before
    return out


def test_bad_plans_fail_in_one_line_before_anything_changes(world):
    r = world(2).run(_errors)[0]
    assert r["unchanged"]
    assert r["style"] == (
        "apply_tensor_parallel: plan entry 'model.layers.*.self_attn.q_proj' has style 'local_colwise', which "
        "neuron_ckpt does not map (supported: colwise, colwise_gather_output, colwise_rep, rowwise, "
        "rowwise_split_input, rowwise_rep, embedding_rowwise, replicated_with_grad_allreduce, replicate, "
        "moe_tp_experts, mla_kv_a_proj, ep_dispatch_experts, packed_colwise, packed_rowwise, grouped_gemm)"
    )
    assert r["kind"] == "apply_tensor_parallel: model.norm (colwise): needs a torch.nn.Linear, got LlamaRMSNorm"
    assert r["heads"].startswith(
        "apply_tensor_parallel: model.layers.0.self_attn.k_proj (colwise): 1 heads of 8 do not split"
    )
    assert "has no tensor-parallel plan" in r["none"]
    assert r["seed"].endswith("call nc.model_parallel_manual_seed(seed) first")
    assert all("\n" not in v for v in r.values() if isinstance(v, str))


def _zero1_and_checkpoint(directory: str) -> dict:
    """TP 2 x DP 2: ZeRO-1 AdamW steps with clipping equal dense AdamW on the whole batch; the
    checkpoint manager saves the result and a fresh split model restores it exactly."""
    from neuron_ckpt.optim import Zero1Optimizer
    from neuron_ckpt.train.checkpoint import CheckpointManager

    ps = nc.initialize_model_parallel(2)
    torch.manual_seed(1)
    batches = [torch.randint(0, VOCAB, (4, 12)) for _ in range(2)]
    dense = tiny("llama")
    ref_opt = torch.optim.AdamW(dense.parameters(), lr=1e-2, eps=1e-4)
    model = nc.apply_tensor_parallel(tiny("llama"))
    apply_recompute(model, RecomputeConfig.preset("selective"))
    opt = Zero1Optimizer(model.parameters(), torch.optim.AdamW, grad_clip_norm=0.5, lr=1e-2, eps=1e-4)
    ref_norms, norms = [], []
    for ids in batches:
        dense(input_ids=ids, labels=ids).loss.backward()
        ref_norms.append(float(torch.nn.utils.clip_grad_norm_(dense.parameters(), 0.5)))
        ref_opt.step()
        ref_opt.zero_grad()
        mine = ids.chunk(2)[ps.dp_rank]  # equal halves: the DP mean of the halves' means is the mean
        model(input_ids=mine, labels=mine).loss.backward()
        norms.append(float(opt.step()))
        opt.zero_grad()
    named = dict(model.named_parameters())
    err = max(rel_max(full(p.detach(), p, ps.tp), q.detach()) for (_, p), q in zip(named.items(), dense.parameters()))
    manager = CheckpointManager(directory, rank=torch.distributed.get_rank(), world_size=4, parallel_state=ps)
    path = manager.save(2, {"model": model.state_dict(), "optim": opt.state_dict()}, {"tp_size": 2, "dp_size": 2})
    fresh = nc.apply_tensor_parallel(tiny("llama"))
    shard, _ = manager.load(path, {"tp_size": 2, "dp_size": 2})
    fresh.load_state_dict(shard["model"])
    restored = all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))
    return {"err": err, "norms": norms, "ref_norms": ref_norms, "restored": restored}


def test_zero1_and_the_checkpoint_manager_work_on_the_split_model(world, tmp_path):
    for r in world(4).run(_zero1_and_checkpoint, str(tmp_path)):
        assert r["err"] < TOL, r  # AdamW eps 1e-4: rounding in near-zero gradients is not divided by itself
        assert r["norms"] == pytest.approx(r["ref_norms"], rel=1e-5)
        assert min(r["norms"]) > 0.5  # clipping happened
        assert r["restored"]
