"""LlamaForCausalLM equals transformers' Llama: logits, loss, gradients, checkpoints, at TP 1/2/4.

The reference is ``transformers.LlamaForCausalLM`` built offline from a tiny config with eager
attention, fp32. Every case loads its state dict into our model (each rank keeps its shard),
runs forward + backward on the same batch and compares against the reference on every rank.
Cases run batched per TP degree in one worker call each, to keep the file fast on 2 cores.
"""

from __future__ import annotations

import math

import pytest
import torch
import transformers

import neuron_ckpt as nc
from neuron_ckpt.memory import ModelShape
from neuron_ckpt.models import LlamaArgs, LlamaForCausalLM
from neuron_ckpt.recompute import Recompute, RecomputeConfig, apply_recompute

from .helpers import rel_max, tiny_config

WORLD = 4
SEQ, BATCH, VOCAB = 16, 2, 128
TOL = 1e-5


def reference(config: transformers.LlamaConfig, seed: int = 0):
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).float()
    # Non-trivial norm weights, so a norm gradient or sharding bug cannot hide behind ones.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("layernorm.weight") or name == "model.norm.weight":
                p.add_(0.1 * torch.randn_like(p))
    return model


def batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = ids.clone()
    labels[0, :3] = -100  # some ignored targets
    return ids, labels


def _compare(t: int, kv: int, sp: bool, recompute: dict | None) -> dict:
    config = tiny_config(num_key_value_heads=kv)
    ref = reference(config)
    ids, labels = batch()
    ref_out = ref(input_ids=ids, labels=labels)
    ref_out.loss.backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}

    torch.manual_seed(123)  # a different init, so the load must overwrite all of it
    model = LlamaForCausalLM(config, sequence_parallel=sp)
    if recompute is not None:
        apply_recompute(model, RecomputeConfig(**recompute))  # after the build: the one way in
    model.load_hf_state_dict(ref.state_dict())
    out = model(ids, labels, return_logits="full")
    out.loss.backward()
    grads = model.hf_grad_dict()
    sd = model.hf_state_dict()
    ref_sd = ref.state_dict()
    return {
        "case": (t, kv, sp, recompute),
        "logits": rel_max(out.logits.detach(), ref_out.logits.detach()),
        "loss": rel_max(out.loss.detach(), ref_out.loss.detach()),
        "grads": max(rel_max(grads[n], g) for n, g in ref_grads.items()),
        "grad_keys": set(grads) == set(ref_grads),
        "roundtrip": set(sd) == set(ref_sd) and all(torch.equal(sd[k], ref_sd[k]) for k in ref_sd),
        "local_logits": tuple(model(ids).logits.shape),
        "recompute_applied": any(isinstance(m, Recompute) for m in model.modules()),
    }


def _run_cases(t: int, cases: list[tuple[int, bool, dict | None]]) -> list[dict]:
    nc.initialize_model_parallel(t)
    return [_compare(t, kv, sp, rc) for kv, sp, rc in cases]


BASE_CASES = [(kv, sp, None) for kv in (2, 4) for sp in (False, True)]


@pytest.fixture(scope="module")
def results(world) -> dict[int, list[dict]]:
    return {t: world(WORLD).run(_run_cases, t, BASE_CASES) for t in (1, 2, 4)}


@pytest.mark.parametrize("t", [1, 2, 4])
def test_matches_transformers(results, t):
    """Logits, loss and every gradient equal transformers' at TP t, GQA and MHA, with/without SP."""
    for rank_results in results[t]:
        for r in rank_results:
            assert r["logits"] < TOL, r
            assert r["loss"] < TOL, r
            assert r["grad_keys"], r
            assert r["grads"] < TOL, r


@pytest.mark.parametrize("t", [1, 2, 4])
def test_hf_state_dict_round_trips_exactly(results, t):
    """load_hf_state_dict then hf_state_dict gives back the same tensors (kv=2 < t=4 included)."""
    for rank_results in results[t]:
        assert all(r["roundtrip"] for r in rank_results)


