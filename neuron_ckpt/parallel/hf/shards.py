"""This rank's slice of a tensor the model holds whole, tagged, and sliced again on load.

A packed tensor (``stride`` 2: an experts' ``gate_up_proj``, gate rows then up rows along the
split dim) is cut into its ``stride`` parts first and each part sliced alike, so rank ``r``
holds gate slice ``r`` followed by up slice ``r``. It is tagged ``partition_stride`` (Megatron's
name) besides our ``tensor_parallel`` / ``partition_dim``: gathering it back is an all-gather of
each part, not of the whole.
"""

from __future__ import annotations

import torch

from ..params import set_expert_parallel_attribute, set_tensor_parallel_attributes


def no_init(weight: torch.Tensor) -> None:
    """The weights come from the model: nothing to draw."""


def shard_of(full: torch.Tensor, dim: int, t: int, r: int, stride: int = 1) -> torch.Tensor:
    """Slice ``r`` of ``t`` of ``full`` along ``dim``, of each of its ``stride`` parts."""
    if stride == 1:
        return full.chunk(t, dim)[r]
    return torch.cat([part.chunk(t, dim)[r] for part in full.chunk(stride, dim)], dim)


def take(
    module: torch.nn.Module,
    name: str,
    full: torch.Tensor,
    dim: int,
    t: int,
    r: int,
    stride: int = 1,
    expert: bool = False,
) -> None:
    """Set ``module.<name>`` to this rank's slice of ``full`` (:func:`shard_of`); tag it (split over
    TP, or ``expert``: this EP rank's experts); let ``load_state_dict`` slice a full tensor the same way."""
    param = torch.nn.Parameter(shard_of(full.detach(), dim, t, r, stride).clone(), requires_grad=full.requires_grad)
    if expert:
        set_expert_parallel_attribute(param)
    else:
        set_tensor_parallel_attributes(param, partition_dim=dim)
    if stride > 1:
        param.partition_stride = stride  # type: ignore[attr-defined]  # a marker torch does not declare
    setattr(module, name, param)
    shapes = module.__dict__.setdefault("_full_shapes", {})
    shapes[name] = (tuple(full.shape), dim, t, r, stride)
    if len(shapes) == 1:
        module.register_load_state_dict_pre_hook(_slice_full_tensors)


def _slice_full_tensors(module, state_dict, prefix, *args) -> None:
    for name, (shape, dim, t, r, stride) in module._full_shapes.items():
        value = state_dict.get(prefix + name)
        if value is not None and tuple(value.shape) == shape and t > 1:
            state_dict[prefix + name] = shard_of(value, dim, t, r, stride)


def swap(model: torch.nn.Module, name: str, new: torch.nn.Module) -> None:
    """Put ``new`` where the module ``name`` is."""
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)
