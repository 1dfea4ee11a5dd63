"""``mla_up_proj``: Megatron's output-discarding recompute of multi-latent attention's q/k/v
(DeepSeek-V2/V3), on transformers' ``DeepseekV3Attention``.

MLA keeps small latents (``q_a_layernorm``'s and ``kv_a_layernorm``'s outputs, the rope part of
``kv_a_proj_with_mqa``'s) and expands them per head: ``q_b_proj`` (``q_proj`` without a q
latent), ``kv_b_proj``, the split into k_nope / v, RoPE on the rope parts and the concat into
q and k. The expanded q/k/v are what core attention keeps, heads x (2 x qk_head_dim + v_head_dim)
per token against the latents' q_lora_rank + kv_lora_rank + qk_rope_head_dim. Megatron runs the
up part (``qkv_up_proj_and_rope_apply``) through ``CheckpointWithoutOutput``; here it is one
function run through :func:`~.discard.checkpoint_without_output`, so the ops after it (core
attention, or the ``core_attn`` checkpoint, which saves its inputs through the same hooks) keep
notes instead of q/k/v, recomputed from the latents when backward needs them. The down
projections and the q/kv layernorms stay outside: their outputs are the up part's kept inputs,
with a copy of the rope part of ``kv_a_proj_with_mqa``'s output (``qk_rope_head_dim`` per token).

transformers writes these steps inline in ``DeepseekV3Attention.forward`` (the kv side in its
``expand_kv`` method), so :func:`mla_forward` is that forward, op for op (the same module
functions, in the same order, so bit-identical), with the up part cut out into :func:`_up`. It is
set on each attention instance (its class is untouched; ``remove_recompute`` puts it back). With
a KV cache (generation, never in training with recompute) the original forward runs. Attention
classes whose forward may differ are refused.
"""

from __future__ import annotations

import functools
import sys
from typing import Any

import torch

from .discard import checkpoint_without_output
from .patch import mark, patch

SUPPORTED = ("DeepseekV3Attention",)


def is_latent_attention(module: torch.nn.Module) -> bool:
    """Multi-latent attention, by its parts: a ``kv_b_proj`` expanding the kv latent."""
    return getattr(module, "kv_b_proj", None) is not None


def check_attention(module: torch.nn.Module, index: int, qualname: str) -> None:
    """One line refusing an attention class whose forward :func:`mla_forward` does not mirror."""
    cls = type(module)
    base = next((c for c in cls.__mro__ if c.__name__ in SUPPORTED and "transformers" in c.__module__), None)
    if base is None or any(getattr(cls, m) is not getattr(base, m) for m in ("forward", "expand_kv")):
        raise ValueError(
            f"modules: 'mla_up_proj' matched {qualname!r} in layer {index} ({cls.__name__}), which is not "
            f"supported: only {list(SUPPORTED)} (transformers' own forward, which mla_up_proj mirrors op for op)"
        )


def install(attention: torch.nn.Module, *_: Any) -> None:
    patch(attention, "forward", _Forward(attention))
    mark(attention, "mla_up_proj: q/k/v up projections and RoPE recomputed, output discarded")


class _Forward:
    """``attention.forward`` replaced by :func:`mla_forward` (a picklable callable, not a bound method)."""

    def __init__(self, attention: torch.nn.Module):
        self.attention = attention

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return mla_forward(self.attention, *args, **kwargs)


def _transformers_deprecate_kwarg(function):
    # The same keyword handling as the forward it stands in for (past_key_values -> cache).
    from transformers.utils.deprecation import deprecate_kwarg

    return deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")(function)


@functools.cache
def _decorated():
    return _transformers_deprecate_kwarg(_mla_forward)


def mla_forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """``DeepseekV3Attention.forward`` with q/k/v produced by one output-discarding call."""
    return _decorated()(self, *args, **kwargs)


def _mla_forward(self, hidden_states, position_embeddings, attention_mask, cache=None, **kwargs):
    if cache is not None:  # the cache update sits inside the up part; no recompute with a cache
        return type(self).forward(self, hidden_states, position_embeddings, attention_mask, cache=cache, **kwargs)
    modeling = sys.modules[type(self).__module__]
    batch_size, seq_length = hidden_states.shape[:-1]

    # The kept latents (down projections and their norms), as transformers computes them.
    q_latent = hidden_states if self.q_lora_rank is None else self.q_a_layernorm(self.q_a_proj(hidden_states))
    compressed_kv = self.kv_a_proj_with_mqa(hidden_states)
    kv_nope, k_rot = torch.split(compressed_kv, [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
    kv_nope = self.kv_a_layernorm(kv_nope)
    kv_nope = kv_nope.view(batch_size, 1, seq_length, self.kv_lora_rank)
    k_rot = k_rot.view(batch_size, 1, seq_length, self.qk_rope_head_dim)
    cos, sin = position_embeddings

    # The rope part as a copy: kept as the view it is, it would keep all of kv_a_proj_with_mqa's
    # output (kv_lora_rank + qk_rope_head_dim per token), which bf16 training otherwise frees
    # (kv_a_layernorm keeps its fp32 copy of the latent instead).
    up = functools.partial(_up, self, modeling)
    query_states, key_states, value_states = checkpoint_without_output(
        up, q_latent, kv_nope, k_rot.contiguous(), cos, sin, fence=(self,)
    )

    attention_interface = modeling.ALL_ATTENTION_FUNCTIONS.get_interface(
        self.config._attn_implementation, modeling.eager_attention_forward
    )
    attn_output, attn_weights = attention_interface(
        self,
        query_states,
        key_states,
        value_states,
        attention_mask,
        dropout=0.0 if not self.training else self.attention_dropout,
        scaling=self.scaling,
        **kwargs,
    )
    attn_output = attn_output.reshape(batch_size, seq_length, -1).contiguous()
    attn_output = self.o_proj(attn_output)
    return attn_output, attn_weights


def _up(self, modeling, q_latent, kv_nope, k_rot, cos, sin):
    """q/k/v from the latents: the up projections, the split, RoPE and the concat."""
    batch_size, seq_length = q_latent.shape[:2]
    query_shape = (batch_size, seq_length, -1, self.qk_head_dim)
    q_states = self.q_proj(q_latent) if self.q_lora_rank is None else self.q_b_proj(q_latent)
    q_states = q_states.view(query_shape).transpose(1, 2)
    q_pass, q_rot = torch.split(q_states, [self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
    if self.config.rope_interleave:
        q_rot, k_rot = modeling.apply_rotary_pos_emb_interleave(q_rot, k_rot, cos, sin)
    else:
        q_rot, k_rot = modeling.apply_rotary_pos_emb(q_rot, k_rot, cos, sin)
    query_states = torch.cat((q_pass, q_rot), dim=-1)
    key_states, value_states = self.expand_kv(kv_nope, k_rot)
    return query_states, key_states, value_states


__all__ = ["check_attention", "install", "is_latent_attention", "mla_forward"]
