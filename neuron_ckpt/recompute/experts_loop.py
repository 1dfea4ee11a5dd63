"""transformers' eager experts loop with its SwiGLU through ``_apply_gate``, so ``moe_act`` can
discard the product the down projection keeps.

transformers' experts classes run their eager per-expert loop as the class's own ``forward``
(transformers 5.24: Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V2/V3 and 49 more share it op for op;
Aria's differs by its transposed weights, MuseSpark's by a norm after each expert), and it writes
``act_fn(gate) * up`` inline: the product is made by a ``*``, no call that could run
output-discarding, so ``moe_act`` could discard only ``act_fn``'s output (F per routed row, half
of Megatron's ``moe_act``). grouped_mm and batched_mm call ``self._apply_gate(gate_up)`` instead
(transformers' default: chunk, then ``act_fn(gate) * up``), which ``moe_act`` runs through
:func:`~.discard.checkpoint_without_output`.

:func:`eager_loop` is that loop with the SwiGLU through ``self._apply_gate``: the same ops in the
same order, so the same numbers to the bit. ``moe_act`` sets it as the ``forward`` of the experts
it covers (:func:`route`), used whenever their config's experts implementation is ``eager``; any
other implementation goes on through transformers' dispatch, so ``set_experts_implementation``
keeps working. The choice is made per experts module, not by registering an implementation in
transformers' ``ExpertsInterface``: the interface picks one implementation per config (every layer
of the model) from a process-wide table, while ``moe_act`` may cover some layers only and
``remove_recompute`` puts each module's forward back.

Experts it is not for (:func:`routable`): classes outside transformers' experts interface (Llama
4's ``bmm`` forward), with their own ``_apply_gate``, with biases or without a gate. Those whose
loop still writes the SwiGLU inline (:func:`inline_product`: Llama 4's) get a one-line warning at
``apply_recompute`` naming what ``moe_act`` cannot save there.
"""

from __future__ import annotations

import sys
import types
from typing import Any

import torch
import torch.nn.functional as F

EAGER = (None, "eager")  # the config values under which transformers runs the class's own loop
# ``self`` below is a transformers experts module: its weights and flags are set by transformers
# (``use_experts_implementation``), typed Any rather than Module's ``Tensor | Module``.


def _own_loop(experts: torch.nn.Module):
    """The class's own forward: under transformers' decorator, the loop it wrapped."""
    forward = type(experts).forward
    return getattr(forward, "__wrapped__", forward)


def _default_gate():
    moe = sys.modules.get("transformers.integrations.moe")
    return getattr(moe, "_default_apply_gate", None)


def inline_product(experts: torch.nn.Module) -> bool:
    """Whether ``experts``' own loop makes a gated SwiGLU's product inline (not through ``_apply_gate``)."""
    gated = isinstance(getattr(experts, "gate_up_proj", None), torch.Tensor) or getattr(experts, "has_gate", False)
    return gated and "_apply_gate" not in _own_loop(experts).__code__.co_names


def routable(experts: torch.nn.Module) -> bool:
    """A transformers experts class whose inline loop :func:`eager_loop` reproduces op for op."""
    decorated = hasattr(type(experts).forward, "__wrapped__") and hasattr(experts, "is_transposed")
    return (
        decorated
        and inline_product(experts)
        and getattr(experts, "has_gate", False)
        and not getattr(experts, "has_bias", True)
        and getattr(experts, "is_concatenated", False)
        and _default_gate() is not None
        and getattr(type(experts), "_apply_gate", None) is _default_gate()
    )


def eager_loop(
    self: Any, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """transformers' eager experts loop (``MixtralExperts.forward``), the SwiGLU by ``self._apply_gate``."""
    final_hidden_states = torch.zeros_like(hidden_states)
    with torch.no_grad():
        expert_mask = F.one_hot(top_k_index, num_classes=self.num_experts + 1)
        expert_mask = expert_mask.permute(2, 1, 0)
        expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
    transposed = self.is_transposed
    for expert_idx in expert_hit:
        expert_idx = expert_idx[0]
        if expert_idx == self.num_experts:
            continue
        top_k_pos, token_idx = torch.where(expert_mask[expert_idx])
        current_state = hidden_states[token_idx]
        up = self.gate_up_proj[expert_idx]
        current = self._apply_gate(current_state @ up if transposed else F.linear(current_state, up))
        down = self.down_proj[expert_idx]
        current = current @ down if transposed else F.linear(current, down)
        if self.has_post_expert_norm:
            current = self.post_expert_norm(current)
        current = current * top_k_weights[token_idx, top_k_pos, None]
        final_hidden_states.index_add_(0, token_idx, current.to(final_hidden_states.dtype))
    return final_hidden_states


def _routed_forward(
    self: Any, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    if getattr(self.config, "_experts_implementation", None) in EAGER:
        return eager_loop(self, hidden_states, top_k_index, top_k_weights)
    return type(self).forward(self, hidden_states, top_k_index, top_k_weights)


def route(experts: torch.nn.Module):
    """The ``forward`` to set on ``experts`` (a :func:`routable` module): :func:`eager_loop` when its
    model runs the eager loop, transformers' dispatch otherwise."""
    return types.MethodType(_routed_forward, experts)


def cannot_save(experts: torch.nn.Module) -> str:
    """The one line ``apply_recompute`` warns with for experts whose loop keeps the product."""
    name = type(experts).__name__
    return (
        f"moe_act: {name}.forward writes act_fn(gate) * up inline, so only act_fn's output is discarded there, "
        "not the product the down projection keeps (the same size again: half of what Megatron's moe_act frees)"
    )


__all__ = ["cannot_save", "eager_loop", "inline_product", "route", "routable"]
