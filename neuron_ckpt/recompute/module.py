"""``Recompute``: a module that runs the module it holds as one activation checkpoint, standing in
the model where that module stood, and :func:`run_layers`, which runs grouped layers as one.

``apply_recompute`` puts one in place of each recomputed module, so ``print(model)`` shows what is
recomputed::

    (core_attn): Recompute[CoreAttention](selective; explicit, heads 4 of 4, ...)
    (0): Recompute[LlamaDecoderLayer](full, layers 0-1; ...)

Names do not change. A ``Recompute`` holds its module's own tables of parameters, buffers and
submodules (the same dicts, not copies) and hands state-dict saving and loading to it, so parameter
names, state-dict keys, ``.to()``, ``.train()`` and hooks on the submodules are exactly those of
the model without recompute; checkpoints load either way. Attributes it does not have are read
from the module it holds. What it does not share is the held module's identity: ``isinstance``
on the wrapper sees ``Recompute`` (:func:`unwrapped` gives the held module), and hooks registered
on the wrapper run around the whole checkpoint.

Grouped full recompute (``method="uniform"``, ``num_layers=k > 1``) checkpoints ``k`` consecutive
layers as one: the first layer's ``Recompute`` has ``span=k``, the others ``span=0``.
:func:`run_layers` reads that and runs the group's layers inside one checkpoint; a grouped layer
called any other way raises (its model must loop through ``run_layers``).
"""

from __future__ import annotations

import contextvars
import functools
import sys
from collections.abc import Sequence
from typing import Any, cast

import torch

from .activation_checkpoint import checkpoint
from .config import RecomputeConfig
from .discard import checkpoint_without_output, discard_outputs

# The module's own tables, shared with the wrapper (the same dict objects).
_SHARED = (
    "_parameters", "_buffers", "_non_persistent_buffers_set", "_modules",
    "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks",
)  # fmt: skip

# On a module: a callable ``(module, args, kwargs) -> (args, kwargs)`` its Recompute runs before
# the checkpoint, so the checkpoint keeps what it returns. Sequence parallel sets it on the first
# decoder layer (which splits the sequence on entry; the checkpoint would otherwise keep the whole
# input); the module's own pre-hook that does the same leaves an input it already split alone.
BEFORE_CHECKPOINT = "_neuron_ckpt_before_checkpoint"

# On a layer: True when its input is this rank's chunk of the sequence (a transformers model split
# with apply_tensor_parallel(sequence_parallel=True)), so apply_recompute knows it runs sequence
# parallel (our own layers say so by their sequence_parallel attribute).
SEQUENCE_PARALLEL = "_neuron_ckpt_sequence_parallel"

# True while run_layers runs a group's layers inside its checkpoint (forward and recompute).
_IN_GROUP: contextvars.ContextVar[bool] = contextvars.ContextVar("neuron_ckpt_recompute_group", default=False)


