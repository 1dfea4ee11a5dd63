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

from .llama_args import LlamaArgs


def inverse_frequencies(args: LlamaArgs) -> tuple[torch.Tensor, float]:
    """``(inv_freq [d/2], attention_scaling)`` for the model's RoPE variant (``args.rope_parameters``).

    ``default`` is computed here; static scaled variants (``linear``, ``llama3``, ``yarn``...)
    reuse ``transformers``' own init functions (on ``args.to_hf()``) so they match it exactly;
    ``LlamaArgs`` refuses ``dynamic``, which rescales with the sequence length at run time. For
    ``longrope`` these are the short factors' frequencies; :func:`longrope_long_frequencies`
    gives the long ones and where :class:`RotaryEmbedding` switches to them.
    """
    rope_type, d = args.rope_parameters["rope_type"], args.head_dim
    if rope_type == "default":
        theta = float(args.rope_parameters["rope_theta"])
        inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
        return inv_freq, 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"unknown rope_type {rope_type!r}; known: default, {sorted(ROPE_INIT_FUNCTIONS)}")
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](args.to_hf(), None)  # (config, device): 4.x and 5.x
    return inv_freq.float(), float(scaling)


def longrope_long_frequencies(args: LlamaArgs) -> tuple[torch.Tensor, int]:
    """``(long inv_freq [d/2], original_max_position_embeddings)`` of a ``longrope`` model.

    ``transformers`` uses the short factors up to ``original_max_position_embeddings`` positions
    and the long factors past it (``longrope_frequency_update``: long when the largest position
    + 1 exceeds it), with the same attention scaling on both sides.
    """
    original = args.rope_parameters.get("original_max_position_embeddings") or args.max_position_embeddings
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, _ = ROPE_INIT_FUNCTIONS["longrope"](args.to_hf(), None, seq_len=int(original) + 1)
    return inv_freq.float(), int(original)


class RotaryEmbedding(torch.nn.Module):
    """``forward(s, dtype, device) -> (cos, sin)``, each ``[s, 1, 1, d]`` for ``[s, b, heads, d]``.

    Positions are ``0 .. s-1``, or ``positions`` (this rank's tokens' global positions under
    context parallelism, where ``s`` is still the whole sequence's length; the tables are then
    ``[len(positions), 1, 1, d]``). With ``rope_type="longrope"`` a sequence longer than
    ``original_max_position_embeddings`` (``long_after``) uses the long factors for every
    position, a shorter one the short factors, as ``transformers``' ``LlamaRotaryEmbedding`` does.
    """

    def __init__(self, args: LlamaArgs):
        super().__init__()
        inv_freq, self.attention_scaling = inverse_frequencies(args)
        self.head_dim = args.head_dim
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.long_after: int | None = None
        if args.rope_parameters["rope_type"] == "longrope":
            long_inv_freq, self.long_after = longrope_long_frequencies(args)
            self.register_buffer("long_inv_freq", long_inv_freq, persistent=False)

    def forward(
        self, seq_len: int, dtype: torch.dtype, device: torch.device, positions: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        long = self.long_after is not None and seq_len > self.long_after
        inv_freq = self.long_inv_freq if long else self.inv_freq
        if positions is None:
            positions = torch.arange(seq_len, dtype=torch.float32, device=device)
        else:
            positions = positions.to(device=device, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq.to(device=device, dtype=torch.float32)[None, :]  # type: ignore[index]  # torch types a module's attributes as Tensor | Module
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
