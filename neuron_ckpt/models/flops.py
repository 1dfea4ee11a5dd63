"""Model FLOPs per token for model-FLOPs utilisation (MFU), the standard formula.

Training FLOPs per token (forward + backward, PaLM, Chowdhery et al. 2022, appendix B)::

    6 * N  +  12 * L * H * Q * T

* ``N``: parameters that take part in a matmul = all parameters except the input embedding
  table (a lookup, no FLOPs); the untied LM head counts. Each such weight costs 2 FLOPs per
  token forward and 4 backward.
* ``12 L H Q T``: attention scores ``QK^T`` and ``softmax @ V`` (``L`` layers, ``H`` query heads
  of size ``Q``, sequence ``T``), 2 matmuls x 2 FLOPs x 3 (forward + backward). Like PaLM and
  Megatron it counts the whole ``T x T`` square, not the causal half.

Recomputation is not counted: MFU measures useful model FLOPs, so recompute shows up as a lower
MFU (hardware FLOPs utilisation would count it). Norms, RoPE, softmax and SiLU are left out.
"""

from __future__ import annotations


def num_parameters(config, include_embedding: bool = True) -> int:
    """Parameter count of a Llama config (untied embeddings), computed from the config alone."""
    h, i, v = config.hidden_size, config.intermediate_size, config.vocab_size
    a, g = config.num_attention_heads, config.num_key_value_heads
    d = getattr(config, "head_dim", None) or h // a
    attn_bias = bool(getattr(config, "attention_bias", False))
    mlp_bias = bool(getattr(config, "mlp_bias", False))
    attn = h * a * d + 2 * h * g * d + a * d * h
    if attn_bias:
        attn += a * d + 2 * g * d + h
    mlp = 3 * h * i + (2 * i + h if mlp_bias else 0)
    per_layer = attn + mlp + 2 * h  # two RMSNorm weights
    total = config.num_hidden_layers * per_layer + h + v * h  # final norm, LM head
    return total + (v * h if include_embedding else 0)


def flops_per_token(config, seq_len: int) -> float:
    """Training (forward + backward) FLOPs per token: ``6 N + 12 L H Q T`` (see module doc)."""
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    a = config.num_attention_heads
    d = getattr(config, "head_dim", None) or config.hidden_size // a
    n = num_parameters(config, include_embedding=False)
    return 6.0 * n + 12.0 * config.num_hidden_layers * a * d * seq_len
