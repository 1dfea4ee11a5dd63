"""Sequence parallel on transformers models (issue #35): ``apply_tensor_parallel(model,
sequence_parallel=True)`` splits the activations outside the split modules along dim 1 of
``[b, s, h]``. At TP 2 on gloo each family equals the dense model it was split from (loss, aux
loss, logits, every gradient) under recompute; dropout replays bit for bit; what each layer keeps
is what plain TP keeps with every whole-sequence ``[b, s, h]`` tensor cut to ``s/t`` tokens, and
the terms it shares with our own Llama are the same bytes; bad input fails in one line.

Tolerance as in ``test_hf_tensor_parallel.py`` (1e-5 relative max-abs, fp32): the split model
sums the same products in another order (a reduce-scatter adds two partial sums where the dense
model has one matmul), rounding only; a wrong chunk, a missing or doubled reduction of a norm's
gradient, or a region fed the wrong tokens is O(1).
"""

import pytest
import torch

transformers = pytest.importorskip("transformers")

import neuron_ckpt as nc  # noqa: E402
from neuron_ckpt.memory.measure import SavedTensorRecorder  # noqa: E402
from neuron_ckpt.recompute import RecomputeConfig, apply_recompute  # noqa: E402

from . import test_hf_moe_tensor_parallel as moe_tp  # noqa: E402
from . import test_hf_tensor_parallel as dense_tp  # noqa: E402
from .helpers import rel_max  # noqa: E402

TOL = 1e-5
VOCAB = 64
DENSE = ("llama", "qwen3", "gemma2", "phi3")
MOE = ("mixtral", "qwen2_moe", "deepseek_v3", "gpt_oss")


def tiny(family: str, dropout: float = 0.0):
    if family in DENSE:
        model = dense_tp.tiny(family, dropout=dropout)
    else:
        model = moe_tp.tiny(family, attention_dropout=dropout)
    if family == "phi3":  # its residual dropouts run on this rank's tokens under sequence parallel
        for m in model.modules():
            if isinstance(m, torch.nn.Dropout):
                m.p = dropout
    return model


def config(preset_or_modules) -> RecomputeConfig:
    if isinstance(preset_or_modules, str):
        return RecomputeConfig.preset(preset_or_modules)
    return RecomputeConfig(granularity="selective", modules=preset_or_modules)


def _parity(family: str, recompute) -> dict:
    ps = nc.initialize_model_parallel(2)
    torch.manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, 12))
    ids[0, 3] = 0  # Gemma2's and Phi-3's padding_idx
    ref_loss, ref_aux, ref_logits, ref_grads = moe_tp.step(tiny(family), ids)
    model = nc.apply_tensor_parallel(tiny(family), sequence_parallel=True)
    apply_recompute(model, config(recompute))
    with torch.no_grad():
        out = model.model(input_ids=ids)
    hidden_whole = tuple(out.last_hidden_state.shape) == (2, 12, 32)
    model.zero_grad(set_to_none=True)
    loss, aux, logits, grads = moe_tp.step(model, ids, ps.tp)
    worst = max(grads, key=lambda n: rel_max(grads[n], ref_grads[n]))
    return {
        "loss": abs(float(loss - ref_loss)),
        "aux": None if ref_aux is None else abs(float(aux - ref_aux)),
        "logits": rel_max(logits, ref_logits),
        "grad": rel_max(grads[worst], ref_grads[worst]),
        "worst": worst,
        "hidden_whole": hidden_whole,
    }


CASES = [
    *[(f, p) for f in DENSE for p in ("none", "selective", "full")],
    *[(f, p) for f in MOE for p in ("none", "full")],
    ("llama", ("core_attn", "mlp", "norm")),
    ("mixtral", ("moe",)), ("mixtral", ("moe_act", "norm")),
    ("qwen2_moe", ("shared_experts", "moe_act")), ("deepseek_v3", ("mla_up_proj", "core_attn", "mlp")),
]  # fmt: skip