def test_logits_are_vocab_parallel_and_sequence_first(results):
    assert results[4][0][0]["local_logits"] == (SEQ, BATCH, VOCAB // 4)
    assert results[1][0][0]["local_logits"] == (SEQ, BATCH, VOCAB)


RECOMPUTE = [
    {"granularity": "selective"},  # core attention
    {"granularity": "selective", "modules": ["core_attn", "mlp_act", "norm"]},
    {"granularity": "full", "method": "uniform", "num_layers": 2},  # both layers as one checkpoint
    {"granularity": "full", "method": "block", "num_layers": 1},
]


@pytest.mark.parametrize("t", [1, 2, 4])
def test_matches_transformers_under_recompute(world, t):
    """Selective and full recompute leave logits, loss and gradients unchanged (TP t, +/- SP)."""
    cases = [(2, sp, rc) for rc in RECOMPUTE for sp in (False, True)]
    for rank_results in world(WORLD).run(_run_cases, t, cases):
        for r in rank_results:
            assert r["logits"] < TOL and r["loss"] < TOL and r["grads"] < TOL, r
            assert r["grad_keys"] and r["roundtrip"] and r["recompute_applied"], r


def _init_full_weights(t: int) -> dict[str, torch.Tensor]:
    nc.initialize_model_parallel(t)
    torch.manual_seed(7)
    return LlamaForCausalLM(tiny_config()).hf_state_dict()


def test_initialisation_does_not_depend_on_tp(world):
    one = world(WORLD).run(_init_full_weights, 1)[0]
    four = world(WORLD).run(_init_full_weights, 4)
    for sd in four:
        assert all(torch.equal(sd[k], one[k]) for k in one)
    std = one["model.layers.0.mlp.up_proj.weight"].std().item()
    assert abs(std - 0.02) < 0.002  # normal_init(config.initializer_range)


def _load_errors() -> list[str]:
    nc.initialize_model_parallel(1)
    config = tiny_config()
    model = LlamaForCausalLM(config)
    sd = reference(config).state_dict()
    errors = []
    broken = dict(sd)
    del broken["model.layers.1.mlp.down_proj.weight"]
    broken["model.layers.2.mlp.down_proj.weight"] = torch.zeros(1)
    bad_shape = dict(sd, **{"model.layers.0.self_attn.k_proj.weight": torch.zeros(64, 64)})
    for bad in (broken, bad_shape):
        try:
            model.load_hf_state_dict(bad)
        except (KeyError, ValueError) as e:
            errors.append(str(e))
    try:  # tied: lm_head.weight may be given, but only as the embedding table itself
        LlamaForCausalLM(
            transformers.LlamaConfig(**{**config.to_dict(), "tie_word_embeddings": True})
        ).load_hf_state_dict(sd)
    except ValueError as e:
        errors.append(str(e))
    return errors


def test_clear_errors(world):
    """Missing/unexpected keys and shapes are named; an untied head loaded into a tied model is refused."""
    missing_unexpected, shape, tied = world(1).run(_load_errors)[0]
    assert "model.layers.1.mlp.down_proj.weight" in missing_unexpected
    assert "model.layers.2.mlp.down_proj.weight" in missing_unexpected
    assert "k_proj.weight" in shape and "(64, 64)" in shape and "(32, 64)" in shape
    assert "tie_word_embeddings" in tied


def test_flops_per_token_llama2_7b():
    config = transformers.LlamaConfig(
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        tie_word_embeddings=False,
    )
    shape = ModelShape.from_llama(config)
    assert shape.num_parameters() == 6_738_415_616  # Llama-2 7B
    n = shape.num_parameters(include_embedding=False)
    assert shape.flops_per_token(4096) == 6 * n + 12 * 32 * 4096 * 4096
    tiny = ModelShape.from_llama(tiny_config())
    assert tiny.num_parameters() == sum(p.numel() for p in reference(tiny_config()).parameters())


# --- selective recompute targets modules whose forward runs; longrope ------------------------


def _single_rank_state():
    from neuron_ckpt.distributed import Group, ParallelState

    one = Group(process_group=None, ranks=(0,), replica_groups=((0,),), rank=0)
    return ParallelState(tp=one, dp=one)


def test_the_model_reads_a_transformers_config_into_llama_args_and_options():
    """``model.args``: the typed fields (a transformers config or LlamaArgs build the same model);
    ``model.options``: the run choices, one frozen, validated object handed to every module."""
    import dataclasses

    from neuron_ckpt.models.llama import LlamaOptions

    state = _single_rank_state()
    torch.manual_seed(0)
    from_hf = LlamaForCausalLM(tiny_config(), parallel_state=state)
    torch.manual_seed(0)
    from_args = LlamaForCausalLM(LlamaArgs.from_hf(tiny_config()), parallel_state=state)
    assert from_hf.args == from_args.args and from_hf.args.head_dim == 16 and from_hf.args.num_key_value_heads == 2
    assert all(torch.equal(p, q) for p, q in zip(from_hf.parameters(), from_args.parameters()))
    assert from_hf.options == LlamaOptions(parallel_state=state) and from_hf.parallel_state is state
    assert all(layer.mlp.options is from_hf.options for layer in from_hf.layers)
    with pytest.raises(dataclasses.FrozenInstanceError):
        from_hf.options.sequence_parallel = True
    with pytest.raises(ValueError, match="attention_implementation must be one of"):
        LlamaForCausalLM(tiny_config(), attention_implementation="sdpa", parallel_state=state)
    assert LlamaArgs.from_hf(from_hf.args.to_hf()) == from_hf.args  # exports write what was read


def test_mlp_submodules_that_run_and_module_map_refuses_the_others(monkeypatch):
    """gate_proj / up_proj are weights only (one fused matmul): every other submodule of a layer
    runs its own forward, and a selective name mapped onto gate_proj / up_proj is refused."""
    from neuron_ckpt.models.llama import LlamaMLP, SwiGLU
    from neuron_ckpt.parallel import ColumnParallelLinear

    model = LlamaForCausalLM(tiny_config(), parallel_state=_single_rank_state())
    ran = set()
    layer = model.layers[0]
    for name, module in layer.named_modules():
        module.register_forward_pre_hook(lambda m, args, name=name: ran.add(name))
    ids, labels = batch()
    model(ids, labels)
    idle = {"mlp." + c for c in LlamaMLP.weights_only_children}
    assert idle == {"mlp.gate_proj", "mlp.up_proj"}
    assert ran == {name for name, _ in layer.named_modules()} - idle

    selective = RecomputeConfig(granularity="selective", modules=["mlp_act"])
    for module_map in ({"mlp_act": "gate_proj"}, {"mlp_act": "mlp.up_proj"}, {"mlp_act": ColumnParallelLinear}):
        with pytest.raises(ValueError, match=r"never runs the forward of '(gate|up)_proj'.*module_map"):
            apply_recompute(model.layers, selective, module_map=module_map)
        assert not any(isinstance(m, Recompute) for m in model.modules())  # nothing changed
    # The default map wraps SwiGLU (act_fn), whose forward runs: recompute reruns it in backward.
    assert apply_recompute(model.layers, selective) == ["0.mlp.act_fn", "1.mlp.act_fn"]
    calls, swiglu = [], SwiGLU.forward
    monkeypatch.setattr(SwiGLU, "forward", lambda self, gate, up: calls.append(1) or swiglu(self, gate, up))
    model(ids, labels).loss.backward()
    assert len(calls) == 4  # two layers: forward + recompute


def _longrope_config(original: int = 16) -> transformers.LlamaConfig:
    d = 64 // 4
    config = tiny_config()
    config.rope_parameters = {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": [1.0 + 0.25 * i for i in range(d // 2)],
        "long_factor": [2.0 + 1.5 * i for i in range(d // 2)],
        "original_max_position_embeddings": original,
    }
    return config


@pytest.mark.parametrize("seq", [8, 16, 17, 32])
def test_longrope_switches_to_the_long_factors_like_transformers(seq):
    """Short factors up to original_max_position_embeddings (16) positions, long ones past it,
    with the same attention scaling: cos/sin tables and the model's logits match transformers."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from neuron_ckpt.models.rotary import RotaryEmbedding

    config = _longrope_config()
    hf_rotary, ours = LlamaRotaryEmbedding(config), RotaryEmbedding(LlamaArgs.from_hf(config))
    x = torch.zeros(1, seq, 64)
    hf_cos, hf_sin = hf_rotary(x, torch.arange(seq)[None])
    cos, sin = ours(seq, torch.float32, torch.device("cpu"))
    assert torch.equal(cos[:, 0, 0], hf_cos[0]) and torch.equal(sin[:, 0, 0], hf_sin[0])
    assert ours.attention_scaling == hf_rotary.attention_scaling > 1
    short = RotaryEmbedding(LlamaArgs.from_hf(config)).inv_freq
    assert torch.equal(ours.long_inv_freq if seq > 16 else ours.inv_freq, hf_rotary.inv_freq)
    assert not torch.equal(ours.long_inv_freq, short)  # the switch changes the table

    ref = reference(config)
    ids = torch.randint(0, VOCAB, (BATCH, seq), generator=torch.Generator().manual_seed(seq))
    model = LlamaForCausalLM(config, parallel_state=_single_rank_state())
    model.load_hf_state_dict(ref.state_dict())
    ref_logits = ref(input_ids=ids).logits.detach()
    assert rel_max(model(ids, return_logits="full").logits.detach(), ref_logits) < TOL


# ---- Llama-3.1 RoPE scaling, and Llama-3.2-style tied embeddings ---------------------------------
#
# The reference for the llama3 RoPE is Meta's published rule (``apply_scaling`` of llama-models,
# written out below) and transformers' ``LlamaRotaryEmbedding``; the tiny config puts head
# frequencies in all three of its bands (kept, smoothed, divided by ``factor``).
#
# Tied parity (``TIED_TOL``, relative to the largest value): fp32, the same weights on both sides.
# Measured max rel errors at TP 1 and 2, with and without SP and under every recompute preset:
# logits 0 (TP 1) and 1.4e-7 (TP 2), loss 0, gradients <= 4.8e-7 (TP 1) and 6.0e-7 (TP 2): a few
# fp32 ulps from the TP-split and fused-QKV sums; ``TOL`` (1e-5) leaves >15x headroom while a head
# that is not the table, a lost gradient term or a wrong RoPE band gives errors of order 1e-2 or more.

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}  # fmt: skip


def llama32_config(tied: bool = True) -> transformers.LlamaConfig:
    """Llama-3.2 1B in miniature: tied embeddings, GQA (4 heads / 2 kv), llama3 RoPE, theta 5e5."""
    return tiny_config(
        max_position_embeddings=256, rope_theta=500000.0, rope_scaling=dict(LLAMA3_ROPE), tie_word_embeddings=tied
    )


def meta_llama3_inv_freq(theta: float, d: int, factor, low, high, original) -> torch.Tensor:
    """Meta's ``apply_scaling`` (llama-models, Llama 3.1), in float64."""
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    low_wavelen, high_wavelen = original / low, original / high
    out = []
    for f in inv.tolist():
        wavelen = 2 * torch.pi / f
        if wavelen < high_wavelen:
            out.append(f)
        elif wavelen > low_wavelen:
            out.append(f / factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            out.append((1 - smooth) * f / factor + smooth * f)
    return torch.tensor(out, dtype=torch.float64)


def test_llama3_rope_scaling_matches_meta_and_transformers():
    from neuron_ckpt.models.rotary import RotaryEmbedding

    config = llama32_config()
    args = LlamaArgs.from_hf(config)
    assert args.rope_parameters["rope_type"] == "llama3"
    rotary = RotaryEmbedding(args)
    d = args.head_dim
    meta = meta_llama3_inv_freq(500000.0, d, 8.0, 1.0, 4.0, 64)
    plain = 1.0 / 500000.0 ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    bands = {"kept": (meta == plain).sum(), "divided": torch.isclose(meta, plain / 8).sum()}
    assert bands["kept"] >= 1 and bands["divided"] >= 1 and bands["kept"] + bands["divided"] < d // 2  # + smoothed
    assert torch.allclose(rotary.inv_freq.double(), meta, rtol=1e-6, atol=0)
    cos, sin = rotary(256, torch.float32, torch.device("cpu"))  # [s, 1, 1, d]
    ref = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(config)
    ref_cos, ref_sin = ref(torch.zeros(1, 256, d), torch.arange(256)[None])
    assert torch.equal(cos[:, 0, 0], ref_cos[0]) and torch.equal(sin[:, 0, 0], ref_sin[0])
    # Not the unscaled table: the test can fail.
    unscaled = RotaryEmbedding(
        LlamaArgs.from_hf(
            transformers.LlamaConfig(**{**config.to_dict(), "rope_scaling": None, "rope_parameters": None})
        )
    )
    assert not torch.allclose(unscaled.inv_freq, rotary.inv_freq)


def llama32_reference(tied: bool = True):
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(llama32_config(tied)).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
    return model


def _tied_cases(t: int, presets: list[str]) -> list[dict]:
    from neuron_ckpt.recompute import RecomputeConfig as RC

    nc.initialize_model_parallel(t)
    ref = llama32_reference()
    assert ref.lm_head.weight is ref.model.embed_tokens.weight
    ids, labels = batch()
    ref_out = ref(input_ids=ids, labels=labels)
    ref_out.loss.backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}  # tied: embed_tokens only
    results = []
    for sp in (False, True):
        for preset in presets:
            torch.manual_seed(123)
            model = LlamaForCausalLM(llama32_config(), sequence_parallel=sp)
            apply_recompute(model, RC.preset(preset))
            model.load_hf_state_dict(ref.state_dict())  # holds lm_head.weight too: the same tensor
            out = model(ids, labels, return_logits="full")
            out.loss.backward()
            grads = model.hf_grad_dict()
            results.append({
                "case": (t, sp, preset),
                "logits": rel_max(out.logits.detach(), ref_out.logits.detach()),
                "loss": rel_max(out.loss.detach(), ref_out.loss.detach()),
                "grads": max(rel_max(grads[n], g) for n, g in ref_grads.items()),
                "grad_keys": set(grads) == set(ref_grads),
                "one_parameter": model.lm_head.weight is model.embed_tokens.weight,
                "state_dict_keys": sorted(model.state_dict()),
                "local_numel": sum(p.numel() for p in model.parameters()),
                "shape_numel": ModelShape.from_llama(model.args).local_parameters(t),
            })  # fmt: skip
    # The shared gradient is the sum of both uses: an untied model with the same weights.
    untied = LlamaForCausalLM(llama32_config(tied=False))
    sd = dict(ref.state_dict())
    untied.load_hf_state_dict(sd)
    untied(ids, labels).loss.backward()
    g = untied.hf_grad_dict()
    both = g["model.embed_tokens.weight"] + g["lm_head.weight"]
    results[0]["sum_of_uses"] = rel_max(grads["model.embed_tokens.weight"], both)
    results[0]["head_term"] = rel_max(grads["model.embed_tokens.weight"], g["model.embed_tokens.weight"])
    return results


@pytest.mark.parametrize("t", [1, 2])
def test_tied_llama32_matches_transformers(world, t):
    """Tied, GQA, llama3 RoPE: logits, loss and the one shared gradient equal transformers' at TP t,
    +/- sequence parallel, under every recompute preset; the model has one table parameter."""
    from neuron_ckpt.recompute import PRESETS

    for rank_results in world(2).run(_tied_cases, t, list(PRESETS)):
        for r in rank_results:
            assert r["logits"] < TOL and r["loss"] < TOL and r["grads"] < TOL, r
            assert r["grad_keys"] and r["one_parameter"], r
            assert "lm_head.weight" not in r["state_dict_keys"] and "embed_tokens.weight" in r["state_dict_keys"]
            assert r["local_numel"] == r["shape_numel"], r
        first = rank_results[0]
        assert first["sum_of_uses"] < TOL and first["head_term"] > 1e-3, first


def test_tied_model_counts_the_table_once():
    tied, untied = (ModelShape.from_llama(llama32_config(tie)) for tie in (True, False))
    table = VOCAB * 64
    assert untied.local_parameters(1) - tied.local_parameters(1) == table
    assert tied.num_parameters(include_embedding=False) == tied.num_parameters()  # the table is the head
    assert tied.flops_per_token(16) == untied.flops_per_token(16)  # the head's matmul either way
    assert sum(p.numel() for p in llama32_reference().parameters()) == tied.num_parameters()


def _tied_zero1_step(t: int) -> dict:
    """One ZeRO-1 AdamW step of the tied model (same batch on every DP rank) against
    transformers + torch.optim.AdamW; the param groups list the table twice (module by module).

    The error is measured against the step, ``max |update - transformers' update| / lr``: Adam's
    first step is ``lr * g / (|g| + eps)``, so a tiny gradient element carrying fp32 cancellation
    noise (the TP / fused-QKV sums differ from transformers') moves by a slightly different amount;
    ``eps`` 1e-4 damps that (measured: <= 1e-4 of a step at TP 1 and 2). Counting the table twice
    or losing one use's gradient is off by the order of a whole step.
    """
    from neuron_ckpt.optim import Zero1Optimizer

    nc.initialize_model_parallel(t)
    ref = llama32_reference()
    ids, labels = batch()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-4)
    ref(input_ids=ids, labels=labels).loss.backward()
    ref_opt.step()
    model = LlamaForCausalLM(llama32_config(), sequence_parallel=t > 1)
    model.load_hf_state_dict(llama32_reference().state_dict())
    listed = [p for m in model.modules() for p in m.parameters(recurse=False)]  # the table twice
    opt = Zero1Optimizer(listed, torch.optim.AdamW, lr=1e-2, weight_decay=0.1, eps=1e-4)
    model(ids, labels).loss.backward()
    opt.step()
    sd, ref_sd, before = model.hf_state_dict(), ref.state_dict(), llama32_reference().state_dict()
    return {
        "listed": len(listed), "unique": len(list(model.parameters())),
        "slots": sum(len(f["shapes"]) for f in opt.state_dict()["meta"]["flats"]),
        "slot_numel": sum(math.prod(s) for f in opt.state_dict()["meta"]["flats"] for s in f["shapes"]),
        "numel": sum(p.numel() for p in model.parameters()),
        "step_err": max(float((sd[k] - ref_sd[k]).abs().max()) for k in sd) / 1e-2,
        "table_step": float((sd["model.embed_tokens.weight"] - before["model.embed_tokens.weight"]).abs().max()) / 1e-2,
    }  # fmt: skip


@pytest.mark.parametrize("t", [1, 2])
def test_tied_model_trains_with_zero1_as_one_parameter(world, t):
    for r in world(2).run(_tied_zero1_step, t):
        assert r["listed"] == r["unique"] + 1 and r["slots"] == r["unique"] and r["slot_numel"] == r["numel"], r
        assert r["step_err"] < 1e-2 and r["table_step"] > 0.5, r
