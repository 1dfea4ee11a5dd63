"""What the transformers-layer memory model describes: a model's sizes (:class:`MoEShape`, with
:class:`MLA` for DeepSeek's latent attention) and how a job runs it (:class:`MoESetup`).

The names are the package's first families' (mixture-of-experts); a shape describes any family
of :mod:`.families`, dense ones (Llama, Mistral, Qwen2/3, Gemma2, Phi-3) as models whose every
layer is dense. A layer's *kind* is its MLP (``"dense"`` or ``"moe"``) and, where it is not plain
causal attention, its attention variant: ``"dense/sliding"`` (a sliding window), ``"moe/chunked"``
(Llama 4's chunked attention), ``"moe/norope"`` (Llama 4's NoPE layers).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ...checks import is_int, require_positive_int
from ..shape import DTYPE_BYTES
from .families import FAMILIES, FAMILY

ATTENTION = ("sdpa", "eager", "sdpa-fused")
EXPERTS = ("grouped_mm", "eager")
VARIANTS = ("full", "sliding", "chunked", "norope")
TOPK_METHODS = ("greedy", "group_limited_greedy")
EP_ROWS = ("balanced", "worst")
EP_DISPATCH = ("all_to_all", "all_gather")
SPLIT_BY_PLAN = {name: family.split for name, family in FAMILY.items()}


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
    """The sizes of one transformers model.

    family: one of :data:`~.families.FAMILIES`. hidden, layers, heads, kv_heads, vocab: h, L, a,
    g, v. head_dim: the GQA head size d (ignored with ``mla``, whose head sizes are its own).
    experts, top_k, moe_ffn: E routed experts, k chosen per token, each expert's MLP width F (0
    for a dense family). dense_ffn: the MLP width of the dense layers (``intermediate_size``;
    Llama 4's ``intermediate_size_mlp``); dense_layers: their indices (every layer of a dense
    family; DeepSeek's first ``first_k_dense_replace``, Qwen's ``mlp_only_layers``, Llama 4's
    layers outside ``moe_layers``). shared_ffn: the shared experts' MLP width; 0: none.
    norm_topk_prob: the top-k weights are renormalised (Mixtral always is). n_group, topk_group:
    DeepSeek's grouped routing; topk_method: DeepSeek-V2's (``greedy`` or
    ``group_limited_greedy``). mla: DeepSeek's latent attention sizes.
    attention_types: each layer's variant (:data:`VARIANTS`; empty: every layer ``full``);
    window: the sliding window or attention chunk, in tokens (0: none). softcap: Gemma2's
    attention logits soft-capped. qk_norm / temperature_tuning: Llama 4's L2 q/k norms (RoPE
    layers) and its NoPE layers' query scaling. tied_embeddings: the LM head is the embedding.
    name: how reports call it.
    """

    family: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    experts: int = 0
    top_k: int = 0
    moe_ffn: int = 0
    vocab: int = field(kw_only=True)
    dense_ffn: int = 0
    dense_layers: tuple[int, ...] = ()
    shared_ffn: int = 0
    norm_topk_prob: bool = True
    n_group: int = 1
    topk_group: int = 1
    topk_method: str = "greedy"
    mla: MLA | None = None
    attention_types: tuple[str, ...] = ()
    window: int = 0
    softcap: bool = False
    qk_norm: bool = True
    temperature_tuning: bool = False
    tied_embeddings: bool = False
    name: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"family must be one of {FAMILIES}, got {self.family!r}")
        traits = FAMILY[self.family]
        for name in ("hidden", "layers", "heads", "kv_heads", "head_dim", "vocab", "n_group", "topk_group"):
            require_positive_int(name, getattr(self, name))
        for name in ("experts", "top_k", "moe_ffn", "dense_ffn", "shared_ffn", "window"):
            value = getattr(self, name)
            if not is_int(value) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        for name in ("norm_topk_prob", "softcap", "qk_norm", "temperature_tuning", "tied_embeddings"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if not traits.moe:
            object.__setattr__(self, "dense_layers", tuple(range(self.layers)))
            if self.experts or self.top_k or self.moe_ffn:
                raise ValueError(f"experts, top_k, moe_ffn: {self.family} is a dense family, give 0")
        else:
            for name in ("experts", "top_k", "moe_ffn"):
                require_positive_int(name, getattr(self, name))
            if self.top_k > self.experts:
                raise ValueError(f"top_k ({self.top_k}) must be at most experts ({self.experts})")
        object.__setattr__(self, "dense_layers", tuple(sorted(set(self.dense_layers))))
        if any(not is_int(i) or not 0 <= i < self.layers for i in self.dense_layers):
            raise ValueError(f"dense_layers must be layer indices in 0..{self.layers - 1}, got {self.dense_layers!r}")
        if self.dense_layers and not self.dense_ffn:
            raise ValueError(f"dense_ffn must be given (> 0) when there are dense layers {list(self.dense_layers)}")
        if self.heads % self.kv_heads:
            raise ValueError(f"kv_heads ({self.kv_heads}) must divide heads ({self.heads})")
        self._check_variants()
        self._check_family(traits)

    def _check_variants(self) -> None:
        types = self.attention_types
        if types and (len(types) != self.layers or any(v not in VARIANTS for v in types)):
            raise ValueError(f"attention_types must give one of {VARIANTS} for each of the {self.layers} layers")
        if any(v in ("sliding", "chunked") for v in types) and not self.window:
            raise ValueError("window must be given (> 0) when layers use a sliding window or chunked attention")

    def _check_family(self, traits) -> None:
        if traits.mla != (self.mla is not None):
            raise ValueError(f"mla: {self.family} {'needs' if traits.mla else 'has no'} MLA sizes")
        if (traits.shared is not None) != (self.shared_ffn > 0):
            raise ValueError(
                f"shared_ffn: {self.family} {'needs' if traits.shared else 'has no'} shared experts, "
                f"got shared_ffn={self.shared_ffn}"
            )
        if self.topk_method not in TOPK_METHODS:
            raise ValueError(f"topk_method must be one of {TOPK_METHODS}, got {self.topk_method!r}")
        if traits.mla and self.kv_heads != self.heads:  # transformers 5.24's MLA fails otherwise
            raise ValueError(f"kv_heads must equal heads ({self.heads}) for {self.family}, got {self.kv_heads}")
        grouped = traits.router == "sigmoid_group" or (
            self.family == "deepseek_v2" and self.topk_method == "group_limited_greedy"
        )
        if grouped:
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

    def is_dense(self, layer: int) -> bool:
        """Whether layer ``layer`` runs a dense MLP rather than an MoE block."""
        return layer in self.dense_layers

    def variant(self, layer: int) -> str:
        """Layer ``layer``'s attention variant (:data:`VARIANTS`)."""
        return self.attention_types[layer] if self.attention_types else "full"

    def kind_of(self, layer: int) -> str:
        """Layer ``layer``'s kind: ``"dense"`` / ``"moe"``, with ``/<variant>`` unless plain."""
        mlp, variant = "dense" if self.is_dense(layer) else "moe", self.variant(layer)
        return mlp if variant == "full" else f"{mlp}/{variant}"

    @property
    def kinds(self) -> tuple[str, ...]:
        """The layer kinds this model has, in the order of their first layer."""
        return tuple(dict.fromkeys(self.kind_of(i) for i in range(self.layers)))

    def count(self, kind: str) -> int:
        """How many layers are of ``kind``."""
        return sum(self.kind_of(i) == kind for i in range(self.layers))

    def split(self, part: str, tp: int) -> int:
        """``tp`` when the family's plan splits ``part`` (``attention`` by heads, ``mlp``,
        ``experts``, ``shared``), else 1 (``gathered`` parts run whole on every rank)."""
        return tp if FAMILY[self.family].split[part] in ("heads", "split") else 1

    def valid_tp(self, tp: int) -> str | None:
        """Why ``tp`` cannot split this model as its plan says (None when it can)."""
        split = FAMILY[self.family].split
        checks = []
        if split["experts"] == "split" and self.moe_ffn:
            checks.append((self.moe_ffn % tp == 0, f"tp ({tp}) must divide the experts' ffn ({self.moe_ffn})"))
        if split["mlp"] != "whole" and self.dense_layers:
            checks.append((self.dense_ffn % tp == 0, f"tp ({tp}) must divide dense_ffn ({self.dense_ffn})"))
        if split["attention"] == "gathered":  # the projections' outputs split, then gathered: no whole heads needed
            q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
            checks.append((q % tp == 0 and kv % tp == 0, f"tp ({tp}) must divide the q and k/v widths ({q}, {kv})"))
        elif split["attention"] == "heads" and self.mla is None:
            checks += [
                (self.heads % tp == 0, f"tp ({tp}) must divide heads ({self.heads})"),
                (
                    self.kv_heads % tp == 0,
                    (
                        f"tp ({tp}) must divide kv_heads ({self.kv_heads}): transformers' colwise k/v "
                        "projections split whole heads"
                    ),
                ),
            ]
        elif split["attention"] == "heads":
            checks.append((self.heads % tp == 0, f"tp ({tp}) must divide heads ({self.heads})"))
        if split["shared"] == "split" and self.shared_ffn:
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
    (torch's CPU dispatch: the fused flash kernel where q, k and v share a head size, the math
    path otherwise) or "eager" (Gemma2's and GPT-OSS's only one); "sdpa-fused" prices sdpa as a
    fused kernel whatever the head sizes (what CUDA's memory-efficient kernel keeps for MLA, whose
    head sizes differ; on CPU it is what runs wherever they are equal). experts: the experts
    implementation, "grouped_mm" (transformers' default) or "eager" (the per-expert loop).
    ep: expert_model_parallel_size e (``initialize_model_parallel(expert_model_parallel_size=e)``):
    each rank holds E/e whole experts (expert tensor parallel size 1) and dispatches its tokens to
    them (``ep_dispatch``: :mod:`neuron_ckpt.parallel.experts`); 1: no expert parallelism.
    ep_rows: the rows the all-to-all brings this rank's experts at e > 1, which routing decides:
    ``"balanced"`` (every expert the same share: T' k, T' this rank's dispatched tokens),
    ``"worst"`` (dropless worst case: every token of the e ranks sends all its routes that can
    land here, e T' min(k, E/e)), or an int (the count a real routing made); the all-to-all's only.
    ep_dispatch: how tokens reach the experts at e > 1 (``ExpertDispatch.form``): ``"all_to_all"``
    (dropless, uneven splits: eager backends) or ``"all_gather"`` (XLA's static form: every rank
    gathers the group's ``e T'`` tokens and runs its experts on ``E/e x capacity`` slots, whatever
    the routing: :mod:`.all_gather`). capacity_factor: the all-gather form's
    ``ExpertDispatch.capacity_factor`` (slots per expert ``ceil(e T' k / E x cf)``, at most
    ``e T'``); None: dropless (``e T'`` slots per expert).
    """

    seq_len: int
    micro_batch: int = 1
    tp: int = 1
    dtype: str = "bf16"
    attention: str = "sdpa"
    experts: str = "grouped_mm"
    sequence_parallel: bool = False
    ep: int = 1
    ep_rows: str | int = "balanced"
    ep_dispatch: str = "all_to_all"
    capacity_factor: float | None = None

    def __post_init__(self) -> None:
        for name in ("seq_len", "micro_batch", "tp", "ep"):
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
        rows = self.ep_rows
        if rows not in EP_ROWS and not (is_int(rows) and rows >= 0):
            raise ValueError(f"ep_rows must be one of {EP_ROWS} or an int >= 0 (rows received), got {rows!r}")
        self._check_dispatch()
        if self.ep > 1 and self.seq_len % self.tp:
            raise ValueError(
                f"seq_len ({self.seq_len}) must be a multiple of tp ({self.tp}) when ep > 1 (each tensor-parallel "
                "rank dispatches its own s/t tokens)"
            )

    def _check_dispatch(self) -> None:
        if self.ep_dispatch not in EP_DISPATCH:
            raise ValueError(f"ep_dispatch must be one of {EP_DISPATCH}, got {self.ep_dispatch!r}")
        cf = self.capacity_factor
        if cf is not None and (isinstance(cf, bool) or not isinstance(cf, (int, float)) or not cf > 0):
            raise ValueError(f"capacity_factor must be None (dropless) or a number > 0, got {cf!r}")
        if cf is not None and self.ep_dispatch != "all_gather":
            raise ValueError(f"capacity_factor ({cf}) applies to ep_dispatch='all_gather'; 'all_to_all' is dropless")
        if self.ep_dispatch == "all_gather" and self.ep_rows != "balanced":
            raise ValueError(
                f"ep_rows ({self.ep_rows!r}) applies to ep_dispatch='all_to_all'; the all-gather form's experts "
                "run E/e x capacity slots whatever the routing"
            )

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

    @property
    def dispatched_tokens(self) -> int:
        """The tokens this rank sends to the experts at ep > 1: each tensor-parallel rank its own
        s/t of the sequence (with or without sequence parallel), T/t."""
        return self.tokens // self.tp


__all__ = ["ATTENTION", "EP_DISPATCH", "EP_ROWS", "EXPERTS", "FAMILIES", "MLA", "SPLIT_BY_PLAN", "TOPK_METHODS",
           "VARIANTS", "MoESetup", "MoEShape"]  # fmt: skip
