"""Which submodule of a layer each selective recompute name means.

``module_map`` maps a name to an attribute name, a dotted path, a class, or a tuple of those;
entries given override :data:`DEFAULT_MODULE_MAP` one by
one. A name that matches nothing in a layer is an error, so a typo never silently disables
recompute. On a ``transformers`` model the defaults fit Llama, Mistral and Qwen2 layers
(``mlp``, ``act_fn``, ``input_layernorm`` / ``post_attention_layernorm``); its ``core_attn`` is
the attention *function*, recomputed through transformers' attention registry (:mod:`.hf`),
unless ``module_map`` names a module for it (``{"core_attn": "self_attn"}`` recomputes the whole
attention block, projections included).

A name must also land on a submodule whose forward runs. A module that uses a child's parameters
without calling it (``LlamaMLP`` multiplies by ``gate_proj`` and ``up_proj`` in one fused matmul)
lists that child in a class attribute ``weights_only_children``; a name matching such a child is
an error, since wrapping a forward that is never called would recompute nothing.
"""

from __future__ import annotations

from typing import Any, Sequence, Union

import torch

from .module import unwrapped

from ..parallel.attention import CoreAttention
from ..parallel.norms import LayerNorm, RMSNorm
from .config import MODULE_ALIASES, MODULES

Pattern = Union[str, type, tuple]
Patterns = dict[str, Pattern]

DEFAULT_MODULE_MAP: dict[str, Pattern] = {
    "core_attn": CoreAttention,
    "mlp": "mlp",
    "mlp_act": ("act_fn", "mlp_act"),
    # the attribute names: transformers' Llama, Mistral, Qwen2 layers (their norms are own classes)
    "norm": (RMSNorm, LayerNorm, torch.nn.LayerNorm, torch.nn.RMSNorm, "input_layernorm", "post_attention_layernorm"),
}

# Selective modules recomputed output-discarding (.discard): an ordinary checkpoint around them
# would save nothing, since the op after them keeps their output (the projection after a norm,
# the down projection after SwiGLU). The others are ordinary checkpoints.
DISCARDING = ("norm", "mlp_act")

# Selective modules whose input is the replicated hidden state (without sequence parallel), so
# distribute_saved_activations can split it; core attention and MLP activation inputs are
# already sharded by head / feature over the TP group and are saved as they are.
_REPLICATED_INPUT = ("mlp", "norm")


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
    layer: torch.nn.Module, index: int, names: Sequence[str], patterns: Patterns
) -> list[tuple[str, torch.nn.Module, bool, str]]:
    """``(qualified name, module, input is replicated, selective name)`` of layer ``index`` for
    the selective ``names``; the outermost match wins, a module shared within the layer comes once."""
    found: dict[str, tuple[torch.nn.Module, bool, str]] = {}
    idle = _children_without_forward(layer)
    for name in names:
        modules = [(q, unwrapped(m)) for q, m in layer.named_modules() if q]  # as without recompute
        hits = [(q, m) for q, m in modules if _matches(q, m, patterns[name])]
        if not hits:
            raise ValueError(
                f"modules: {name!r} matched no submodule of layer {index} ({type(layer).__name__}) with "
                f"pattern {patterns[name]!r}; pass module_map={{{name!r}: <attribute name or class>}}. "
                f"Submodules: {[q for q, _ in modules][:20]}"
            )
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
            if all(m is not other for other, _, _ in found.values()):  # a shared instance once
                found.setdefault(q, (m, name in _REPLICATED_INPUT, name))
    return [
        (q, m, replicated, name)
        for q, (m, replicated, name) in found.items()
        if not any(q.startswith(other + ".") for other in found)  # an enclosing module is recomputed already
    ]
