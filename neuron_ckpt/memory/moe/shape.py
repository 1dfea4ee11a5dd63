"""What the MoE memory model describes: a transformers mixture-of-experts model's sizes
(:class:`MoEShape`, with :class:`MLA` for DeepSeek's latent attention) and how a job runs it
(:class:`MoESetup`).

Four families, as transformers 5.24 implements them (``models/<family>/modeling_<family>.py``):

=============  ==============================================================================
family         what sets its layers apart
=============  ==============================================================================
mixtral        GQA; router softmax (fp32) -> top-k -> renormalised, weights kept fp32
qwen3_moe      GQA with per-head q/k RMSNorms; router softmax -> top-k (-> renormalised when
               ``norm_topk_prob``) -> cast to the activation dtype; dense ``mlp_only_layers``
qwen2_moe      GQA; Qwen3's router; a shared expert (an MLP) gated by ``sigmoid(Linear(h, 1))``
deepseek_v3    MLA; router on an fp32 copy: sigmoid -> +bias -> group top-k -> top-k of the
               unbiased scores (-> renormalised) -> x routed_scaling_factor; shared experts;
               the first ``first_k_dense_replace`` layers dense
=============  ==============================================================================

Under tensor parallelism each part splits as the family's ``base_model_tp_plan`` says
(:data:`SPLIT_BY_PLAN`): the experts' intermediate size always, GQA heads and dense MLPs
always, DeepSeek-V3's MLA never (its plan has no attention entry: replicated), Qwen2-MoE's
shared expert never (not in its plan), DeepSeek-V3's shared experts yes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ...checks import is_int, require_positive_int
from ..shape import DTYPE_BYTES

FAMILIES = ("mixtral", "qwen3_moe", "qwen2_moe", "deepseek_v3")
ATTENTION = ("sdpa", "eager", "sdpa-fused")
EXPERTS = ("grouped_mm", "eager")

# Which parts the family's transformers TP plan splits over the tensor-parallel group.
SPLIT_BY_PLAN = {
    "mixtral": {"attention": True, "shared": False},
    "qwen3_moe": {"attention": True, "shared": False},
    "qwen2_moe": {"attention": True, "shared": False},
    "deepseek_v3": {"attention": False, "shared": True},
}


@dataclass(frozen=True)
class MLA:
    """DeepSeek's multi-head latent attention: ``q_lora_rank`` (None: a plain ``q_proj``),
    ``kv_lora_rank``, and the per-head sizes of the query/key parts without and with RoPE and of
    the value."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    def __post_init__(self) -> None:
        if self.q_lora_rank is not None:
            require_positive_int("q_lora_rank", self.q_lora_rank)
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            require_positive_int(name, getattr(self, name))
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim must be even (RoPE rotates pairs), got {self.qk_rope_head_dim}")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True)
class MoEShape:
    """The sizes of one transformers MoE model.

    family: one of :data:`FAMILIES`. hidden, layers, heads, kv_heads, vocab: h, L, a, g, v.
    head_dim: the GQA head size d (ignored with ``mla``, whose head sizes are its own).
    experts, top_k, moe_ffn: E routed experts, k chosen per token, each expert's MLP width F.
    dense_ffn: the MLP width of the dense layers (``intermediate_size``); dense_layers: their
        indices (DeepSeek's first ``first_k_dense_replace``, Qwen's ``mlp_only_layers``).
    shared_ffn: the shared experts' MLP width (DeepSeek: ``moe_intermediate_size *
        n_shared_experts``; Qwen2-MoE: ``shared_expert_intermediate_size``); 0: none.
    norm_topk_prob: the top-k weights are renormalised (Mixtral always is).
    n_group, topk_group: DeepSeek's grouped routing.
    mla: DeepSeek's latent attention sizes (required for deepseek_v3, refused elsewhere).
    name: how reports call it.
    """

    family: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    experts: int
    top_k: int
    moe_ffn: int
    vocab: int
    dense_ffn: int = 0
    dense_layers: tuple[int, ...] = ()
    shared_ffn: int = 0
    norm_topk_prob: bool = True
    n_group: int = 1
    topk_group: int = 1
    mla: MLA | None = None
    name: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"family must be one of {FAMILIES}, got {self.family!r}")
        for name in (
            "hidden",
            "layers",
            "heads",
            "kv_heads",
            "head_dim",
            "experts",
            "top_k",
            "moe_ffn",
            "vocab",
            "n_group",
            "topk_group",
        ):
            require_positive_int(name, getattr(self, name))
        for name in ("dense_ffn", "shared_ffn"):
            value = getattr(self, name)
            if not is_int(value) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        if not isinstance(self.norm_topk_prob, bool):
            raise ValueError(f"norm_topk_prob must be a bool, got {self.norm_topk_prob!r}")
        object.__setattr__(self, "dense_layers", tuple(sorted(set(self.dense_layers))))
        if any(not is_int(i) or not 0 <= i < self.layers for i in self.dense_layers):
            raise ValueError(f"dense_layers must be layer indices in 0..{self.layers - 1}, got {self.dense_layers!r}")
        if self.dense_layers and not self.dense_ffn:
            raise ValueError(f"dense_ffn must be given (> 0) when there are dense layers {list(self.dense_layers)}")
        if self.top_k > self.experts:
            raise ValueError(f"top_k ({self.top_k}) must be at most experts ({self.experts})")
        if self.heads % self.kv_heads:
            raise ValueError(f"kv_heads ({self.kv_heads}) must divide heads ({self.heads})")
        if (self.family == "deepseek_v3") != (self.mla is not None):
            raise ValueError("mla: deepseek_v3 needs the MLA sizes, and only deepseek_v3 has them")
        if self.family == "deepseek_v3":
            if self.kv_heads != self.heads:  # transformers 5.24's MLA fails otherwise
                raise ValueError(f"kv_heads must equal heads ({self.heads}) for deepseek_v3, got {self.kv_heads}")
            if self.experts % self.n_group or not self.topk_group <= self.n_group:
                raise ValueError(
                    f"n_group ({self.n_group}) must divide experts ({self.experts}) and topk_group "
                    f"({self.topk_group}) be at most n_group"
                )
            if self.top_k > self.topk_group * self.experts // self.n_group:
                raise ValueError(
                    f"top_k ({self.top_k}) is more than the topk_group ({self.topk_group}) groups of "
                    f"{self.experts // self.n_group} experts hold"
                )
        if (self.family in ("qwen2_moe", "deepseek_v3")) != (self.shared_ffn > 0):
            raise ValueError(
                f"shared_ffn: {self.family} {'needs' if self.family in ('qwen2_moe', 'deepseek_v3') else 'has no'}"
                f" shared experts, got shared_ffn={self.shared_ffn}"
            )

    def is_dense(self, layer: int) -> bool:
        """Whether layer ``layer`` runs a dense MLP rather than an MoE block."""
        return layer in self.dense_layers

    @property
    def kinds(self) -> tuple[str, ...]:
        """The layer kinds this model has, dense first: ``("dense", "moe")`` or ``("moe",)``."""
        return ("dense", "moe") if self.dense_layers else ("moe",)

    def split(self, part: str, tp: int) -> int:
        """``tp`` when the family's plan splits ``part`` ("attention", "shared"), else 1."""
        return tp if SPLIT_BY_PLAN[self.family][part] else 1

    def valid_tp(self, tp: int) -> str | None:
        """Why ``tp`` cannot split this model as its plan says (None when it can)."""
        checks = [
            (self.moe_ffn % tp == 0, f"tp ({tp}) must divide the experts' ffn ({self.moe_ffn})"),
            (not self.dense_layers or self.dense_ffn % tp == 0, f"tp ({tp}) must divide dense_ffn ({self.dense_ffn})"),
        ]
        if self.split("attention", tp) > 1:
            checks += [
                (self.heads % tp == 0, f"tp ({tp}) must divide heads ({self.heads})"),
                (
                    self.kv_heads % tp == 0,
                    (
                        f"tp ({tp}) must divide kv_heads ({self.kv_heads}): transformers' "
                        "colwise k/v projections split whole heads"
                    ),
                ),
            ]
        if self.split("shared", tp) > 1:
            checks.append((self.shared_ffn % tp == 0, f"tp ({tp}) must divide shared_ffn ({self.shared_ffn})"))
        return next((why for ok, why in checks if not ok), None)


