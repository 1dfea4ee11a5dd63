"""Expert parallelism on transformers MoE models (issue #44), on one world of 4 gloo processes.

* **Training equals EP 1** on the same world and data: Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE,
  DeepSeek-V3 and GPT-OSS, ZeRO-1 AdamW with clipping, several steps, at EP 2 and EP 4 (TP 1, DP
  4) and EP 2 at TP 2 + sequence parallel (DP 2) against EP 1 at the same TP: the loss, the aux
  loss and the pre-clip gradient norm of every step agree to 1e-5 relative (fp32; the experts sum
  the same products in another order, and a route to another expert would be O(1)); the routers
  end equal on every rank.
* **Dispatch round trip** (Megatron's ``dispatcher_dropless_test``): through identity experts
  both forms return the input and its gradient, with experts that get no token and an EP rank that
  receives nothing (its experts' gradients zero, not None); every route is sent once; the
  all-gather form with a capacity drops exactly the routes a plain loop says it should and counts them.
* **Gradient groups** (Megatron's ``test_grad_sync_with_expert_parallel``): with gradients ``2**rank``
  a dense parameter gets the mean over DP and an expert the sum over its expert-DP group divided
  by DP, and the norm is the same on every rank.
* **Placement**: EP rank ``j`` holds experts ``[j E/e, (j+1) E/e)`` under the same parameter names;
  whole and sliced state dicts load; the router stays whole.
* Recompute ``moe`` (all-to-all rerun, routing replayed) and ``moe_act`` under EP are bit-exact
  against none; a checkpoint saved at EP 2 resumes bit-exactly; the experts gathered back load
  whole with ``from_pretrained``; bad inputs are one line before anything changes.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import neuron_ckpt as nc  # noqa: E402
from neuron_ckpt.distributed import collectives as C  # noqa: E402
from neuron_ckpt.optim import Zero1Optimizer  # noqa: E402
from neuron_ckpt.parallel.experts import ExpertDispatch  # noqa: E402

TOL = 1e-5
VOCAB, STEPS = 64, 3
MLA = dict(num_key_value_heads=4, n_shared_experts=1, n_group=2, topk_group=1, first_k_dense_replace=1,
           q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8)  # fmt: skip
FAMILIES = {  # 4 experts, top 2
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(intermediate_size=16, num_local_experts=4)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(moe_intermediate_size=16, shared_expert_intermediate_size=32, num_experts=4)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(moe_intermediate_size=16, num_experts=4, head_dim=8)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(intermediate_size=16, num_experts=4, eos_token_id=2)),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    dict(moe_intermediate_size=16, n_routed_experts=4, **MLA)),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(intermediate_size=16, num_local_experts=4, head_dim=8,
                                                          sliding_window=16)),
}  # fmt: skip
LAYOUTS = [(1, 2, False), (1, 4, False), (2, 2, True)]  # (TP, EP, sequence parallel), each against EP 1


def tiny(family: str, experts: str = "grouped_mm", **overrides):
    config_cls, model_cls, extra = FAMILIES[family]
    base = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64, num_experts_per_tok=2, use_cache=False,
                output_router_logits=True)  # fmt: skip
    config = getattr(transformers, config_cls)(**{**base, **extra, **overrides})
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config).train()
    model.set_experts_implementation(experts)
    return model


def batches(ps, steps: int = STEPS) -> list[torch.Tensor]:
    """This DP rank's batch of each step: the same global data whatever the layout."""
    g = torch.Generator().manual_seed(1)
    data = [torch.randint(0, VOCAB, (4, 2, 8), generator=g) for _ in range(steps)]  # 4 x [b 2, s 8] per step
    per = 4 // ps.dp_size
    return [d[ps.dp_rank * per : (ps.dp_rank + 1) * per].reshape(-1, 8) for d in data]