class Recompute(torch.nn.Module):
    """``module`` run through :func:`checkpoint` (``config``'s ``use_reentrant``; ``distribute``:
    keep a 1/t slice of its replicated input). ``span``: 1 for one module; for grouped layers
    ``k`` on the first of ``k`` (run by :func:`run_layers`) and 0 on the others. ``discard``: run
    it through :func:`~.discard.checkpoint_without_output` instead (its output is not kept by the
    ops after it, inside the :class:`~.discard.discard_outputs` block of its layer)."""

    def __init__(
        self,
        module: torch.nn.Module,
        config: RecomputeConfig,
        distribute: bool = False,
        span: int = 1,
        discard: bool = False,
    ):
        super().__init__()
        if isinstance(module, Recompute):
            raise TypeError("Recompute: the module is already a Recompute")
        object.__setattr__(self, "module", module)  # not registered as a child: its contents are ours
        for name in _SHARED:
            self.__dict__[name] = module.__dict__[name]
        self.config, self.distribute, self.span, self.discard = config, distribute, span, discard
        self.training = module.training

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.discard:
            return checkpoint_without_output(self.module, *args, distribute_saved_activations=self.distribute, **kwargs)
        if self.span == 1:
            args, kwargs = self.before_checkpoint(args, kwargs)
            return checkpoint(
                self.module, *args, use_reentrant=self.config.use_reentrant,
                distribute_saved_activations=self.distribute, **kwargs,
            )  # fmt: skip
        if not _IN_GROUP.get():
            raise RuntimeError(
                f"full recompute with method='uniform' and num_layers={self.config.num_layers} checkpoints "
                "groups of layers, so the stack must run through "
                "neuron_ckpt.recompute.run_layers(layers, hidden_states, *extra_args); this layer was "
                "called directly"
            )
        return self.module(*args, **kwargs)

    def before_checkpoint(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """What the module asks to run before its checkpoint (:data:`BEFORE_CHECKPOINT`)."""
        before = self.module.__dict__.get(BEFORE_CHECKPOINT)
        return before(self.module, args, kwargs) if before is not None else (args, kwargs)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)  # parameters, buffers, submodules (the module's own)
        except AttributeError:
            module = self.__dict__.get("module")
            if module is None:  # half-built (unpickling)
                raise
            return getattr(module, name)

    def train(self, mode: bool = True) -> Recompute:
        self.module.training = mode
        return super().train(mode)

    def _save_to_state_dict(self, *args: Any) -> None:
        self.module._save_to_state_dict(*args)

    def _load_from_state_dict(self, *args: Any) -> None:
        self.module._load_from_state_dict(*args)

    def _get_name(self) -> str:
        return f"Recompute[{type(self.module).__name__}]"

    def extra_repr(self) -> str:
        c = self.config
        what = c.granularity if c.granularity == "selective" else f"full, {c.method}"
        if self.discard:
            what += ", output discarded"
        if self.span > 1:
            what += f", first of {self.span} layers in one checkpoint"
        elif self.span == 0:
            what += ", in the previous layers' checkpoint"
        inner = self.module.extra_repr()
        return f"{what}; {inner}" if inner else what


class DiscardScope:
    """Forward pre-hook and forward hook of a layer holding output-discarding units: its forward
    runs inside one :class:`~.discard.discard_outputs` block (the consumers of the discarded
    outputs are in the layer). Installed by ``apply_recompute``, removed by ``remove_recompute``."""

    def __init__(self, layer: torch.nn.Module):
        self.block = discard_outputs()
        self.handles = (
            layer.register_forward_pre_hook(self.enter),
            layer.register_forward_hook(self.exit, always_call=True),
        )

    def enter(self, layer: torch.nn.Module, args: Any) -> None:
        if not torch.compiler.is_compiling():  # compiled, the partitioner decides what is kept
            self.block.__enter__()

    def exit(self, layer: torch.nn.Module, args: Any, output: Any) -> None:
        if not torch.compiler.is_compiling():
            self.block.__exit__(*sys.exc_info())  # always_call: also when the forward raised

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def unwrapped(module: torch.nn.Module) -> torch.nn.Module:
    """The module a :class:`Recompute` holds, or ``module`` itself."""
    return module.module if isinstance(module, Recompute) else module


def run_layers(
    layers: Sequence[torch.nn.Module] | torch.nn.ModuleList, hidden_states: Any, *args: Any, **kwargs: Any
) -> Any:
    """``for layer in layers: hidden_states = layer(hidden_states, *args, **kwargs)``, running each
    group set up by full ``uniform`` recompute (a :class:`Recompute` with ``span > 1`` and the
    layers after it) as one activation checkpoint."""
    i = 0
    while i < len(layers):
        layer = layers[i]
        span = layer.span if isinstance(layer, Recompute) else 1
        if span > 1:
            group = list(layers[i : i + span])
            c = cast(Recompute, layer).config  # span > 1: a Recompute
            hidden_states = checkpoint(
                functools.partial(_run_group, group), hidden_states, *args, fence=[unwrapped(g) for g in group],
                use_reentrant=c.use_reentrant, distribute_saved_activations=c.distribute_saved_activations, **kwargs,
            )  # fmt: skip
            i += span
        else:
            hidden_states = layer(hidden_states, *args, **kwargs)
            i += 1
    return hidden_states


def _run_group(group: list[torch.nn.Module], hidden: Any, *args: Any, **kwargs: Any) -> Any:
    token = _IN_GROUP.set(True)
    try:
        for layer in group:
            hidden = layer(hidden, *args, **kwargs)
    finally:
        _IN_GROUP.reset(token)
    return hidden
