"""Recompute on ``transformers`` models: what :func:`~.apply.apply_recompute` does differently for
a ``PreTrainedModel`` (a ``*ForCausalLM`` or a base model). transformers is imported lazily.

* **Layers**: the outermost ``GradientCheckpointingLayer`` modules, as transformers' own
  ``_set_gradient_checkpointing`` finds them; :mod:`.apply` applies the generic strategies (full,
  and every selective module but the attention function) to that list (mixture-of-experts and
  latent-attention modules: :mod:`.moe`, :mod:`.mla`).
* **Core attention** (selective ``core_attn``, unless ``module_map`` names a module for it):
  transformers' core attention is a function chosen by ``config._attn_implementation``, not a
  module. A wrapper registered once per wrapped implementation (``"recompute_eager"``,
  ``"recompute_sdpa"``, ...) in ``AttentionInterface`` and ``AttentionMaskInterface`` (same mask
  as the wrapped one) runs that function through our :func:`checkpoint`, so only
  ``QK^T``, softmax, dropout and ``·V`` are recomputed, with the dropout mask replayed bit for bit.
  The model is switched to it with ``set_attn_implementation``; attention modules of layers that
  are not selected run the wrapped function directly (per-layer lists).
* **Offloaded core attention** (``offload_modules`` with ``core_attn``, unless ``module_map`` names
  a module for it): the same wrapper runs the attention function inside the layer's offload group
  (:mod:`.offload`), so what the function keeps (q, k, v and what it saves past them; with
  ``core_attn`` recomputed too, the checkpoint's inputs) goes to host.
* **KV cache**: in training (grad enabled) the model owning the layers gets ``use_cache=False``
  with one warning, as transformers' checkpointing does; a cache object passed in is refused
  before the step (a recomputed layer would append to it twice).

:func:`undo` undoes all of it (:func:`~.apply.remove_recompute` calls it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import sys
import warnings
from collections.abc import Sequence
from typing import Any

import torch

from .activation_checkpoint import checkpoint
from .config import RecomputeConfig, validate_per_layer
from .module import SEQUENCE_PARALLEL, unwrapped
from .offload.install import FUNCTION_GROUP, per_layer_names
from .xla_experts import check_experts_implementation

PREFIX = "recompute_"
_MARK = "_neuron_ckpt_core_attn"  # on the modules of a layer whose core attention is recomputed
_HOOK = "_neuron_ckpt_cache_hook"  # on the model owning the layers: the cache rule's hook handle


def is_transformers_model(model: Any) -> bool:
    """A ``transformers.PreTrainedModel`` (never imports transformers: a model of it needs it loaded)."""
    module = sys.modules.get("transformers.modeling_utils")
    return module is not None and isinstance(model, module.PreTrainedModel)


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The outermost ``GradientCheckpointingLayer`` submodules of ``model``, in module order."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers: list[torch.nn.Module] = []
    for module in map(unwrapped, model.modules()):
        if isinstance(module, GradientCheckpointingLayer) and not any(module in set(held.modules()) for held in layers):
            layers.append(module)
    if not layers:
        raise TypeError(
            f"{type(model).__name__} has no GradientCheckpointingLayer (transformers' decoder layers); "
            "pass its layers to apply_recompute as a list"
        )
    return layers


def prepare(model, config, module_map, sequence_parallel: bool | None):
    """Split ``config`` for a ``PreTrainedModel``, validating it and changing nothing: returns its
    layers, the config for the generic path (``core_attn`` taken out where the attention function
    is recomputed) and ``finish``, to call once the generic part is installed (it returns the
    core-attention unit names). An offloaded ``core_attn`` stays in the config: the generic path
    reaches it through :func:`offload_functions`."""
    layers = decoder_layers(model)
    check_experts_implementation(model)
    if sequence_parallel is None:
        sequence_parallel = any(layer.__dict__.get(SEQUENCE_PARALLEL, False) for layer in layers)
    config = RecomputeConfig() if config is None else config
    per_layer = isinstance(config, (list, tuple))
    if per_layer:
        validate_per_layer(config, len(layers), bool(sequence_parallel))
    elif isinstance(config, RecomputeConfig):
        config.validate(len(layers), bool(sequence_parallel))
    configs = list(config) if per_layer else [config] * len(layers)
    by_function = "core_attn" not in (module_map or {})  # a module named for it: the generic path
    attn = [c if by_function and c is not None and c.granularity == "selective" and "core_attn" in c.modules
            else None for c in configs]  # fmt: skip
    offloads_attention = by_function and any("core_attn" in n for n in per_layer_names(config, len(layers)))
    if (offloads_attention or any(c is not None for c in attn)) and not type(model)._can_set_attn_implementation():
        raise ValueError(
            f"{type(model).__name__} does not dispatch attention through transformers' AttentionInterface, "
            "so its core attention cannot be recomputed or offloaded alone; pass module_map={'core_attn': 'self_attn'}"
        )
    rest = [_without_core_attn(c) if a is not None else c for c, a in zip(configs, attn)]

    def finish() -> list[str]:
        undo(model)
        if offloads_attention or any(c is not None for c in attn):
            _use_checkpointed_attention(model)
        for layer, c in zip(layers, attn):
            for m in layer.modules() if c is not None else ():
                setattr(m, _MARK, c)
        if any(c is not None and (c.enabled or c.offload_modules) for c in configs):
            _disable_cache_in_training(model, layers)  # a cache would keep on the device what offload moves
        return [f"{i}.core_attn" for i, c in enumerate(attn) if c is not None]

    return layers, rest if per_layer else rest[0], finish


def undo(model: torch.nn.Module) -> None:
    """Undo what ``finish`` did: the attention implementation, the marks, the cache hook."""
    name = model.config._attn_implementation  # type: ignore[union-attr]  # torch types a module's attributes as Tensor | Module
    if isinstance(name, str) and name.startswith(PREFIX):
        model.set_attn_implementation(name.removeprefix(PREFIX))  # type: ignore[operator]  # torch types a module's attributes as Tensor | Module
    for m in model.modules():
        m.__dict__.pop(_MARK, None)
        handle = m.__dict__.pop(_HOOK, None)
        if handle is not None:
            handle.remove()


def offload_functions(module_map) -> dict:
    """The offloaded names that are functions here: ``core_attn``, the attention function, unless
    ``module_map`` names a module for it. Each maps a layer to the module whose forward calls it
    (the layer: every attention module in it gets the group)."""
    return {} if "core_attn" in (module_map or {}) else {"core_attn": lambda layer: layer}


def _without_core_attn(config: RecomputeConfig) -> RecomputeConfig:
    modules = tuple(m for m in config.modules if m != "core_attn")
    if modules:
        return dataclasses.replace(config, modules=modules)
    return RecomputeConfig(offload_modules=config.offload_modules)


# --------------------------------------------------------------------------------------------
# Core attention: a checkpointed wrapper around the configured attention function.


def _core_attention(inner: str, module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    function = _attention_function(inner, module)
    config = module.__dict__.get(_MARK)
    group = module.__dict__.get(FUNCTION_GROUP)  # offloaded: what the function (or its checkpoint) keeps
    with group.block(module) if group is not None else contextlib.nullcontext():
        if config is None:
            return function(module, *args, **kwargs)
        return checkpoint(function, module, *args, fence=(module,), use_reentrant=config.use_reentrant, **kwargs)


def _attention_function(inner: str, module: torch.nn.Module):
    if inner != "eager":
        from transformers import AttentionInterface

        return AttentionInterface()[inner]
    # "eager" is not registered: each modeling file passes its own eager_attention_forward as default.
    return sys.modules[type(module).forward.__module__].eager_attention_forward


def _use_checkpointed_attention(model) -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    inner = model.config._attn_implementation
    name = PREFIX + inner
    if name not in AttentionInterface._global_mapping:  # register once per wrapped implementation
        AttentionInterface.register(name, functools.partial(_core_attention, inner))
        if inner in AttentionMaskInterface._global_mapping:  # the same mask as the wrapped one
            AttentionMaskInterface.register(name, AttentionMaskInterface._global_mapping[inner])  # type: ignore[arg-type]  # functools.partial is a callable
    model.set_attn_implementation(name)
    if model.config._attn_implementation != name:  # prepare checked that it can be set
        raise RuntimeError(f"{type(model).__name__}.set_attn_implementation({name!r}) did not set it")


# --------------------------------------------------------------------------------------------
# KV cache: off in training, as transformers' own checkpointing does.


class _CacheOffInTraining:
    """Forward pre-hook of the model owning the layers: ``use_cache=False`` (one warning) and no
    cache object while training with grad enabled."""

    def __init__(self, model: torch.nn.Module):
        params = list(inspect.signature(model.forward).parameters)
        self.index = params.index("use_cache") if "use_cache" in params else None
        self.warned = False

    def __call__(self, model, args, kwargs):
        if not (model.training and torch.is_grad_enabled()):
            return None
        if any(kwargs.get(k) is not None for k in ("cache", "past_key_values")):
            raise ValueError(
                "recompute in training cannot take a KV cache (a recomputed layer would append to it twice); "
                "pass cache=None"
            )
        if self.index is None:
            return None
        positional = len(args) > self.index
        use_cache = args[self.index] if positional else kwargs.get("use_cache")
        if use_cache or (use_cache is None and getattr(model.config, "use_cache", False)):
            if not self.warned:
                # stacklevel 1 (this hook): above it is torch's module call machinery, not the caller.
                warnings.warn(
                    "use_cache=True is incompatible with recompute in training; setting use_cache=False", stacklevel=1
                )
                self.warned = True
        if positional:
            args = (*args[: self.index], False, *args[self.index + 1 :])
        else:
            kwargs["use_cache"] = False
        return args, kwargs


def _disable_cache_in_training(model: torch.nn.Module, layers: Sequence[torch.nn.Module]) -> None:
    from transformers import PreTrainedModel

    owners: dict[int, torch.nn.Module] = {}  # layer -> the innermost PreTrainedModel holding it
    for m in model.modules():
        if isinstance(m, PreTrainedModel):
            owners.update({id(unwrapped(sub)): m for sub in m.modules()})
    for owner in {id(owners[id(layer)]): owners[id(layer)] for layer in layers}.values():
        owner.__dict__[_HOOK] = owner.register_forward_pre_hook(_CacheOffInTraining(owner), with_kwargs=True)
