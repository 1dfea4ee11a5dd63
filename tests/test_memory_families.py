"""Every family ``apply_tensor_parallel`` splits is priced from the config files users have
(issue #50): ``neuron_ckpt.memory.moe`` reads any family's config.json as transformers does, and
what its real layers keep equals the analytic figure to the byte, at TP 1 and TP 2 + sequence
parallel, under every recompute module that applies and sets of them.

The configs are transformers' own: each family's config class with tiny sizes, written and read
back as a config.json (``to_dict``, ``save_pretrained``), so the reader meets the keys
transformers 5.24 writes (``layer_types``, ``rope_parameters``, ``dtype``...). The models run
through ``SavedTensorRecorder`` (parameters, rotary tables, positions and the masks the forward
hands every layer left out), one model per family and setup with each recompute choice applied
in turn. Counts are exact integers, so the comparison is equality: a tensor missed, counted
twice or of another dtype is at least a few hundred bytes off. The Mixtral, Qwen2/3-MoE and
DeepSeek-V3 layers are ``tests/test_memory_moe.py``'s.
"""

from __future__ import annotations

import functools
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from neuron_ckpt.memory.moe import FAMILY, MoESetup, layer_memory, load_moe_config, moe_shape_from_dict  # noqa: E402
from neuron_ckpt.memory.moe.compare import compare  # noqa: E402
from neuron_ckpt.memory.moe.families import PLAN_KEYS, split_from_plan  # noqa: E402
from neuron_ckpt.memory.moe.hf_config import hf_config  # noqa: E402
from neuron_ckpt.memory.moe.layer import CHOICES, applies  # noqa: E402