def _train(family: str, tp: int, ep: int, sp: bool, experts: str = "grouped_mm", form: str = "auto") -> dict:
    """Losses, aux losses and gradient norms of ZeRO-1 AdamW steps at (TP, EP, SP) on 4 ranks."""
    ps = nc.initialize_model_parallel(tp, expert_model_parallel_size=ep)
    model = nc.apply_tensor_parallel(tiny(family, experts), sequence_parallel=sp, expert_dispatch=ExpertDispatch(form))
    opt = Zero1Optimizer(model.parameters(), torch.optim.AdamW, grad_clip_norm=0.5, lr=1e-2, eps=1e-4)
    out: dict[str, list] = {"loss": [], "aux": [], "norm": []}
    for ids in batches(ps):
        o = model(input_ids=ids, labels=ids)
        o.loss.backward()
        out["norm"].append(float(opt.step()))
        opt.zero_grad()
        for key, value in (("loss", o.loss), ("aux", getattr(o, "aux_loss", None))):
            if value is not None:  # DeepSeek-V3 has no load-balancing loss
                out[key].append(float(C.all_reduce(value.detach(), ps.dp)) / ps.dp_size)
    routers = [p for n, p in model.named_parameters() if n.endswith(("mlp.gate.weight", "router.weight"))]
    out["routers"] = [float(p.detach().double().sum()) for p in routers]
    return out


def _relative(a: list[float], b: list[float]) -> float:
    return max((abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b)), default=0.0)


@pytest.mark.parametrize("family", FAMILIES)
def test_training_at_ep_equals_ep1(world, family):
    w = world(4)
    for tp, ep, sp in LAYOUTS:
        base, spread = w.run(_train, family, tp, 1, sp), w.run(_train, family, tp, ep, sp)
        for r in spread:
            for key in ("loss", "aux", "norm"):
                assert len(r[key]) == len(base[0][key]) == (0 if key == "aux" and family == "deepseek_v3" else STEPS)
                assert _relative(r[key], base[0][key]) < TOL, (family, tp, ep, key, r[key], base[0][key])
            assert r["routers"] == spread[0]["routers"], (family, tp, ep)  # the same router on every rank
        assert max(base[0]["norm"]) > 0.5, base[0]["norm"]  # clipping happened


def _placement() -> dict:
    ps = nc.initialize_model_parallel(1, expert_model_parallel_size=2)
    whole = {k: v.clone() for k, v in tiny("mixtral").state_dict().items()}
    model = nc.apply_tensor_parallel(tiny("mixtral"))
    experts, key = model.model.layers[0].mlp.experts, "model.layers.0.mlp.experts."
    mine = {n: whole[key + n][ps.ep_rank * 2 : ps.ep_rank * 2 + 2] for n in ("gate_up_proj", "down_proj")}
    out = {
        "experts": all(torch.equal(getattr(experts, n), t) for n, t in mine.items()),  # experts 2r, 2r + 1
        "tags": [getattr(getattr(experts, n), "expert_parallel", False) for n in mine],
        "num_experts": experts.num_experts,
        "keys": list(model.state_dict()) == list(whole),
        "router": torch.equal(model.model.layers[0].mlp.gate.weight, whole["model.layers.0.mlp.gate.weight"]),
    }
    model.load_state_dict({k: -v for k, v in whole.items()})  # whole tensors: sliced on the way in
    out["loaded_whole"] = all(torch.equal(getattr(experts, n), -t) for n, t in mine.items())
    model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()})  # this rank's experts as they are
    out["loaded_own"] = all(torch.equal(getattr(experts, n), -t) for n, t in mine.items())
    return out


def test_each_ep_rank_holds_its_contiguous_experts_under_the_same_names(world):
    for r in world(4).run(_placement):
        assert r.pop("tags") == [True, True] and r.pop("num_experts") == 2, r
        assert all(r.values()), r


# --------------------------------------------------------------------------------------------
# The dispatch round trip, zero-token experts and an EP rank that receives nothing.

E, T, K, H = 8, 6, 2, 5  # experts (2 per rank at EP 4), tokens per rank, top-k, hidden