@dataclass(frozen=True)
class MoESetup:
    """How the job runs one layer, per rank.

    seq_len, micro_batch: s and b (T = s b tokens). tp: tensor-parallel degree (transformers'
    plan). sequence_parallel: ``apply_tensor_parallel(model, sequence_parallel=True)``: the
    token-wise parts (the norms, the residual stream) hold this rank's s/t tokens, the regions
    (attention, the MoE block, the dense MLP) gather the whole sequence (:mod:`.sequence`);
    False: ``[b, s, h]`` on every rank. Needs s divisible by t.
    dtype: the model's dtype ("bf16" | "fp16" | "fp32"); DeepSeek's router weight stays fp32,
    as ``from_pretrained`` keeps it. attention: transformers' attention implementation, "sdpa"
    (torch's CPU dispatch: the fused flash kernel where q, k and v share a head size and no mask
    is passed, the math path otherwise) or "eager"; "sdpa-fused" prices sdpa as a fused kernel
    whatever the head sizes (what CUDA's memory-efficient kernel keeps for MLA, whose head sizes
    differ; on CPU it is what runs wherever they are equal). experts: the experts implementation,
    "grouped_mm" (transformers' default) or "eager" (the per-expert loop).
    """

    seq_len: int
    micro_batch: int = 1
    tp: int = 1
    dtype: str = "bf16"
    attention: str = "sdpa"
    experts: str = "grouped_mm"
    sequence_parallel: bool = False

    def __post_init__(self) -> None:
        for name in ("seq_len", "micro_batch", "tp"):
            require_positive_int(name, getattr(self, name))
        if not isinstance(self.sequence_parallel, bool):
            raise ValueError(f"sequence_parallel must be a bool, got {self.sequence_parallel!r}")
        if self.sequence_parallel and self.seq_len % self.tp:
            raise ValueError(
                f"seq_len ({self.seq_len}) must be a multiple of tp ({self.tp}) when sequence_parallel "
                "is True (each rank holds s/t tokens)"
            )
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype must be one of {tuple(DTYPE_BYTES)}, got {self.dtype!r}")
        if self.attention not in ATTENTION:
            raise ValueError(f"attention must be one of {ATTENTION}, got {self.attention!r}")
        if self.experts not in EXPERTS:
            raise ValueError(f"experts must be one of {EXPERTS}, got {self.experts!r}")

    @property
    def width(self) -> int:
        """Bytes per activation element."""
        return DTYPE_BYTES[self.dtype]

    @property
    def tokens(self) -> int:
        return self.seq_len * self.micro_batch

    @property
    def local_tokens(self) -> int:
        """The tokens a token-wise part (a norm, the residual stream) holds on one rank: T/t under
        sequence parallel, else T."""
        return self.tokens // self.tp if self.sequence_parallel else self.tokens


__all__ = ["ATTENTION", "EXPERTS", "FAMILIES", "MLA", "MoESetup", "MoEShape", "SPLIT_BY_PLAN"]