S, B = 16, 2  # T = 32 tokens; windows and chunks of 8 make sdpa take a mask
BASE = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=128)  # fmt: skip
MLA = dict(num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8)
TINY = {  # family: (extra config keys, (dtype, attention, experts)): each setup exercises a different path
    "llama": ({"intermediate_size": 96}, ("bf16", "sdpa", "grouped_mm")),
    "mistral": ({"intermediate_size": 96, "sliding_window": 8}, ("fp32", "sdpa", "grouped_mm")),  # masked, fp32
    "qwen2": ({"intermediate_size": 96, "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1},
              ("bf16", "sdpa", "grouped_mm")),  # layer 0 full, layer 1 sliding
    "qwen3": ({"intermediate_size": 96, "head_dim": 16}, ("bf16", "eager", "grouped_mm")),
    "gemma2": ({"intermediate_size": 96, "head_dim": 16, "sliding_window": 8}, ("fp32", "eager", "grouped_mm")),
    "phi3": ({"intermediate_size": 96, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2},
             ("bf16", "sdpa", "grouped_mm")),
    "olmoe": ({"intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2, "eos_token_id": 2},
              ("fp32", "eager", "eager")),
    "deepseek_v2": ({**MLA, "intermediate_size": 80, "moe_intermediate_size": 32, "n_routed_experts": 4,
                     "num_experts_per_tok": 2, "n_shared_experts": 1, "first_k_dense_replace": 1,
                     "topk_method": "group_limited_greedy", "n_group": 2, "topk_group": 1},
                    ("bf16", "sdpa", "grouped_mm")),
    "gpt_oss": ({"intermediate_size": 32, "num_local_experts": 4, "num_experts_per_tok": 2, "head_dim": 16,
                 "sliding_window": 8}, ("bf16", "eager", "grouped_mm")),
    "aria_text": ({"intermediate_size": 32, "moe_num_experts": 4, "moe_topk": 2}, ("bf16", "sdpa", "grouped_mm")),
    "llama4_text": ({"num_hidden_layers": 4, "interleave_moe_layer_step": 2, "intermediate_size": 32,
                     "intermediate_size_mlp": 48, "num_local_experts": 4, "num_experts_per_tok": 1, "head_dim": 16,
                     "attention_chunk_size": 8}, ("bf16", "sdpa", "grouped_mm")),  # dense and MoE, chunked and NoPE
}  # fmt: skip
MORE = [("gpt_oss", ("fp32", "eager", "eager")), ("llama4_text", ("fp32", "eager", "grouped_mm")),
        ("gemma2", ("bf16", "eager", "grouped_mm"))]  # fmt: skip
COMBOS = ("core_attn+norm", "norm+mlp+moe_act", "core_attn+mlp_act+shared_experts", "norm+moe")
CASES = [(family, setup) for family, (_, setup) in TINY.items()] + MORE


def config_dict(family: str, **overrides) -> dict:
    """The family's tiny config.json, as transformers writes it."""
    extra, _ = TINY[family]
    cls = getattr(transformers, FAMILY[family].config_class)
    return cls(**{**BASE, **extra, **overrides}).to_dict()


@functools.cache
def shape(family: str):
    return moe_shape_from_dict(config_dict(family), family, notices=[])


def choices(s) -> list[str]:
    """Every choice and set of choices that names only modules this model has somewhere."""
    kinds = s.kinds
    names = [c for c in (*CHOICES, *COMBOS) if all(any(applies(s, k, n) for k in kinds) for n in c.split("+"))]
    return list(dict.fromkeys(names))


def measure_cases(cases, tp: int = 1, sequence_parallel: bool = False) -> list[list[tuple[str, str, int]]]:
    """Per case, ``(kind, choice, bytes)`` of every layer on this rank (one model per case)."""
    if tp > 1:
        import neuron_ckpt as nc

        nc.initialize_model_parallel(tp)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: two threads on a loaded machine spin 100x longer
    try:
        out = []
        for family, setup in cases:
            s = shape(family)
            rows = compare(s, MoESetup(S, B, tp, *setup, sequence_parallel=sequence_parallel), choices(s))
            out.append([(r.kind, r.choice, r.measured) for r in rows])
        return out
    finally:
        torch.set_num_threads(threads)


def analytic(family: str, setup: MoESetup, kind: str, choice: str) -> int:
    return layer_memory(shape(family), setup, choice, kind).autograd_bytes


def test_measured_equals_analytic_at_tp1():
    for (family, setup), rows in zip(CASES, measure_cases(CASES)):
        s = MoESetup(S, B, 1, *setup)
        assert len(rows) >= 2 * len(shape(family).kinds)
        for kind, choice, measured in rows:
            assert measured == analytic(family, s, kind, choice), (family, setup, kind, choice)


def test_measured_equals_analytic_at_tp2_with_sequence_parallel_on_every_rank(world):
    """The family's own plan at TP 2 (gloo) with sequence parallel: heads and intermediate sizes
    split where the plan splits them, Phi-3's and OLMoE's projections gathered (attention and
    Phi-3's MLP whole, the row layer keeping its half), GPT-OSS's layers whole; the norms and the
    residual at s/t tokens."""
    ranks = world(2).run(measure_cases, CASES, 2, True)
    for i, (family, setup) in enumerate(CASES):
        s = MoESetup(S, B, 2, *setup, sequence_parallel=True)
        assert ranks[0][i] == ranks[1][i], (family, setup)
        for kind, choice, measured in ranks[0][i]:
            assert measured == analytic(family, s, kind, choice), (family, setup, kind, choice)


def test_layer_kinds_follow_the_config():
    """Sliding windows where ``layer_types`` puts them (Qwen2 from ``max_window_layers``, Gemma2
    alternating), Mistral's on every layer, Llama 4's dense, chunked and NoPE layers."""
    assert [shape(f).kinds for f in ("qwen2", "gemma2", "mistral", "llama")] == [
        ("dense", "dense/sliding"), ("dense/sliding", "dense"), ("dense/sliding",), ("dense",)]  # fmt: skip
    llama4 = shape("llama4_text")
    assert [llama4.kind_of(i) for i in range(4)] == ["dense/chunked", "moe/chunked", "dense/chunked", "moe/norope"]
    assert llama4.window == 8 and llama4.temperature_tuning and llama4.shared_ffn == 32 and llama4.dense_ffn == 48
    off = moe_shape_from_dict(config_dict("qwen2", use_sliding_window=False), "qwen2", notices=(said := []))
    assert off.kinds == ("dense",) and "max_window_layers" in said[0] and "sliding_window" in said[0]


@pytest.mark.parametrize("family", list(FAMILY))
def test_the_split_table_is_each_family_s_transformers_plan(family):
    plan = getattr(transformers, FAMILY[family].config_class)().base_model_tp_plan or {}
    assert {part: split_from_plan(plan, part) for part in PLAN_KEYS} == FAMILY[family].split


@pytest.mark.parametrize("family", list(TINY))
def test_written_configs_read_back_to_the_same_shape(family):
    """What the measurements build (``hf_config``) reads back (``moe_shape_from_dict``) to the shape."""
    s = shape(family)
    written = hf_config(s, MoESetup(S, B)).to_dict()
    assert moe_shape_from_dict(written, family, notices=[]) == s


# --- config files as users have them ------------------------------------------------------------

QWEN3_30B_A3B = {  # the hub's Qwen3-30B-A3B config.json, as transformers 4.51 wrote it
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144, "max_position_embeddings": 40960,
    "max_window_layers": 48, "mlp_only_layers": [], "model_type": "qwen3_moe", "moe_intermediate_size": 768,
    "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8,
    "num_hidden_layers": 48, "num_key_value_heads": 4, "output_router_logits": False, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.51.0", "use_cache": True,
    "use_sliding_window": False, "vocab_size": 151936,
}  # fmt: skip


def test_a_transformers_4_51_qwen3_moe_file_is_read_and_what_changes_nothing_named_once(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_30B_A3B))
    said: list[str] = []
    s = load_moe_config(tmp_path, said)
    assert (s.layers, s.experts, s.top_k, s.moe_ffn, s.head_dim, s.kv_heads, s.kinds) == (48, 128, 8, 768, 128, 4,
                                                                                          ("moe",))  # fmt: skip
    notice = f"{tmp_path / 'config.json'}: accepted, each of these alone changes nothing priced here: "
    assert len(said) == 1 and said[0].startswith(notice)
    named = said[0].split("nothing priced here: ")[1]
    for key in ("max_window_layers", "torch_dtype", "use_cache", "use_sliding_window", "rope_theta", "sliding_window"):
        assert key in named, key
    for key in ("num_experts", "moe_intermediate_size", "num_hidden_layers", "head_dim", "mlp_only_layers"):
        assert f" {key}," not in named and not named.startswith(key), key
    assert "(max_window_layers: not transformers.Qwen3MoeConfig fields)" in named  # 5.24 dropped it
    renamed = {k: v for k, v in QWEN3_30B_A3B.items() if k != "num_experts"} | {"num_local_experts": 128}
    assert moe_shape_from_dict(renamed, "renamed", notices=[]) == s  # attribute_map: the same key to transformers


@pytest.mark.parametrize("family", ["olmoe", "deepseek_v2", "gpt_oss", "mistral", "qwen2", "qwen3"])
def test_transformers_own_save_pretrained_files_are_read(tmp_path, family):
    extra, _ = TINY[family]
    config = getattr(transformers, FAMILY[family].config_class)(**{**BASE, **extra})
    config.save_pretrained(tmp_path)
    said: list[str] = []
    assert load_moe_config(tmp_path, said) == shape(family)
    assert len(said) == 1 and "transformers_version" not in said[0] and "use_cache" in said[0]


@pytest.mark.parametrize("family,change,needle", [
    ("qwen3_moe", {"num_hidden_layers": None, "num_hidden_layer": 48},
     ("missing key 'num_hidden_layers' (transformers would use its default 24; "
     "is 'num_hidden_layer' a misspelling of it?)")),
    ("mistral", {"sliding_window": None, "sliding_windw": 4096},
     "unknown key 'sliding_windw' (did you mean 'sliding_window'?)"),
    ("olmoe", {"clip_qkv": 8.0}, "clip_qkv is 8.0: the in-place clamps are not priced"),
    ("gemma2", {"hidden_activation": "relu"}, "the activation is 'relu'"),
    ("deepseek_v2", {"scoring_func": "sigmoid"},
     "scoring_func is 'sigmoid': transformers' deepseek_v2 implements 'softmax'"),
    ("bert", {}, "model_type is 'bert': this reads the families ['llama', 'mistral'"),
])  # fmt: skip
def test_what_matters_and_cannot_be_read_is_refused_in_one_line(family, change, needle):
    data = (
        QWEN3_30B_A3B if family == "qwen3_moe" else config_dict(family) if family != "bert" else {"model_type": "bert"}
    )
    data = {k: v for k, v in {**data, **change}.items() if v is not None or k not in change}
    with pytest.raises(ValueError) as e:
        moe_shape_from_dict(data, "config.json")
    assert needle in str(e.value) and "\n" not in str(e.value) and str(e.value).startswith("config.json: ")


def test_a_near_duplicate_beside_its_key_changes_nothing_and_is_named():
    """GPT-OSS's hub config carries ``experts_per_token`` beside ``num_experts_per_tok``: nothing
    is lost, so it is accepted (a misspelling is refused only where the key it misspells is absent)."""
    data = config_dict("gpt_oss") | {"experts_per_token": 2, "banana": 1}
    said: list[str] = []
    assert moe_shape_from_dict(data, "gpt-oss", notices=said) == shape("gpt_oss")
    assert "experts_per_token" in said[0] and "banana" in said[0]


@pytest.mark.parametrize("family", ["deepseek_v2", "gpt_oss", "llama4_text"])
def test_routing_replay_holds_each_topk_call_s_indices_outside_autograd(family, monkeypatch):
    """``moe`` replays the forward's routing: DeepSeek-V2's group-limited router calls ``topk``
    twice (groups, then experts), GPT-OSS's and Llama 4's once; the analytic ``outside`` terms
    are exactly what the replays hold."""
    from neuron_ckpt.memory.moe.measure import build_model, measure_layers
    from neuron_ckpt.recompute import routing

    replays, original = [], routing.RoutingReplay.__init__

    def init(self):
        original(self)
        replays.append(self)

    monkeypatch.setattr(routing.RoutingReplay, "__init__", init)
    s, setup = shape(family), MoESetup(S, B, 1, *TINY[family][1])
    measure_layers(build_model(s, setup, "moe"), setup, backward=False)
    moe = [s.kind_of(i) for i in range(s.layers) if not s.is_dense(i)]
    want = [sum(t.nbytes for t in layer_memory(s, setup, "moe", kind).outside) for kind in moe]
    assert [sum(t.numel() * t.element_size() for t in r.recorded) for r in replays] == want
    assert len(replays[0].recorded) == (2 if family == "deepseek_v2" else 1)


def test_a_multimodal_config_is_priced_through_its_text_config():
    """Llama 4's and Aria's hub config.json are their multimodal configs: the language model is
    their ``text_config``, read as its own family, with a notice saying so."""
    extra, _ = TINY["llama4_text"]
    said: list[str] = []
    wrapped = transformers.Llama4Config(text_config={**BASE, **extra}).to_dict()
    assert moe_shape_from_dict(wrapped, "llama4", notices=said) == shape("llama4_text")
    assert said[0].startswith("llama4: model_type 'llama4': its text_config (the language model) is priced")