def _routing(rank: int):
    """Rank ``rank``'s tokens, routing and upstream gradient: no token goes to expert 3 (a local
    expert with no token on EP rank 1) nor to experts 6 and 7 (EP rank 3 receives nothing)."""
    g = torch.Generator().manual_seed(10 + rank)
    x = torch.randn(T, H, generator=g)
    allowed = torch.tensor([0, 1, 2, 4, 5])
    index = torch.stack([allowed[torch.randperm(5, generator=g)[:K]] for _ in range(T)])
    w = torch.softmax(torch.randn(T, K, generator=g), -1)
    return x, index, w, torch.randn(T, H, generator=g)


def _round_trip(form: str, capacity_factor: float | None = None) -> dict:
    from neuron_ckpt.parallel.experts import all_gather, all_to_all

    ps = nc.initialize_model_parallel(1, expert_model_parallel_size=4)
    x, index, w, upstream = (t.clone() for t in _routing(ps.ep_rank))
    x.requires_grad_(), w.requires_grad_()
    scale = torch.nn.Parameter(torch.ones(E // 4))  # identity experts, one scale each: their gradient
    if form == "all_to_all":
        routed, trip = all_to_all.dispatch(x, index, E, ps.ep)
        y = all_to_all.combine(routed.rows * scale[routed.experts, None], trip, w)
        real, dropped = sum(trip.receive), 0
    else:
        n = T * ps.ep_size
        capacity = ExpertDispatch("all_gather", capacity_factor).capacity(n, K, E)
        routed, trip = all_gather.dispatch(x, index, w, E, ps.ep, capacity)
        y = all_gather.combine(routed.rows * (scale[routed.experts] * routed.weights)[:, None], trip)
        real, dropped = int((routed.weights != 0).sum()), int(trip.dropped)
    y.backward(upstream)
    # The reference, from every rank's routing: which routes each expert keeps (in gathered order)
    everyone = [_routing(r) for r in range(ps.ep_size)]
    local = range(ps.ep_rank * E // 4, (ps.ep_rank + 1) * E // 4)
    limit = ExpertDispatch("all_gather", capacity_factor).capacity(T * 4, K, E) if form == "all_gather" else T * 4
    queue: dict[int, int] = {}
    kept = {}  # (rank, token, slot) -> kept
    for r, (_, idx, _, _) in enumerate(everyone):
        for t in range(T):
            for j in range(K):
                e = int(idx[t, j])
                queue[e] = queue.get(e, 0) + 1
                kept[r, t, j] = queue[e] <= limit
    mine = [(r, t, j) for (r, t, j) in kept if int(everyone[r][1][t, j]) in local]
    keep = torch.tensor([[kept[ps.ep_rank, t, j] for j in range(K)] for t in range(T)], dtype=x.dtype)
    ref_y = x.detach() * (w.detach() * keep).sum(-1, keepdim=True)
    ref_scale = torch.zeros(E // 4, dtype=torch.float64)
    for r, t, j in mine:
        xr, _, wr, gr = everyone[r]
        if kept[r, t, j]:
            ref_scale[int(everyone[r][1][t, j]) - local.start] += float(wr[t, j] * (xr[t] @ gr[t]))
    return {
        "y": float((y - ref_y).abs().max()),
        "x_grad": float((x.grad - upstream * (w.detach() * keep).sum(-1, keepdim=True)).abs().max()),
        "w_grad": float((w.grad - (x.detach() @ upstream.T).diagonal()[:, None] * keep).abs().max()),
        "scale_grad": None if scale.grad is None else float((scale.grad.double() - ref_scale).abs().max()),
        "rows": real,
        "expected_rows": sum(kept[m] for m in mine),
        "dropped": dropped,
        "expected_dropped": sum(not kept[m] for m in mine),
    }


@pytest.mark.parametrize("form,capacity_factor", [("all_to_all", None), ("all_gather", None), ("all_gather", 0.75)])
def test_dispatch_round_trip_returns_the_input_and_its_gradient(world, form, capacity_factor):
    results = world(4).run(_round_trip, form, capacity_factor)
    for rank, r in enumerate(results):
        assert max(r["y"], r["x_grad"], r["w_grad"]) < 1e-6, (rank, r)
        assert r["scale_grad"] is not None and r["scale_grad"] < 1e-5, (rank, r)  # also where nothing arrived
        assert r["rows"] == r["expected_rows"] and r["dropped"] == r["expected_dropped"], (rank, r)
    assert results[3]["expected_rows"] == 0  # EP rank 3 received nothing
    assert sum(r["rows"] + r["dropped"] for r in results) == 4 * T * K  # every route once, kept or counted
    assert (sum(r["dropped"] for r in results) > 0) == (capacity_factor is not None)


# --------------------------------------------------------------------------------------------
# Which group reduces which gradient, and the norm.


def _grad_groups() -> dict:
    from neuron_ckpt.parallel.params import set_expert_parallel_attribute

    ps = nc.initialize_model_parallel(1, expert_model_parallel_size=2)  # DP [0..3], EDP [0, 2] and [1, 3]
    dense, expert = torch.nn.Parameter(torch.zeros(6)), torch.nn.Parameter(torch.zeros(4))
    set_expert_parallel_attribute(expert)
    opt = Zero1Optimizer([dense, expert], torch.optim.SGD, lr=1.0)
    rank = torch.distributed.get_rank()
    dense.grad, expert.grad = torch.full((6,), 2.0**rank), torch.full((4,), 2.0**rank)
    norm = float(opt.step())
    return {"dense": dense.detach().tolist(), "expert": expert.detach().tolist(), "norm": norm, "edp": ps.edp.ranks}


def test_expert_gradients_are_reduced_over_expert_dp_and_scaled_by_dp(world):
    results = world(4).run(_grad_groups)
    norm = (6 * 3.75**2 + 4 * 1.25**2 + 4 * 2.5**2) ** 0.5  # dense once, each EP rank's experts once
    for rank, r in enumerate(results):
        assert r["dense"] == [-(1 + 2 + 4 + 8) / 4] * 6, r  # the mean over DP
        assert r["edp"] == ((0, 2) if rank % 2 == 0 else (1, 3)), r
        assert r["expert"] == [-sum(2.0**q for q in r["edp"]) / 4] * 4, r  # summed over EDP, / DP (not / EDP)
        assert r["norm"] == pytest.approx(norm, rel=1e-6), r  # the same on every rank


# --------------------------------------------------------------------------------------------
# Recompute under EP: moe reruns the dispatch (routing replayed), moe_act discards the activation.


def _one_step(model, ids) -> tuple:
    torch.manual_seed(2)  # attention dropout and router jitter
    nc.model_parallel_manual_seed(3)  # dropout on split heads (TP 2)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return out.loss.detach(), out.aux_loss.detach(), grads


def _recompute(modules: tuple[str, ...], reentrant: bool | None, tp: int) -> bool:
    from neuron_ckpt.recompute import RecomputeConfig, apply_recompute

    ps = nc.initialize_model_parallel(tp, expert_model_parallel_size=2)
    nc.model_parallel_manual_seed(3)  # before the split: attention dropout on split heads needs it
    ids = batches(ps, 1)[0]
    kw = dict(attention_dropout=0.1, router_jitter_noise=0.1)
    reference = _one_step(nc.apply_tensor_parallel(tiny("mixtral", "eager", **kw), sequence_parallel=tp > 1), ids)
    model = nc.apply_tensor_parallel(tiny("mixtral", "eager", **kw), sequence_parallel=tp > 1)
    apply_recompute(model, RecomputeConfig(granularity="selective", modules=modules, use_reentrant=reentrant))
    loss, aux, grads = _one_step(model, ids)
    same = torch.equal(loss, reference[0]) and torch.equal(aux, reference[1])
    return (
        same and grads.keys() == reference[2].keys() and all(torch.equal(g, reference[2][n]) for n, g in grads.items())
    )


@pytest.mark.parametrize("modules,reentrant,tp", [
    (("moe",), None, 1), (("moe",), True, 1), (("moe_act",), None, 1), (("moe", "core_attn"), None, 2),
])  # fmt: skip
def test_moe_recompute_under_ep_is_bit_exact(world, modules, reentrant, tp):
    """The eager experts loop: each rank's experts see other tokens, so the ranks' graphs differ
    between the exchanges; a rerun that stopped at different points would hang, not pass."""
    assert world(4).run(_recompute, modules, reentrant, tp) == [True] * 4


# --------------------------------------------------------------------------------------------
# Checkpoints and export.


def _build(family: str, tp: int = 1):
    model = nc.apply_tensor_parallel(tiny(family), sequence_parallel=tp > 1)
    return model, Zero1Optimizer(model.parameters(), torch.optim.AdamW, grad_clip_norm=0.5, lr=1e-2, eps=1e-4)


def _train_step(model, opt, ids) -> torch.Tensor:
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def _resume(directory: str) -> dict:
    from neuron_ckpt.train import CheckpointManager, TrainState

    ps = nc.initialize_model_parallel(1, expert_model_parallel_size=2)
    rank, data = torch.distributed.get_rank(), batches(ps)
    manager = CheckpointManager(directory, rank=rank, world_size=4, parallel_state=ps)
    state = TrainState(*_build("mixtral"))
    _train_step(state.model, state.optimizer, data[0])
    state.step = 1
    path = state.save(manager, {})
    for ids in data[1:]:
        _train_step(state.model, state.optimizer, ids)
    again = TrainState(*_build("mixtral"))
    again.resume(manager, "latest", {})
    for ids in data[1:]:
        _train_step(again.model, again.optimizer, ids)
    exact = all(torch.equal(p, q) for p, q in zip(again.model.parameters(), state.model.parameters()))
    nc.destroy_model_parallel()
    other = nc.initialize_model_parallel(1)  # EP 1: another layout
    with pytest.raises(ValueError) as refused:
        CheckpointManager(directory, rank=rank, world_size=4, parallel_state=other).load(path, {})
    return {"exact": exact, "files": sorted(p.name for p in path.glob("*.safetensors")), "refused": str(refused.value)}


def test_a_checkpoint_at_ep2_resumes_exactly(world, tmp_path):
    results = world(4).run(_resume, str(tmp_path))
    assert all(r["exact"] for r in results), results
    shared = [f for f in results[0]["files"] if not f.startswith("rank_")]
    assert shared == ["experts_ep00000-00001-of-00001.safetensors", "experts_ep00001-00001-of-00001.safetensors",
                      "model_tp00000-00001-of-00001.safetensors"], shared  # fmt: skip
    assert "ep_size: checkpoint 2, this run 1" in results[0]["refused"] and "\n" not in results[0]["refused"]


def _export(directory: str) -> dict:
    from neuron_ckpt.parallel.hf.export import save_pretrained

    ps = nc.initialize_model_parallel(2, expert_model_parallel_size=2)
    model, opt = _build("qwen2_moe", tp=2)
    data = batches(ps, 2)
    _train_step(model, opt, data[0])  # weights moved away from the config's initialisation
    loss = model(input_ids=data[1], labels=data[1]).loss.detach()
    save_pretrained(model, directory)
    if torch.distributed.get_rank() != 0:
        return {}
    whole, info = transformers.AutoModelForCausalLM.from_pretrained(directory, output_loading_info=True)
    whole.set_experts_implementation("grouped_mm")
    problems = {k: v for k, v in info.items() if v}
    return {"loss": float(whole.train()(input_ids=data[1], labels=data[1]).loss - loss), "problems": problems}


def test_export_gathers_the_experts_and_from_pretrained_loads_the_model_whole(world, tmp_path):
    r = world(4).run(_export, str(tmp_path / "hf"))[0]
    assert r["problems"] == {}, r  # no key missing, unexpected or mismatched
    assert abs(r["loss"]) < TOL, r  # the model trained at TP 2 x EP 2, now in one process


# --------------------------------------------------------------------------------------------
# Bad inputs: one line each, before anything changes.


def _snapshot(model) -> list:
    params = [(n, tuple(p.shape), getattr(p, "expert_parallel", False)) for n, p in model.named_parameters()]
    return params + [(type(m), len(m._forward_hooks), len(m._forward_pre_hooks)) for m in model.modules()]


def _errors() -> dict:
    nc.initialize_model_parallel(1, expert_model_parallel_size=4)
    mixtral, six = tiny("mixtral"), tiny("mixtral", num_local_experts=6)
    llama4 = transformers.Llama4ForCausalLM(transformers.Llama4TextConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=16, intermediate_size_mlp=32, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4))  # fmt: skip
    plan = {**mixtral.tp_plan, **mixtral.ep_plan}
    moe = "model.layers.*.mlp.experts"
    without = lambda key: {k: v for k, v in plan.items() if k != key}  # noqa: E731
    before = [_snapshot(m) for m in (mixtral, six, llama4)]
    out = {}
    for key, call in {
        "divisible": lambda: nc.apply_tensor_parallel(six),
        "no_plan": lambda: nc.apply_tensor_parallel(llama4),
        "unsliced": lambda: nc.apply_tensor_parallel(mixtral, without(f"{moe}.down_proj")),
        "undispatched": lambda: nc.apply_tensor_parallel(mixtral, without(moe)),
        "form": lambda: ExpertDispatch("alltoall"),
        "capacity": lambda: ExpertDispatch("all_to_all", capacity_factor=1.0),
    }.items():  # fmt: skip
        with pytest.raises(ValueError) as e:
            call()
        out[key] = str(e.value)
    out["unchanged"] = [_snapshot(m) for m in (mixtral, six, llama4)] == before
    nc.destroy_model_parallel()
    nc.initialize_model_parallel(2)
    with pytest.raises(ValueError) as e:
        nc.apply_tensor_parallel(tiny("mixtral"), plan)
    out["ep1"] = str(e.value)
    nc.destroy_model_parallel()
    nc.initialize_model_parallel(2, expert_model_parallel_size=2)
    model = nc.apply_tensor_parallel(tiny("mixtral"))  # TP 2 without sequence parallel: each TP rank its own s/2
    ids = torch.randint(0, VOCAB, (2, 7))
    with pytest.raises(ValueError) as e:
        model(input_ids=ids)
    out["sequence"] = str(e.value)
    return out


def test_bad_expert_parallel_inputs_fail_in_one_line(world):
    r = world(4).run(_errors)[0]
    assert r.pop("unchanged")
    assert all("\n" not in v for v in r.values()), r
    assert r["divisible"] == (
        "apply_tensor_parallel: model.layers.0.mlp.experts (ep_dispatch_experts): 6 experts do not split over "
        "expert_model_parallel_size 4; allowed: [1, 2, 3, 6]"
    )
    assert r["no_plan"].startswith(
        "apply_tensor_parallel: Llama4ForCausalLM has no expert-parallel plan (model.ep_plan), and "
        "expert_model_parallel_size is 4"
    )
    assert r["unsliced"].startswith(
        "apply_tensor_parallel: model.layers.0.mlp.experts (ep_dispatch_experts): down_proj not planned 'grouped_gemm'"
    )
    assert r["undispatched"].startswith(
        "apply_tensor_parallel: model.layers.0.mlp.experts.gate_up_proj (grouped_gemm): its module "
        "model.layers.0.mlp.experts is not planned 'ep_dispatch_experts'"
    )
    assert r["form"] == "ExpertDispatch.form must be one of ('auto', 'all_to_all', 'all_gather'), got 'alltoall'"
    assert r["capacity"].startswith("ExpertDispatch.capacity_factor applies to form='all_gather'")
    assert r["ep1"].startswith("apply_tensor_parallel: plan entry 'model.layers.*.mlp.experts.gate_up_proj' "
                               "(grouped_gemm) needs expert_model_parallel_size > 1")  # fmt: skip
    assert r["sequence"].startswith("expert parallel: MixtralExperts got 14 tokens (batch 2); each of the 2 ")
