"""Recompute on transformers models (issue #27): apply_recompute takes the *ForCausalLM users hold;
selective recomputes only the attention function (registered in transformers' AttentionInterface),
bit-exact with dropout; the KV cache is turned off in training with one warning."""

import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from neuron_ckpt.recompute import Recompute, RecomputeConfig, apply_recompute, remove_recompute  # noqa: E402

MODELS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", "transformers.models.llama.modeling_llama"),
    "mistral": ("MistralConfig", "MistralForCausalLM", "transformers.models.mistral.modeling_mistral"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", "transformers.models.qwen2.modeling_qwen2"),
}


def tiny(kind: str, attn: str = "eager", use_cache: bool = False):
    config_cls, model_cls, _ = MODELS[kind]
    config = getattr(transformers, config_cls)(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, attention_dropout=0.1, use_cache=use_cache,
    )  # fmt: skip
    config._attn_implementation = attn
    torch.manual_seed(0)
    return getattr(transformers, model_cls)(config).train()


def loss_and_grads(model):
    torch.manual_seed(1)
    ids = torch.randint(0, 64, (2, 12))
    torch.manual_seed(2)  # the dropout masks
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def assert_bit_exact(a, b):
    assert torch.equal(a[0], b[0]), (a[0], b[0])
    assert a[1].keys() == b[1].keys()
    for name in a[1]:
        assert torch.equal(a[1][name], b[1][name]), name


@pytest.mark.parametrize("kind", list(MODELS))
@pytest.mark.parametrize("preset", ["none", "selective", "full"])
def test_presets_on_causal_lm_are_bit_exact_with_dropout(kind, preset):
    reference = loss_and_grads(tiny(kind))
    model = tiny(kind)
    names = apply_recompute(model, RecomputeConfig.preset(preset))
    assert names == {"none": [], "selective": ["0.core_attn", "1.core_attn"], "full": ["0", "1"]}[preset]
    assert_bit_exact(loss_and_grads(model), reference)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("kind", list(MODELS))
def test_selective_recomputes_only_the_attention_function(kind, attn, monkeypatch):
    reference = loss_and_grads(tiny(kind, attn))
    model = tiny(kind, attn)
    apply_recompute(model, RecomputeConfig.preset("selective"))
    assert model.config._attn_implementation == f"recompute_{attn}"

    calls = {"attention": 0, "q_proj": 0}
    if attn == "eager":  # looked up in the modeling file at each call, so a patch is seen
        module = __import__(MODELS[kind][2], fromlist=["x"])
        original, where, key = module.eager_attention_forward, module, "eager_attention_forward"
    else:
        from transformers.integrations import sdpa_attention

        original, key = sdpa_attention.sdpa_attention_forward, "sdpa"
        where = transformers.AttentionInterface._global_mapping

    def counted(*args, **kwargs):
        calls["attention"] += 1
        return original(*args, **kwargs)

    if attn == "eager":
        monkeypatch.setattr(where, key, counted)
    else:
        monkeypatch.setitem(where, key, counted)
    first = model.model.layers[0]
    first.self_attn.q_proj.register_forward_hook(lambda *_: calls.__setitem__("q_proj", calls["q_proj"] + 1))

    assert_bit_exact(loss_and_grads(model), reference)
    layers = len(model.model.layers)
    assert calls == {"attention": 2 * layers, "q_proj": 1}  # forward + one recompute each; projections once

    remove_recompute(model)
    assert model.config._attn_implementation == attn
    calls.update(attention=0, q_proj=0)
    assert_bit_exact(loss_and_grads(model), reference)
    assert calls == {"attention": layers, "q_proj": 1}


@pytest.mark.parametrize("preset", ["selective", "full"])
def test_use_cache_default_true_is_turned_off_with_one_warning(preset):
    reference = loss_and_grads(tiny("llama"))
    model = tiny("llama", use_cache=True)
    apply_recompute(model, RecomputeConfig.preset(preset))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = loss_and_grads(model)
        second = loss_and_grads(model)
    ours = [w for w in caught if "use_cache" in str(w.message)]
    assert len(ours) == 1, [str(w.message) for w in caught]
    assert_bit_exact(first, reference)
    assert_bit_exact(second, reference)
    model.eval()
    with torch.no_grad():  # generation-style calls keep their cache
        out = model(input_ids=torch.zeros(1, 4, dtype=torch.long))
    assert out.cache is not None


def test_a_cache_passed_in_training_fails_before_the_step():
    model = tiny("llama")
    apply_recompute(model, RecomputeConfig.preset("full"))
    cache = transformers.DynamicCache(config=model.config)
    with pytest.raises(ValueError, match="KV cache"):
        model(input_ids=torch.zeros(1, 4, dtype=torch.long), cache=cache)


def test_base_model_selective_mlp_act_and_norm_and_remove():
    # bf16, as models train: the output-discarding norm returns its input's gradient as one sum,
    # which autograd then adds to the residual's. An fp32 RMSNorm reads its input twice (its
    # .float() is a no-op), so in fp32 the three terms are added in another order: same numbers up
    # to rounding. In bf16 .float() is a copy, one term: bit-exact.
    reference = loss_and_grads(tiny("qwen2").to(torch.bfloat16))
    model = tiny("qwen2").to(torch.bfloat16)
    config = RecomputeConfig(granularity="selective", modules=["core_attn", "mlp_act", "norm"])
    names = apply_recompute(model.model, config)
    assert sorted(names) == sorted(
        f"{i}.{m}" for i in range(2) for m in ("core_attn", "mlp.act_fn", "input_layernorm", "post_attention_layernorm")
    )
    assert_bit_exact(loss_and_grads(model), reference)
    remove_recompute(model)
    assert model.config._attn_implementation == "eager"
    assert not any(isinstance(m, Recompute) for m in model.modules())
    assert not model.model._forward_pre_hooks


def test_module_map_core_attn_keeps_the_module_path_and_per_layer_lists():
    reference = loss_and_grads(tiny("mistral"))
    model = tiny("mistral")
    assert apply_recompute(model, RecomputeConfig.preset("selective"), module_map={"core_attn": "self_attn"}) == [
        "0.self_attn", "1.self_attn",
    ]  # fmt: skip
    assert model.config._attn_implementation == "eager"
    assert_bit_exact(loss_and_grads(model), reference)
    names = apply_recompute(model, [RecomputeConfig.preset("full"), RecomputeConfig.preset("selective")])
    assert names == ["0", "1.core_attn"]
    assert_bit_exact(loss_and_grads(model), reference)
