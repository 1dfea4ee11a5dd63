"""What sets each transformers family's layers apart, as transformers 5.24 implements them
(``models/<family>/modeling_<family>.py``): one :class:`Family` per ``model_type``, the families
:func:`neuron_ckpt.parallel.hf.apply_tensor_parallel` splits.

=============  ==================================================================================
family         what sets its layers apart (beside GQA attention, RMSNorms and a SwiGLU MLP)
=============  ==================================================================================
llama          nothing: the reference (biases, where a config asks for them, keep nothing)
mistral        a sliding window on every layer
qwen2          sliding windows on the layers ``layer_types`` names (``max_window_layers``)
qwen3          per-head q/k RMSNorms; sliding windows as Qwen2
gemma2         eager attention only, logits soft-capped (``tanh``); GeGLU; four norms a layer,
               each ``(1 + w)`` in fp32; sliding windows on alternate layers
phi3           fused ``qkv_proj`` and ``gate_up_proj``; RoPE writes new q, k (a ``cat``); its
               plan gathers q/k/v and the MLP: every rank computes them whole
mixtral        MoE: router softmax (fp32) -> top-k -> renormalised; a sliding window if set
qwen2_moe      MoE as Qwen3-MoE plus a shared expert gated by ``sigmoid(Linear(h, 1))``
qwen3_moe      MoE: Qwen3's q/k norms; softmax -> top-k (-> renormalised); ``mlp_only_layers``
olmoe          MoE: q/k RMSNorms over the whole projection; its plan gathers q/k/v
deepseek_v2    MLA split by heads; router softmax on an fp32 copy -> (group-limited) top-k,
               shared experts, the first ``first_k_dense_replace`` layers dense
deepseek_v3    MLA (replicated by its plan); router sigmoid -> +bias -> group top-k, shared experts
gpt_oss        eager attention with sinks; q/k/v/o biases; RMSNorm's weight in fp32; router with a
               bias, top-k then softmax; experts with biases and a clamped SwiGLU over
               interleaved gate/up; its plan splits no layer (only the embedding)
aria_text      MoE: top-k then softmax; shared experts; experts stored transposed
llama4_text    MoE over every expert (each token through all E, scaled by a sigmoid score),
               a shared expert; L2 q/k norms on RoPE layers, NoPE layers with temperature
               scaling, chunked attention; dense layers between MoE ones
=============  ==================================================================================

Under tensor parallelism each part splits as the family's ``base_model_tp_plan`` says
(:attr:`Family.split`): ``"heads"`` (colwise q/k/v, rowwise o), ``"gathered"`` (Phi-3, OLMoE:
``colwise_gather_output`` then ``rowwise_split_input``: the projections' outputs are gathered,
attention and the MLP run whole on every rank, the row layer keeps its ``1/t`` slice), or
``"whole"`` (not in the plan: replicated). ``tests/test_memory_families.py`` checks this table
against transformers' own plans.
"""

from __future__ import annotations

from dataclasses import dataclass

_SIZES = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")


@dataclass(frozen=True)
class Family:
    """One family's implementation, as its modeling file writes it.

    config_class: transformers' config class. norm: ``"rms"`` (``weight * x.to(dtype)``),
    ``"rms_fp32"`` (GPT-OSS: the weight multiplies the fp32 value), ``"gemma"`` (``(1 + w)`` in
    fp32). sandwich: a norm after attention and after the MLP too (Gemma2). qkv / mlp:
    ``"separate"`` projections or ``"fused"`` ones (Phi-3). qk_norm: ``"head"`` (per head, before
    RoPE), ``"proj"`` (over the whole projection), ``"l2"`` (weightless, after RoPE; Llama 4's
    RoPE layers). rope_copy: RoPE writes q and k into new ``[b, a, s, d]`` tensors (a ``cat``), so
    the attention output comes out in that layout and ``o_proj`` keeps a transposed copy.
    eager_only: transformers refuses sdpa (soft-capping, sinks). sinks: GPT-OSS's per-head sink
    logit. router / experts / shared: the MoE block's parts (None: a dense family). mla: DeepSeek's
    latent attention. routing_fp32: the routing weights
    stay fp32 (else the activation dtype). split: how the plan splits ``attention``, ``mlp`` (the dense MLP),
    ``experts``, ``shared``. required: the keys a file must give (aliases together), else
    transformers would silently use its default.
    """

    config_class: str
    split: dict[str, str]
    required: tuple[tuple[str, ...], ...]
    norm: str = "rms"
    sandwich: bool = False
    qkv: str = "separate"
    qk_norm: str | None = None
    rope_copy: bool = False
    eager_only: bool = False
    sinks: bool = False
    mlp: str = "separate"
    router: str | None = None
    experts: str | None = None
    shared: str | None = None
    mla: bool = False
    routing_fp32: bool = False

    @property
    def moe(self) -> bool:
        return self.router is not None


def _req(*names: str | tuple[str, ...]) -> tuple[tuple[str, ...], ...]:
    return tuple((n,) if isinstance(n, str) else n for n in (*_SIZES, *names))


def _split(attention: str, mlp: str, experts: str = "whole", shared: str = "whole") -> dict[str, str]:
    return {"attention": attention, "mlp": mlp, "experts": experts, "shared": shared}


