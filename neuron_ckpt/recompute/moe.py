"""Recompute on mixture-of-experts layers: Megatron's ``moe``, ``moe_act`` and
``shared_experts`` on transformers MoE blocks (Mixtral, Qwen2/Qwen3-MoE, OLMoE, DeepSeek-V3, ...).

* An **MoE block** is a module with an ``experts`` child and a router child (``gate`` or
  ``router``): the layer's ``mlp`` on an MoE layer. Its router picks experts with ``torch.topk``.
* ``moe``: the whole block (router, experts, shared experts) as one ordinary activation
  checkpoint, a :class:`RoutedRecompute`. Two things make it exact:

  - **Routing replay** (:mod:`.routing`): the rerun uses the forward's expert choice.
  - **Router outputs stay differentiable.** transformers records each router's ``router_logits``
    with a forward hook (``OutputRecorder``) for the load-balancing loss. Inside the reentrant
    checkpoint the forward runs without grad, so the recorded logits would carry no gradient and
    the aux loss would silently stop training the router. The checkpointed function therefore
    returns the routers' floating outputs besides the block's: the autograd Function gives those
    very tensor objects (the ones transformers recorded) their history, and their gradient flows
    through the rerun. The rerun itself records nothing: it runs in backward, after the model's
    forward has closed its collector, so the aux loss counts each layer once.

  The block may write into its input (Mixtral, PhiMoE, MiniMax, DBRX and Switch multiply it by
  jitter noise in place), which would leave the checkpoint a changed input to rerun from; the
  block therefore runs on a copy (one ``[tokens, hidden]`` copy per MoE layer, freed with the
  block's forward). The jitter noise itself is replayed bit for bit with the RNG.
  Full recompute of a layer that holds an MoE block gets the same replay and router outputs.
* ``moe_act``: output-discarding recompute of the experts' activation. grouped_mm and
  batched_mm (and GPT-OSS's loop) call ``self._apply_gate(gate_up)`` (``act(gate) * up``): its
  output, which the down projection keeps, is discarded, and ``act(gate)`` with it. transformers'
  eager per-expert loop (the class's own forward) writes ``self.act_fn(gate) * up`` inline; on the
  experts ``moe_act`` covers it runs as :func:`~.experts_loop.eager_loop` instead, the same loop
  through ``_apply_gate``, so every implementation frees both. ``act_fn`` is wrapped too: on
  experts whose loop cannot be replaced (Llama 4's; one warning) its output is what can go.
* ``shared_experts``: DeepSeek's ``shared_experts`` / Qwen2-MoE's ``shared_expert`` as an
  ordinary checkpoint (a plain :class:`~.module.Recompute`).
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import torch
from torch.utils import _pytree as pytree

from . import experts_loop
from .activation_checkpoint import checkpoint
from .config import RecomputeConfig
from .discard import checkpoint_without_output
from .module import Recompute, unwrapped
from .patch import mark, patch
from .routing import RoutingReplay

ROUTER_NAMES = ("gate", "router")


def is_moe_block(module: torch.nn.Module) -> bool:
    """A module with an ``experts`` child and a router child (``gate`` or ``router``)."""
    children = unwrapped(module)._modules
    return children.get("experts") is not None and any(children.get(n) is not None for n in ROUTER_NAMES)


def holds_moe_block(module: torch.nn.Module) -> bool:
    return any(is_moe_block(m) for m in unwrapped(module).modules())


def routers(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The routers of the MoE blocks in ``module`` (itself included), in module order."""
    found = []
    for m in unwrapped(module).modules():
        if is_moe_block(m):
            found += [unwrapped(m._modules[n]) for n in ROUTER_NAMES if m._modules.get(n) is not None]  # type: ignore[arg-type]  # _modules maps names to Module | None; this one is set
    return found


def wrapper(
    module: torch.nn.Module, config: RecomputeConfig, distribute: bool, span: int, discard: bool, kind: str | None
) -> Recompute:
    """The :class:`~.module.Recompute` for one unit: routed where the module is or holds an MoE block."""
    if span == 1 and not discard and (kind == "moe" or holds_moe_block(module)):
        return RoutedRecompute(module, config, distribute, copy_input=kind == "moe" or is_moe_block(module))
    return Recompute(module, config, distribute, span, discard)


