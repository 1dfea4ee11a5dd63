"""Rotary position embedding (RoPE) for sequence-first ``[s, b, heads * d]`` query/key tensors.

Rotary is a function of the absolute position, so under sequence parallelism it is applied
after the QKV projection has all-gathered the sequence: ``q`` and ``k`` are then ``[s, b, local]``
on every rank (local *heads*, full sequence) and one ``[s, d]`` table serves all ranks.

Numerics follow ``transformers``: the angle table is built in fp32, cast to the activation dtype,
and applied as ``x * cos + rotate_half(x) * sin`` (the "half-split" pairing of Llama checkpoints
converted to the Hugging Face layout).
"""

from __future__ import annotations

import torch


def _rope_parameters(config) -> dict:
    """``rope_theta`` / ``rope_type`` from a ``transformers`` 5.x or 4.x Llama config."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    if not params:  # transformers 4.x: rope_theta and rope_scaling are separate fields
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def inverse_frequencies(config, head_dim: int) -> tuple[torch.Tensor, float]:
    """``(inv_freq [d/2], attention_scaling)`` for the config's RoPE variant.

    ``default`` is computed here; static scaled variants (``linear``, ``llama3``, ``yarn``...)
    reuse ``transformers``' own init functions so they match it exactly. ``dynamic`` rescales
    with the sequence length at run time and is refused. For ``longrope`` these are the short
    factors' frequencies; :func:`longrope_long_frequencies` gives the long ones and where
    :class:`RotaryEmbedding` switches to them.
    """
    params = _rope_parameters(config)
    rope_type = params["rope_type"]
    if rope_type == "default":
        theta = float(params["rope_theta"])
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        return inv_freq, 1.0
    if rope_type == "dynamic":
        raise ValueError("rope_type='dynamic' (length-dependent RoPE scaling) is not supported; use a static variant")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"unknown rope_type {rope_type!r}; known: default, {sorted(ROPE_INIT_FUNCTIONS)}")
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config)
    return inv_freq.float(), float(scaling)


def longrope_long_frequencies(config) -> tuple[torch.Tensor, int]:
    """``(long inv_freq [d/2], original_max_position_embeddings)`` of a ``longrope`` config.

    ``transformers`` uses the short factors up to ``original_max_position_embeddings`` positions
    and the long factors past it (``longrope_frequency_update``: long when the largest position
    + 1 exceeds it), with the same attention scaling on both sides.
    """
    params = _rope_parameters(config)
    original = (
        params.get("original_max_position_embeddings")
        or getattr(config, "original_max_position_embeddings", None)
        or config.max_position_embeddings
    )
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, _ = ROPE_INIT_FUNCTIONS["longrope"](config, None, seq_len=int(original) + 1)
    return inv_freq.float(), int(original)


class RotaryEmbedding(torch.nn.Module):
    """``forward(s, dtype, device) -> (cos, sin)``, each ``[s, 1, 1, d]`` for ``[s, b, heads, d]``.

    Positions are ``0 .. s-1``. With ``rope_type="longrope"`` a sequence longer than
    ``original_max_position_embeddings`` (``long_after``) uses the long factors for every
    position, a shorter one the short factors, as ``transformers``' ``LlamaRotaryEmbedding`` does.
    """

    def __init__(self, config, head_dim: int):
        super().__init__()
        inv_freq, self.attention_scaling = inverse_frequencies(config, head_dim)
        self.head_dim = head_dim
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.long_after: int | None = None
        if _rope_parameters(config)["rope_type"] == "longrope":
            long_inv_freq, self.long_after = longrope_long_frequencies(config)
            self.register_buffer("long_inv_freq", long_inv_freq, persistent=False)

    def forward(self, seq_len: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        long = self.long_after is not None and seq_len > self.long_after
        inv_freq = self.long_inv_freq if long else self.inv_freq
        positions = torch.arange(seq_len, dtype=torch.float32, device=device)
        freqs = positions[:, None] * inv_freq.to(device=device, dtype=torch.float32)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.attention_scaling).to(dtype)
        sin = (emb.sin() * self.attention_scaling).to(dtype)
        return cos[:, None, None, :], sin[:, None, None, :]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Rotate ``x`` ``[s, b, heads * d]`` by the ``[s, 1, 1, d]`` tables; same shape back."""
    s, b, width = x.shape
    xh = x.view(s, b, width // head_dim, head_dim)
    return (xh * cos + rotate_half(xh) * sin).view(s, b, width)