_TOP_K = "num_experts_per_tok"
_MLA = (
    "kv_lora_rank",
    "qk_rope_head_dim",
    "qk_nope_head_dim",
    "v_head_dim",
    "n_shared_experts",
    "first_k_dense_replace",
)
FAMILY = {
    "llama": Family("LlamaConfig", _split("heads", "split"), _req("intermediate_size")),
    "mistral": Family("MistralConfig", _split("heads", "split"), _req("intermediate_size")),
    "qwen2": Family("Qwen2Config", _split("heads", "split"), _req("intermediate_size")),
    "qwen3": Family("Qwen3Config", _split("heads", "split"), _req("intermediate_size"), qk_norm="head"),
    "gemma2": Family("Gemma2Config", _split("heads", "split"), _req("intermediate_size"), norm="gemma",
                     sandwich=True, eager_only=True),
    "phi3": Family("Phi3Config", _split("gathered", "gathered"), _req("intermediate_size"), qkv="fused",
                   mlp="fused", rope_copy=True),
    "mixtral": Family("MixtralConfig", _split("heads", "whole", "split"),
                      _req("intermediate_size", ("num_local_experts", "num_experts"), _TOP_K),
                      router="softmax", experts="swiglu", routing_fp32=True),
    "qwen2_moe": Family("Qwen2MoeConfig", _split("heads", "split", "split"),
                        _req("moe_intermediate_size", "num_experts", "shared_expert_intermediate_size", _TOP_K),
                        router="softmax", experts="swiglu", shared="gated"),
    "qwen3_moe": Family("Qwen3MoeConfig", _split("heads", "split", "split"),
                        _req("moe_intermediate_size", ("num_experts", "num_local_experts"), _TOP_K),
                        qk_norm="head", router="softmax", experts="swiglu"),
    "olmoe": Family("OlmoeConfig", _split("gathered", "whole", "split"),
                    _req("intermediate_size", ("num_experts", "num_local_experts"), _TOP_K),
                    qk_norm="proj", router="softmax", experts="swiglu"),
    "deepseek_v2": Family("DeepseekV2Config", _split("heads", "split", "split", "split"),
                          _req("moe_intermediate_size", ("n_routed_experts", "num_experts"), *_MLA, _TOP_K),
                          router="softmax_fp32", experts="swiglu", shared="plain", mla=True, routing_fp32=True),
    "deepseek_v3": Family("DeepseekV3Config", _split("whole", "split", "split", "split"),
                          _req("moe_intermediate_size", ("n_routed_experts", "num_local_experts"), *_MLA,
                               "q_lora_rank", "n_group", "topk_group", _TOP_K),
                          router="sigmoid_group", experts="swiglu", shared="plain", mla=True, routing_fp32=True),
    "gpt_oss": Family("GptOssConfig", _split("whole", "whole"),
                      _req("intermediate_size", ("num_local_experts", "num_experts"), _TOP_K), norm="rms_fp32",
                      rope_copy=True, eager_only=True, sinks=True, router="topk_softmax", experts="clamped"),
    "aria_text": Family("AriaTextConfig", _split("heads", "whole", "split", "split"),
                        _req("intermediate_size", "moe_num_experts", "moe_topk"),
                        router="topk_softmax", experts="swiglu", shared="plain"),
    "llama4_text": Family("Llama4TextConfig", _split("heads", "split", "split", "split"),
                          _req("intermediate_size", "intermediate_size_mlp", "num_local_experts", _TOP_K),
                          qk_norm="l2", router="sigmoid_all", experts="all", shared="plain"),
}  # fmt: skip
FAMILIES = tuple(FAMILY)
DENSE_FAMILIES = tuple(name for name, f in FAMILY.items() if not f.moe)
MOE_FAMILIES = tuple(name for name, f in FAMILY.items() if f.moe)

# The transformers classes apply_tensor_parallel's plans live on: ``base_model_tp_plan`` entries
# that decide each part of :attr:`Family.split` (checked against transformers in the tests).
PLAN_KEYS = {
    "attention": ("self_attn.q_proj", "self_attn.qkv_proj", "self_attn.q_b_proj"),
    "mlp": ("mlp.gate_proj", "mlp.gate_up_proj", "feed_forward.gate_proj"),
    "experts": ("mlp.experts.gate_up_proj", "feed_forward.experts.gate_up_proj"),
    "shared": ("mlp.shared_experts.gate_proj", "mlp.shared_expert.gate_proj", "feed_forward.shared_expert.gate_proj"),
}


def split_from_plan(plan: dict[str, str], part: str) -> str:
    """What a transformers ``base_model_tp_plan`` does to ``part`` (as :attr:`Family.split` says it)."""
    styles = [plan[f"layers.*.{key}"] for key in PLAN_KEYS[part] if f"layers.*.{key}" in plan]
    if not styles:
        return "whole"
    if styles[0] == "colwise_gather_output":
        return "gathered"
    return "heads" if part == "attention" else "split"


__all__ = ["DENSE_FAMILIES", "FAMILIES", "FAMILY", "MOE_FAMILIES", "PLAN_KEYS", "Family", "split_from_plan"]