class RoutedRecompute(Recompute):
    """A :class:`~.module.Recompute` of a module holding MoE blocks (the ``moe`` block, or a whole
    layer under full recompute): routing replayed, router outputs differentiable (module
    docstring). ``copy_input``: run the module on a copy of its first argument."""

    def __init__(
        self, module: torch.nn.Module, config: RecomputeConfig, distribute: bool = False, copy_input: bool = False
    ):
        super().__init__(module, config, distribute)
        self.copy_input = copy_input

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.module(*args, **kwargs)
        run = _RoutedRun(self.module, routers(self.module), self.copy_input)
        args, kwargs = self.before_checkpoint(args, kwargs)
        outputs = checkpoint(
            run, *args, fence=(self.module,), use_reentrant=self.config.use_reentrant,
            distribute_saved_activations=self.distribute, **kwargs,
        )  # fmt: skip
        return outputs[0]

    def extra_repr(self) -> str:
        return "routing replayed; " + super().extra_repr()


class _RoutedRun:
    """The function one :class:`RoutedRecompute` call checkpoints: the module under its own
    :class:`~.routing.RoutingReplay` (forward records, reruns replay), returning
    ``(output, *router outputs)``."""

    def __init__(self, module: torch.nn.Module, routers: list[torch.nn.Module], copy_input: bool):
        self.module, self.routers, self.copy_input = module, routers, copy_input
        self.replay = RoutingReplay()

    def __call__(self, *args: Any, **kwargs: Any) -> tuple:
        if torch.compiler.is_compiling():  # the compiled graph keeps what it needs: nothing to replay
            return (self.module(*args, **kwargs),)
        if self.copy_input and args and torch.is_tensor(args[0]):
            args = (args[0].clone(), *args[1:])
        captured: list[torch.Tensor] = []
        handles = [r.register_forward_hook(functools.partial(_capture, captured)) for r in self.routers]
        try:
            with self.replay:
                output = self.module(*args, **kwargs)
        finally:
            for handle in handles:
                handle.remove()
        return (output, *captured)


def _capture(captured: list[torch.Tensor], module: torch.nn.Module, args: Any, output: Any) -> None:
    captured += [t for t in pytree.tree_leaves(output) if torch.is_tensor(t) and t.is_floating_point()]


# --------------------------------------------------------------------------------------------
# moe_act: the experts' activation, output discarded.


def check_experts(module: torch.nn.Module, index: int, qualname: str) -> None:
    """``moe_act`` needs an activation to discard: an ``act_fn`` module or an ``_apply_gate`` method."""
    if not isinstance(getattr(module, "act_fn", None), torch.nn.Module) and not hasattr(module, "_apply_gate"):
        raise ValueError(
            f"modules: 'moe_act' matched {qualname!r} in layer {index} ({type(module).__name__}), which has "
            "neither an act_fn module nor an _apply_gate method: there is no activation to discard"
        )


def install_expert_act(
    experts: torch.nn.Module, config: RecomputeConfig, slots: dict[int, list[tuple[torch.nn.Module, str]]]
) -> None:
    """Discard the output of ``experts._apply_gate`` (grouped_mm, batched_mm, and the eager loop
    through it: :mod:`.experts_loop`) and of ``experts.act_fn`` (a loop that cannot be replaced)."""
    act = experts._modules.get("act_fn")
    if act is not None:
        discarding = Recompute(act, config, discard=True)
        for parent, name in slots[id(act)]:
            parent._modules[name] = discarding
    if experts_loop.routable(experts):
        patch(experts, "forward", experts_loop.route(experts))
    elif experts_loop.inline_product(experts):
        warnings.warn(experts_loop.cannot_save(experts), stacklevel=1)
    if hasattr(type(experts), "_apply_gate"):
        patch(experts, "_apply_gate", _DiscardedGate(experts))
        mark(experts, "moe_act: _apply_gate recomputed, output discarded")


class _DiscardedGate:
    """``experts._apply_gate`` run through :func:`~.discard.checkpoint_without_output` (the
    layer's ``discard_outputs`` block holds the down projection that keeps its output)."""

    def __init__(self, experts: torch.nn.Module):
        self.experts = experts

    def __call__(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate = type(self.experts)._apply_gate.__get__(self.experts)  # type: ignore[attr-defined]  # torch types a module's attributes as Tensor | Module
        return checkpoint_without_output(gate, gate_up)


__all__ = ["RoutedRecompute", "holds_moe_block", "is_moe_block", "routers"]