@pytest.mark.parametrize("family,recompute", CASES, ids=lambda v: "+".join(v) if isinstance(v, tuple) else v)
def test_tp2_sequence_parallel_equals_the_dense_model(world, family, recompute):
    for r in world(2).run(_parity, family, recompute):
        assert r["loss"] < TOL and r["logits"] < TOL and r["grad"] < TOL, r
        assert r["aux"] is None or r["aux"] < TOL, r  # routers see every token, as without sequence parallel
        assert r["hidden_whole"], r  # the final norm's output is gathered: [b, s, h], as without it


def _dropout_exact(family: str, preset: str) -> bool:
    ps = nc.initialize_model_parallel(2)
    nc.model_parallel_manual_seed(5)
    torch.manual_seed(1)
    ids = torch.randint(1, VOCAB, (2, 12))
    # bf16, as models train: in fp32 the output-discarding norm returns its input's gradient as one
    # sum, equal to rounding only (docs/recompute.md)
    plain = dense_tp.step(nc.apply_tensor_parallel(tiny(family, 0.1).to(torch.bfloat16), sequence_parallel=True),
                          ids, ps.tp)  # fmt: skip
    model = nc.apply_tensor_parallel(tiny(family, 0.1).to(torch.bfloat16), sequence_parallel=True)
    apply_recompute(model, config(preset))
    again = dense_tp.step(model, ids, ps.tp)
    assert not torch.equal(dense_tp.step(model, ids, ps.tp, seed=3)[0], plain[0])  # the dropout is on
    return torch.equal(again[0], plain[0]) and all(torch.equal(again[2][n], plain[2][n]) for n in plain[2])


@pytest.mark.parametrize("family,preset", [
    ("llama", "selective+mlp_act+norm"), ("llama", "full"),
    ("phi3", ("core_attn", "norm")), ("phi3", "full"),  # Phi-3's activation is not an act_fn: no mlp_act
], ids=lambda v: "+".join(v) if isinstance(v, tuple) else v)  # fmt: skip
def test_recompute_under_sequence_parallel_is_bit_exact_with_dropout(world, family, preset):
    # Phi-3 also drops out on the residual stream, on each rank's own tokens (the TP stream)
    assert world(2).run(_dropout_exact, family, preset) == [True, True]


# --------------------------------------------------------------------------------------------
# What a layer keeps.

S, H = 32, 64


def _kept(sequence_parallel: bool, preset: str = "none") -> dict[str, list[tuple[str, tuple, int]]]:
    """(dtype, shape, bytes) of every storage each decoder layer keeps, bf16 Llama, TP 2."""
    nc.initialize_model_parallel(2)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=H, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=S,
                                   use_cache=False)  # fmt: skip
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).train()
    nc.apply_tensor_parallel(model, sequence_parallel=sequence_parallel)
    apply_recompute(model, RecomputeConfig.preset(preset))
    layers = model.model.layers
    ids = torch.randint(0, VOCAB, (1, S))
    with SavedTensorRecorder(exclude_modules=[model]) as rec:
        handles = rec.attach({f"layer{i}": layer for i, layer in enumerate(layers)})
        out = model(input_ids=ids, labels=ids)
        for handle in handles:
            handle.remove()
    out.loss.backward()
    kept: dict[str, list] = {}
    for s in rec.storages:
        kept.setdefault(s.scope, []).append((str(s.dtype), tuple(s.shape), s.nbytes))
    return kept


def _cut(row: tuple[str, tuple, int], t: int) -> int:
    """The bytes of a storage kept under TP once sequence parallel keeps s/t of its tokens: the
    whole-sequence [b, s, h] tensors (and their [b, s, 1] statistics) outside the split modules."""
    dtype, shape, nbytes = row
    whole = (len(shape) == 3 and shape[:2] == (1, S) and shape[2] in (H, 1)) or shape == (S, H)
    return nbytes // t if whole else nbytes


