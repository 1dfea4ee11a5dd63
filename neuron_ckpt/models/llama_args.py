"""``LlamaArgs``: the fields of a Llama model this library builds, typed and checked once.

A ``transformers.LlamaConfig`` carries a hundred attributes, most of them for generation, and
code that reads it with ``getattr(config, name, default)`` silently takes a default when a
field is misspelt or absent. :meth:`LlamaArgs.from_hf` reads the fields that define the model
once, resolves the ones ``transformers`` derives (``head_dim``, ``num_key_value_heads``, the
RoPE parameters of 4.x and 5.x), refuses what the model does not implement, and the model and
the memory tools take the result. Field names are ``transformers``' so a reader of either knows
them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any


def _rope_parameters(config: Any) -> dict[str, Any]:
    """``rope_type``, ``rope_theta`` and any scaling factors of a ``transformers`` 5.x or 4.x config."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    if not params:  # transformers 4.x: rope_theta and rope_scaling are separate fields
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params.setdefault("rope_type", params.pop("type", "default"))
    params.pop("type", None)
    params["rope_theta"] = float(params["rope_theta"])
    original = getattr(config, "original_max_position_embeddings", None)  # a top-level field of some configs
    if params["rope_type"] != "default" and original is not None:
        params.setdefault("original_max_position_embeddings", original)
    return params


@dataclass(frozen=True)
class LlamaArgs:
    """One Llama model's shape and numerics (Llama-2 / Llama-3 architecture: RMSNorm, GQA, RoPE,
    SwiGLU; embeddings tied or not). Every field is checked at construction."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    """The SwiGLU width (gate, up and down projections)."""
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int | None = None
    """Key/value heads (grouped-query attention); None means ``num_attention_heads`` (MHA)."""
    head_dim: int | None = None
    """None means ``hidden_size // num_attention_heads`` (which must then divide exactly)."""
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-5
    initializer_range: float = 0.02
    """Standard deviation of the normal initialisation of every weight matrix."""
    attention_dropout: float = 0.0
    attention_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    """The LM head is the embedding table (one parameter, as Llama-3.2 1B/3B); False: its own."""
    rope_parameters: dict[str, Any] = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    """``rope_type`` ("default", or a static scaled variant of ``transformers``: "linear",
    "llama3", "yarn", ...), ``rope_theta`` and the variant's own factors, as ``transformers`` 5.x
    spells them."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "max_position_embeddings"):
            _require_positive_int(name, getattr(self, name))
        heads = self.num_attention_heads
        if self.num_key_value_heads is None:
            object.__setattr__(self, "num_key_value_heads", heads)
        _require_positive_int("num_key_value_heads", self.num_key_value_heads)
        if heads % self.num_key_value_heads:
            raise ValueError(
                f"num_key_value_heads ({self.num_key_value_heads}) must divide num_attention_heads ({heads})"
            )
        if self.head_dim is None:
            if self.hidden_size % heads:
                raise ValueError(
                    f"hidden_size ({self.hidden_size}) must be a multiple of num_attention_heads ({heads}) "
                    "when head_dim is not given"
                )
            object.__setattr__(self, "head_dim", self.hidden_size // heads)
        _require_positive_int("head_dim", self.head_dim)
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even (RoPE rotates pairs), got {self.head_dim}")
        if not (isinstance(self.rms_norm_eps, (int, float)) and self.rms_norm_eps > 0):
            raise ValueError(f"rms_norm_eps must be a number > 0, got {self.rms_norm_eps!r}")
        if not (isinstance(self.initializer_range, (int, float)) and self.initializer_range >= 0):
            raise ValueError(f"initializer_range must be a number >= 0, got {self.initializer_range!r}")
        if not (isinstance(self.attention_dropout, (int, float)) and 0 <= self.attention_dropout < 1):
            raise ValueError(f"attention_dropout must be in [0, 1), got {self.attention_dropout!r}")
        for name in ("attention_bias", "mlp_bias", "tie_word_embeddings"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        rope = dict(self.rope_parameters)
        if "rope_type" not in rope or "rope_theta" not in rope:
            raise ValueError(f"rope_parameters must hold rope_type and rope_theta, got {rope!r}")
        if rope["rope_type"] == "dynamic":
            raise ValueError("rope_type='dynamic' (length-dependent RoPE scaling) is not supported; use a static variant")
        object.__setattr__(self, "rope_parameters", rope)

    @classmethod
    def from_hf(cls, config: Any) -> "LlamaArgs":
        """The args of a ``transformers.LlamaConfig`` (4.x or 5.x); refuses what is not built here:
        an activation other than SiLU, ``pretraining_tp`` other than 1."""
        if isinstance(config, LlamaArgs):
            return config
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act must be 'silu' (SwiGLU), got {act!r}")
        if (getattr(config, "pretraining_tp", 1) or 1) != 1:
            raise ValueError("pretraining_tp must be 1 (the sliced-matmul emulation is not reproduced)")
        values = {f.name: getattr(config, f.name, None) for f in fields(cls) if f.name != "rope_parameters"}
        values = {k: v for k, v in values.items() if v is not None}
        return cls(**values, rope_parameters=_rope_parameters(config))

    def to_hf(self):
        """The equivalent ``transformers.LlamaConfig`` (for exports and ``transformers``' RoPE init)."""
        import transformers

        values = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "rope_parameters"}
        config = transformers.LlamaConfig(**values, hidden_act="silu")
        rope = dict(self.rope_parameters)
        if hasattr(config, "rope_parameters"):  # transformers 5.x
            config.rope_parameters = rope
        else:  # 4.x: theta and the scaling dict apart
            config.rope_theta = rope.pop("rope_theta")
            config.rope_scaling = None if rope == {"rope_type": "default"} else rope
        return config


def _require_positive_int(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
