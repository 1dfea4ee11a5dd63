"""Which submodule of a layer each selective recompute name means.

``module_map`` maps a name to an attribute name, a dotted path, a class, or a tuple of those;
entries given override :data:`DEFAULT_MODULE_MAP` one by
one. A name that matches nothing in any layer of the model is an error, so a typo never silently
disables recompute; a name only some layers have applies to those (``moe`` on DeepSeek-V3, whose
first layers are dense). On a ``transformers`` model the defaults fit the
layers of every family ``apply_tensor_parallel`` splits (``mlp`` / Llama 4's ``feed_forward``,
``act_fn`` / Phi-3's and Llama 4's ``activation_fn``, ``input_layernorm`` /
``post_attention_layernorm`` and Gemma2's ``pre_`` / ``post_feedforward_layernorm``) and its MoE and
MLA layers (:mod:`.moe`, :mod:`.mla`: ``mlp`` and ``mlp_act`` then mean the dense MLP only); its
``core_attn`` is the attention *function*, recomputed through transformers' attention registry
(:mod:`.hf`), unless ``module_map`` names a module for it (``{"core_attn": "self_attn"}``
recomputes the whole attention block, projections included).

A name must also land on a submodule whose forward runs. A module that uses a child's parameters
without calling it (``LlamaMLP`` multiplies by ``gate_proj`` and ``up_proj`` in one fused matmul)
lists that child in a class attribute ``weights_only_children``; a name matching such a child is
an error, since wrapping a forward that is never called would recompute nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..parallel.attention import CoreAttention
from ..parallel.norms import LayerNorm, RMSNorm
from . import mla, moe
from .config import MODULE_ALIASES, MODULES
from .module import unwrapped

Pattern = str | type | tuple
Patterns = dict[str, Pattern]

DEFAULT_MODULE_MAP: dict[str, Pattern] = {
    "core_attn": CoreAttention,
    "mlp": ("mlp", "feed_forward"),  # Llama 4 calls its MLP feed_forward
    "mlp_act": ("act_fn", "activation_fn", "mlp_act"),  # Phi-3 and Llama 4: activation_fn
    # the attribute names of transformers' layers (their norms are own classes): Llama, Mistral,
    # Qwen, ... and Gemma2's sandwich norms
    "norm": (
        RMSNorm,
        LayerNorm,
        torch.nn.LayerNorm,
        torch.nn.RMSNorm,
        "input_layernorm",
        "post_attention_layernorm",
        "pre_feedforward_layernorm",
        "post_feedforward_layernorm",
    ),  # fmt: skip
    # transformers' MoE and MLA layers (.moe, .mla); what each default also requires is _REQUIRED
    "moe": ("mlp", "feed_forward"),
    "moe_act": "experts",
    "shared_experts": ("shared_experts", "shared_expert"),
    "mla_up_proj": "self_attn",
}


def _inside_moe(qualname: str, module: torch.nn.Module, blocks: list[str]) -> bool:
    return any(qualname.startswith(b + ".") for b in blocks)


# What a default pattern's match must also be (a module_map entry is taken as given): ``mlp`` and
# ``mlp_act`` mean the dense MLP (Megatron: ``mlp`` applies to non-MoE layers only; the experts'
# activation is ``moe_act``), ``moe`` an MoE block, ``moe_act`` / ``shared_experts`` parts of one,
# ``mla_up_proj`` a latent attention. ``blocks``: the qualified names of the layer's MoE blocks.
_REQUIRED = {
    "mlp": lambda q, m, blocks: q not in blocks and not _inside_moe(q, m, blocks),
    "mlp_act": lambda q, m, blocks: not _inside_moe(q, m, blocks),
    "moe": lambda q, m, blocks: q in blocks,
    "moe_act": _inside_moe,
    "shared_experts": _inside_moe,
    "mla_up_proj": lambda q, m, blocks: mla.is_latent_attention(m),
}

# Checks on every match of a name, default or not: one line refusing what cannot be recomputed.
_CHECKS = {"moe_act": moe.check_experts, "mla_up_proj": mla.check_attention}

# Selective modules recomputed output-discarding (.discard): an ordinary checkpoint around them
# would save nothing, since the op after them keeps their output (the projection after a norm,
# the down projection after SwiGLU). The others are ordinary checkpoints.
DISCARDING = ("norm", "mlp_act", "moe_act", "mla_up_proj")

# Selective modules whose input is the replicated hidden state (without sequence parallel), so
# distribute_saved_activations can split it; core attention and MLP activation inputs are
# already sharded by head / feature over the TP group and are saved as they are.
_REPLICATED_INPUT = ("mlp", "norm", "moe")


def resolve_module_map(module_map: Patterns | None) -> Patterns:
    """:data:`DEFAULT_MODULE_MAP` with the entries of ``module_map`` in place of its own, checked."""
    merged = dict(DEFAULT_MODULE_MAP)
    for name, pattern in (module_map or {}).items():
        canonical = MODULE_ALIASES.get(name, name)
        if canonical not in MODULES:
            raise ValueError(f"module_map: unknown module {name!r}; known modules: {list(MODULES)}")
        if not _valid_pattern(pattern):
            raise ValueError(
                f"module_map[{name!r}] must be an attribute name / dotted path (str), a module class, "
                f"or a tuple of those; got {pattern!r}"
            )
        merged[canonical] = pattern
    return merged


def _valid_pattern(pattern: Any) -> bool:
    if isinstance(pattern, (tuple, list)):
        return bool(pattern) and all(_valid_pattern(p) for p in pattern)
    return (isinstance(pattern, str) and bool(pattern)) or (
        isinstance(pattern, type) and issubclass(pattern, torch.nn.Module)
    )


def _matches(qualname: str, module: torch.nn.Module, pattern: Pattern) -> bool:
    if isinstance(pattern, (tuple, list)):
        return any(_matches(qualname, module, p) for p in pattern)
    if isinstance(pattern, str):
        return qualname == pattern or qualname.endswith("." + pattern)
    return isinstance(module, pattern)


def _children_without_forward(layer: torch.nn.Module) -> list[str]:
    """Qualified names of the submodules of ``layer`` whose forward never runs: those a module
    lists in its ``weights_only_children`` (it uses their parameters directly)."""
    idle = []
    for q, m in layer.named_modules():
        for child in getattr(unwrapped(m), "weights_only_children", ()):
            idle.append(f"{q}.{child}" if q else child)
    return idle


def selected_modules(
    layer: torch.nn.Module, index: int, names: Sequence[str], patterns: Patterns, matched: set[str] | None = None
) -> list[tuple[str, torch.nn.Module, bool, str]]:
    """``(qualified name, module, input is replicated, selective name)`` of layer ``index`` for
    the selective ``names``; the outermost match wins, a module shared within the layer comes once.
    A name this layer lacks is skipped; the names that matched something are added to ``matched``
    (:func:`check_every_name_matched` refuses a name no layer has)."""
    found: dict[str, tuple[torch.nn.Module, bool, str]] = {}
    idle = _children_without_forward(layer)
    modules = [(q, unwrapped(m)) for q, m in layer.named_modules() if q]  # as without recompute
    blocks = [q for q, m in modules if moe.is_moe_block(m)]
    for name in names:
        hits = [(q, m) for q, m in modules if _matches(q, m, patterns[name])]
        if name in _REQUIRED and patterns[name] is DEFAULT_MODULE_MAP[name]:
            hits = [(q, m) for q, m in hits if _REQUIRED[name](q, m, blocks)]
        if hits and matched is not None:
            matched.add(name)
        for q, m in hits:
            owner = next((o for o in idle if q == o or q.startswith(o + ".")), None)
            if owner is not None:
                parent = layer.get_submodule(owner.rpartition(".")[0]) if "." in owner else layer
                raise ValueError(
                    f"modules: {name!r} matched {q!r} in layer {index} ({type(layer).__name__}) with pattern "
                    f"{patterns[name]!r}, but {type(parent).__name__} never runs the forward of "
                    f"{owner.rpartition('.')[2]!r} (it reads only its weights, in a fused matmul), so "
                    f"recomputing it would recompute nothing; pass module_map={{{name!r}: <a submodule "
                    "whose forward runs>}}"
                )
            if name in _CHECKS:
                _CHECKS[name](m, index, q)
            if all(m is not other for other, _, _ in found.values()):  # a shared instance once
                found.setdefault(q, (m, name in _REPLICATED_INPUT, name))
    return [
        (q, m, replicated, name)
        for q, (m, replicated, name) in found.items()
        if not any(q.startswith(other + ".") for other in found)  # an enclosing module is recomputed already
    ]


def check_every_name_matched(
    requested: set[str], matched: set[str], patterns: Patterns, model: str, field: str = "modules"
) -> None:
    """A selective name that no layer of ``model`` has is an error (a typo never silently turns
    recompute off); one that only some layers have (``moe`` beside DeepSeek's dense first layers)
    applies where it matches."""
    for name in [n for n in MODULES if n in requested - matched]:
        meaning = _MEANING.get(name, "") if patterns[name] is DEFAULT_MODULE_MAP[name] else ""
        raise ValueError(
            f"{field}: {name!r} matched no submodule of any layer of {model} with pattern {patterns[name]!r}"
            f"{meaning}; pass module_map={{{name!r}: <attribute name or class>}}"
        )


_MEANING = {
    "mlp": " (a dense MLP, not an MoE block: on MoE layers use 'moe')",
    "mlp_act": " (a dense MLP's activation: the experts' is 'moe_act')",
    "moe": " (an MoE block: a module with an experts child and a gate or router child)",
    "moe_act": " (the experts of an MoE block)",
    "shared_experts": " (the shared experts of an MoE block)",
    "mla_up_proj": " (a multi-latent attention with a kv_b_proj)",
}