def test_sequence_parallel_cuts_what_lies_outside_the_split_modules_to_s_over_t(world):
    from neuron_ckpt.memory.shape import ModelShape, TrainingSetup
    from neuron_ckpt.memory.terms import LayerSpec, layer_terms

    tp, sp = world(2).run(_kept, False)[0], world(2).run(_kept, True)[0]
    for layer in ("layer0", "layer1"):
        assert sorted(_cut(row, 2) for row in tp[layer]) == sorted(n for *_, n in sp[layer]), (tp[layer], sp[layer])
    assert sum(n for *_, n in sp["layer1"]) < sum(n for *_, n in tp["layer1"])
    # The terms our own Llama keeps alike are the same bytes: the q/k/v and MLP projections' input
    # (the norms' output, s/t tokens) and the norms' fp32 1/rms; q, k, v and the MLP's split tensors.
    ours = layer_terms(ModelShape("llama", H, 4, 2, 96, 2, VOCAB), TrainingSetup(S, 1, 2, dtype="bf16",
                       attention="flash"), LayerSpec())[0]  # fmt: skip
    theirs = sorted(n for *_, n in sp["layer1"])
    for term in ours:
        if term.name in ("qkv_input", "mlp_input", "norm1_rstd_fp32", "norm2_rstd_fp32", "q", "k", "v", "gate", "up"):
            assert term.nbytes in theirs, (term, theirs)
            theirs.remove(term.nbytes)


def test_full_recompute_keeps_the_first_layers_input_split_too(world):
    kept = world(2).run(_kept, True, "full")[0]
    local_input = 1 * (S // 2) * H * 2  # [b, s/t, h] bf16
    assert [n for *_, n in kept["layer0"]] == [local_input] and [n for *_, n in kept["layer1"]] == [local_input], kept


# --------------------------------------------------------------------------------------------
# Bad input.


def _indivisible() -> str:
    nc.initialize_model_parallel(2)
    model = nc.apply_tensor_parallel(tiny("llama"), sequence_parallel=True)
    with pytest.raises(ValueError) as e:
        model(input_ids=torch.randint(0, VOCAB, (1, 13)))
    return str(e.value)


def test_a_sequence_that_does_not_split_is_one_line(world):
    for line in world(2).run(_indivisible):
        assert line == ("sequence parallel: sequence length 13 (dim 1 of [b, s, h]) is not divisible by the "
                        "tensor-parallel size 2"), line  # fmt: skip


def _unseeded_dropout() -> str:
    nc.initialize_model_parallel(2)
    with pytest.raises(ValueError) as e:
        nc.apply_tensor_parallel(tiny("phi3", 0.1), plan={"lm_head": "colwise_gather_output"}, sequence_parallel=True)
    return str(e.value)


def test_dropout_on_the_residual_stream_needs_the_tp_stream_seeded(world):
    for line in world(2).run(_unseeded_dropout):
        assert "model.layers.0.resid_attn_dropout drops out on this rank's tokens" in line, line
        assert "model_parallel_manual_seed" in line and "\n" not in line


def _distributed_input() -> str:
    nc.initialize_model_parallel(2)
    model = nc.apply_tensor_parallel(tiny("llama"), sequence_parallel=True)
    with pytest.raises(ValueError) as e:
        apply_recompute(model, RecomputeConfig.preset("full", distribute_saved_activations=True))
    return str(e.value)


def test_distributed_saved_activations_is_refused_under_sequence_parallel(world):
    # the input a checkpoint keeps is this rank's chunk already, not a replicated tensor to slice
    for line in world(2).run(_distributed_input):
        assert "distribute_saved_activations=True cannot be used with sequence_parallel=True" in line, line


def _layers_called_directly() -> bool:
    # A stack run without the model's own forward (as a pipeline stage would): the first layer
    # splits once, also when full recompute splits it before its checkpoint.
    nc.initialize_model_parallel(2)
    torch.manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, 12))
    outs = []
    for preset in ("none", "full"):
        model = nc.apply_tensor_parallel(tiny("llama"), sequence_parallel=True)
        apply_recompute(model, RecomputeConfig.preset(preset))
        base = model.model
        hidden = base.embed_tokens(ids)
        positions = torch.arange(12).unsqueeze(0)
        rotary = base.rotary_emb(hidden, positions)
        for layer in base.layers:
            hidden = layer(hidden, attention_mask=None, position_embeddings=rotary, position_ids=positions)
        outs.append(hidden)
        hidden.sum().backward()
    return tuple(outs[0].shape) == (2, 6, 32) and torch.equal(outs[0], outs[1])


def test_layers_called_on_their_own_split_the_sequence_once(world):
    assert world(2).run(_layers_called_directly) == [True, True]
