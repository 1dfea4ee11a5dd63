"""``LlamaArgs``: the fields of a Llama model this library builds, typed and checked once.

A ``transformers.LlamaConfig`` carries a hundred attributes, most of them for generation, and
code that reads it with ``getattr(config, name, default)`` silently takes a default when a
field is misspelt or absent. :meth:`LlamaArgs.from_dict` reads the fields that define the model
from a ``config.json`` object (:func:`.config_file.load_llama_config` reads files strictly into
it), :meth:`LlamaArgs.from_hf` from a ``transformers`` config; both resolve the RoPE parameters
of ``transformers`` 4.x and 5.x and refuse what the model does not implement, and the model and
the memory tools take the result. Field names and defaults are ``transformers``' so a reader of
either knows them, and a ``config.json`` means the same model here and there.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from ..checks import is_int, positive_int_problem

PARAMETER_SHAPE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                          "num_attention_heads", "num_key_value_heads")  # fmt: skip
"""The sizes that fix the parameters' shapes, in the order training checkpoints record them
(``meta.json``'s ``"model"``, compared on resume; checkpoints already written hold these six).
``head_dim``, the biases and ``tie_word_embeddings`` shape parameters too, and are not in it."""

_SCALED_FROM_ORIGINAL = ("llama3", "yarn", "longrope")  # RoPE variants with an original length


@dataclass(frozen=True)
class LlamaArgs:
    """One Llama model's shape and numerics (Llama-2 / Llama-3 architecture: RMSNorm, GQA, RoPE,
    SwiGLU; embeddings tied or not). Every field is checked at construction: one ``ValueError``
    naming every field that is wrong and what it allows."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    """The SwiGLU width (gate, up and down projections)."""
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int = None  # type: ignore[assignment]  # None: derived when validated
    """Key/value heads (grouped-query attention); None means ``num_attention_heads`` (MHA)."""
    head_dim: int = None  # type: ignore[assignment]  # None: derived when validated
    """None means ``hidden_size // num_attention_heads`` (which must then divide exactly)."""
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
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
    bos_token_id: int | None = field(default=1, compare=False)
    """The tokenizer's ids, carried to an exported ``config.json`` (``transformers``' generation
    reads them). They do not change the model: ``==`` does not compare them."""
    eos_token_id: int | list[int] | None = field(default=2, compare=False)
    pad_token_id: int | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        problems = self._type_problems()
        if not problems:
            problems = self._resolve()
        if problems:
            raise ValueError("; ".join(problems))

    def _type_problems(self) -> list[str]:
        problems = [positive_int_problem(name, getattr(self, name)) for name in (
            "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "max_position_embeddings")]  # fmt: skip
        problems += [positive_int_problem(name, getattr(self, name)) for name in ("num_key_value_heads", "head_dim")
                     if getattr(self, name) is not None]  # fmt: skip
        problems += [
            _number_problem("rms_norm_eps", self.rms_norm_eps, above=0.0),
            _number_problem("initializer_range", self.initializer_range, at_least=0.0),
            _number_problem("attention_dropout", self.attention_dropout, at_least=0.0, below=1.0),
        ]
        for name in ("attention_bias", "mlp_bias", "tie_word_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                problems.append(f"{name} must be true or false, got {value!r} ({type(value).__name__})")
        for name in ("bos_token_id", "pad_token_id", "eos_token_id"):
            value = getattr(self, name)
            ids = value if name == "eos_token_id" and isinstance(value, list) else [value]
            if value is not None and not all(is_int(i) and i >= 0 for i in ids):
                some = ", a list of them" if name == "eos_token_id" else ""
                problems.append(f"{name} must be a token id (an integer >= 0){some} or None, got {value!r}")
        rope = self.rope_parameters
        if not isinstance(rope, dict) or not isinstance(rope.get("rope_type"), str):
            problems.append(f"rope_parameters must be a dict with a rope_type string and rope_theta, got {rope!r}")
        else:
            problems.append(_number_problem("rope_theta", rope.get("rope_theta"), above=0.0))
            if rope["rope_type"] == "dynamic":
                problems.append(
                    "rope_type='dynamic' (length-dependent RoPE scaling) is not supported; use a static variant"
                )
        return [p for p in problems if p]

    def _resolve(self) -> list[str]:
        """Fill the derived fields (kv heads, head_dim) and check the head counts against the width."""
        heads = self.num_attention_heads
        if self.num_key_value_heads is None:
            object.__setattr__(self, "num_key_value_heads", heads)
        if heads % self.num_key_value_heads:
            return [f"num_key_value_heads ({self.num_key_value_heads}) must divide num_attention_heads ({heads})"]
        if self.head_dim is None:
            if self.hidden_size % heads:
                return [
                    (
                        f"hidden_size ({self.hidden_size}) must be a multiple of num_attention_heads ({heads}) "
                        "when head_dim is not given"
                    )
                ]
            object.__setattr__(self, "head_dim", self.hidden_size // heads)
        if self.head_dim % 2:
            return [f"head_dim must be even (RoPE rotates pairs), got {self.head_dim}"]
        object.__setattr__(
            self, "rope_parameters", {**self.rope_parameters, "rope_theta": float(self.rope_parameters["rope_theta"])}
        )
        if isinstance(self.eos_token_id, list):
            object.__setattr__(self, "eos_token_id", list(self.eos_token_id))
        return []

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LlamaArgs:
        """The args of a ``config.json`` object (``transformers`` 4.x or 5.x names): the fields by
        name (absent: the defaults), the RoPE parameters from ``rope_parameters`` (5.x) or
        ``rope_theta`` and ``rope_scaling`` (4.x). Keys that are not fields are not read, except
        what is refused because it is not built here: ``hidden_act`` other than ``silu``,
        ``pretraining_tp`` other than 1. One ``ValueError`` naming every problem."""
        problems = []
        act = data.get("hidden_act", "silu")
        if act != "silu":
            problems.append(f"hidden_act must be 'silu' (SwiGLU), got {act!r}")
        tp = data.get("pretraining_tp")
        if tp is not None and not (is_int(tp) and tp == 1):
            problems.append(f"pretraining_tp must be 1 (the sliced-matmul emulation is not reproduced), got {tp!r}")
        values = {f.name: data[f.name] for f in fields(cls) if f.name in data and f.name != "rope_parameters"}
        try:
            values["rope_parameters"] = _rope_parameters(data, values.get("max_position_embeddings", 2048))
        except ValueError as e:
            problems.append(str(e))
        args = None
        try:
            args = cls(**values)
        except ValueError as e:
            problems.append(str(e))
        if problems:
            raise ValueError("; ".join(problems))
        assert args is not None  # no problems: it was built
        return args

    @classmethod
    def from_hf(cls, config: Any) -> LlamaArgs:
        """The args of a ``transformers.LlamaConfig`` (4.x or 5.x; any object with its attributes),
        through :meth:`from_dict`; a ``LlamaArgs`` as it is."""
        if isinstance(config, LlamaArgs):
            return config
        names = [f.name for f in fields(cls)] + ["hidden_act", "pretraining_tp", "original_max_position_embeddings"]
        if not getattr(config, "rope_parameters", None):  # transformers 4.x (5.x aliases rope_scaling)
            names += ["rope_theta", "rope_scaling"]
        return cls.from_dict({name: getattr(config, name) for name in names if hasattr(config, name)})

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


def _number_problem(
    name: str, value: Any, above: float | None = None, at_least: float | None = None, below: float | None = None
) -> str | None:
    """Why ``value`` is not a finite number in the range (None when it is)."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if (
        number
        and (above is None or value > above)
        and (at_least is None or value >= at_least)
        and (below is None or value < below)
    ):
        return None
    bounds = [f"> {above:g}" if above is not None else None, f">= {at_least:g}" if at_least is not None else None,
              f"< {below:g}" if below is not None else None]  # fmt: skip
    return f"{name} must be a number {' and '.join(b for b in bounds if b)}, got {value!r} ({type(value).__name__})"


def _rope_parameters(data: Mapping[str, Any], max_position_embeddings: Any) -> dict[str, Any]:
    """``rope_type``, ``rope_theta`` and the scaling factors of a 5.x (``rope_parameters``) or 4.x
    (``rope_theta``, ``rope_scaling``) config, standardised as ``transformers`` 5.x does (``type``
    is ``rope_type``; llama3 / yarn / longrope take their original length from
    ``max_position_embeddings`` when none is given)."""
    given = {k: data[k] for k in ("rope_parameters", "rope_scaling") if data.get(k) is not None}
    for key, value in given.items():
        if not isinstance(value, dict):
            raise ValueError(f"{key} must be an object (a dict) or null, got {value!r} ({type(value).__name__})")
    if len(given) == 2 and given["rope_parameters"] != given["rope_scaling"]:
        raise ValueError("rope_parameters (transformers 5.x) and rope_scaling (4.x) differ: give one of them")
    params = dict(next(iter(given.values()), {}))
    params.setdefault("rope_theta", data.get("rope_theta", 10000.0))
    params.setdefault("rope_type", params.pop("type", "default"))
    params.pop("type", None)
    if params["rope_type"] in _SCALED_FROM_ORIGINAL:
        original = data.get("original_max_position_embeddings")  # a top-level field of some configs
        params.setdefault("original_max_position_embeddings", max_position_embeddings if original is None else original)
    return params
