"""This rank's slice of a tensor the model holds whole, tagged, and sliced again on load."""

from __future__ import annotations

import torch

from ..params import set_tensor_parallel_attributes


def no_init(weight: torch.Tensor) -> None:
    """The weights come from the model: nothing to draw."""


def take(module: torch.nn.Module, name: str, full: torch.Tensor, dim: int, t: int, r: int) -> None:
    """Set ``module.<name>`` to slice ``r`` of ``t`` of ``full`` along ``dim``; tag it; let
    ``load_state_dict`` slice a full tensor the same way."""
    shard = full.detach().chunk(t, dim)[r].clone()
    param = torch.nn.Parameter(shard, requires_grad=full.requires_grad)
    set_tensor_parallel_attributes(param, partition_dim=dim)
    setattr(module, name, param)
    shapes = module.__dict__.setdefault("_full_shapes", {})
    shapes[name] = (tuple(full.shape), dim, t, r)
    if len(shapes) == 1:
        module.register_load_state_dict_pre_hook(_slice_full_tensors)


def _slice_full_tensors(module, state_dict, prefix, *args) -> None:
    for name, (shape, dim, t, r) in module._full_shapes.items():
        value = state_dict.get(prefix + name)
        if value is not None and tuple(value.shape) == shape and t > 1:
            state_dict[prefix + name] = value.chunk(t, dim)[r]


def swap(model: torch.nn.Module, name: str, new: torch.nn.Module) -> None:
    """Put ``new`` where the module ``name`` is."""
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)
