"""Mixture-of-experts styles: every rank runs every expert on its slice of the intermediate size.

transformers (5.x) holds a layer's experts as 3-D parameters, one matrix per expert:
``gate_up_proj`` ``[E, 2i, h]`` (the gate's ``i`` rows, then the up projection's) and
``down_proj`` ``[E, h, i]``; transposed experts hold ``[E, h, 2i]`` and ``[E, i, h]`` (Aria's
class says so with ``is_transposed``; Llama 4's, without the attribute, by its shapes). Rank ``r``
keeps rows ``[r i/t, (r+1) i/t)`` of the gate and the same rows of up, and the same columns of
down, so ``act(gate) * up`` and the down projection run on this rank's ``i/t`` features, and each
rank's output is a partial sum of the layer's output:

==============================================  ===============================================
plan entry                                      becomes
==============================================  ===============================================
``experts.gate_up_proj: packed_colwise``        dim 1 sliced, gate and up halves alike
``experts.gate_up_proj: packed_rowwise``        dim 2 sliced, likewise (transposed layout)
``experts.down_proj: rowwise``                  dim 2 sliced (``colwise``: dim 1, transposed)
``experts.up_proj: colwise`` / ``rowwise``      experts without a gate: their intermediate dim
``experts: moe_tp_experts``                     ``hidden_states`` and ``top_k_weights`` enter
                                                with ``copy_to_tensor_parallel_region``
                                                (all-reduce of their gradients), the output
                                                leaves with ``reduce_from_tensor_parallel_region``
==============================================  ===============================================

(transformers' dims: ``colwise`` slices dim ``ndim - 2`` of a parameter, ``rowwise`` the last.)
The router is not in the plan and stays whole: every rank sees the whole hidden state and picks
the same experts, and its gradient is whole on every rank too, since ``copy_to`` has summed the
gradients the experts send back into ``top_k_weights``. Every experts implementation (the eager
loop, ``grouped_mm``, ``batched_mm``; Llama 4's own ``bmm``) runs unchanged on the slices: each
takes the intermediate size from the weights; the module's own size attribute
(``intermediate_dim``, ``expert_dim``) is set to this rank's share all the same.

Checked before anything changes (one-line ``ValueError``): the entry names a 3-D expert weight
and slices the dim its layout holds the intermediate size in, that size divides by ``t``; a
split experts module is planned ``moe_tp_experts`` and all its weights are split (a partial sum
left unsummed, or a whole output summed ``t`` times, would be silently wrong); experts with
biases (GPT-OSS: the down bias would be added on every rank) or a norm after each expert are
refused.
"""

from __future__ import annotations

import torch

from ...distributed.mappings import copy_to_tensor_parallel_region, reduce_from_tensor_parallel_region
from .shards import take
from .style import Split, Style, Target

WEIGHTS = ("gate_up_proj", "up_proj", "down_proj")
SLICES = {"packed_colwise": (1, 2), "packed_rowwise": (2, 2), "colwise": (1, 1), "rowwise": (2, 1)}
"""Parameter style -> (the dim it slices of a 3-D weight, stride: 2 when gate and up are packed)."""
SIZE_ATTRIBUTES = ("intermediate_dim", "expert_dim", "intermediate_size")
"""What experts classes call their intermediate size; set to this rank's share."""


def _layout(experts: torch.nn.Module, name: str) -> tuple[int, int]:
    """(dim, stride) of the intermediate size in the experts' weight ``name``."""
    transposed = getattr(experts, "is_transposed", None)
    if transposed is None:  # an undecorated class (Llama 4): the whole shapes tell, gate_up's h meets down's h
        up, down = (
            _whole_shape(experts, "gate_up_proj") or _whole_shape(experts, "up_proj"),
            _whole_shape(experts, "down_proj"),
        )
        transposed = up is not None and down is not None and up[1] == down[2] and up[2] != down[1]
    if name == "down_proj":
        return (1 if transposed else 2), 1
    return (2 if transposed else 1), (2 if name == "gate_up_proj" else 1)


def _whole_shape(experts: torch.nn.Module, name: str) -> tuple[int, ...] | None:
    """The weight's shape before this rank took its slice (``shards.take`` keeps it)."""
    if not isinstance(getattr(experts, name, None), torch.Tensor):
        return None
    return experts.__dict__.get("_full_shapes", {}).get(name, (tuple(getattr(experts, name).shape),))[0]


def _check_weight(model: torch.nn.Module, target: Target, t: int) -> None:
    experts, name, where = target.module, target.param, target.where
    weight = getattr(experts, name)  # type: ignore[arg-type]  # a weight target always names its param
    if name not in WEIGHTS or weight.dim() != 3:
        raise ValueError(
            f"{where}: needs a 3-D expert weight ({', '.join(WEIGHTS)} of an experts module), "
            f"got {name} of shape {list(weight.shape)}"
        )
    dim, stride = _layout(experts, name)
    if SLICES[target.style] != (dim, stride):
        right = next(s for s, v in SLICES.items() if v == (dim, stride))
        raise ValueError(
            f"{where}: slices dim {SLICES[target.style][0]} of {name} {list(weight.shape)}, whose intermediate size is "
            f"dim {dim}{' (gate and up packed)' if stride > 1 else ''}: its style is '{right}'"
        )
    if stride > 1 and getattr(experts, "is_concatenated", True) is False:
        raise ValueError(f"{where}: gate and up are interleaved in {name} (is_concatenated=False), not packed halves")
    size = weight.shape[dim] // stride
    if size % t:
        raise ValueError(f"{where}: intermediate_dim={size} is not divisible by the tensor-parallel size {t}")


def _apply_weight(target: Target, split: Split) -> None:
    experts, name = target.module, target.param
    dim, stride = _layout(experts, name)  # type: ignore[arg-type]  # a weight target always names its param
    full = getattr(experts, name)  # type: ignore[arg-type]  # a weight target always names its param
    t = split.state.tp_size
    take(experts, name, full, dim, t, split.state.tp_rank, stride)  # type: ignore[arg-type]  # a weight target always names its param
    size = full.shape[dim] // stride
    for attribute in SIZE_ATTRIBUTES:
        if getattr(experts, attribute, None) == size:
            setattr(experts, attribute, size // t)


def _check_experts(model: torch.nn.Module, target: Target, t: int) -> None:
    experts, where = target.module, target.where
    weights = [n for n in WEIGHTS if isinstance(getattr(experts, n, None), torch.nn.Parameter)]
    if not weights:
        raise ValueError(
            f"{where}: needs an experts module holding 3-D {' / '.join(WEIGHTS)}, got {type(experts).__name__}"
        )
    others = [n for n, _ in experts.named_parameters(recurse=False) if n not in weights]
    if others or getattr(experts, "has_bias", False):
        raise ValueError(
            f"{where}: experts with biases ({', '.join(others) or 'has_bias'}) are not split: every rank would add "
            f"the down bias to its partial sum; leave them out of the plan"
        )
    if getattr(experts, "has_post_expert_norm", False):
        raise ValueError(f"{where}: a norm after each expert (has_post_expert_norm) would normalise partial sums")


def check_experts_plan(model: torch.nn.Module, targets: list[Target], t: int) -> None:
    """A split expert weight's module sums the partial outputs, and that module splits all its weights."""
    split: dict[str, set[str]] = {}
    for target in targets:
        if target.param is not None and target.param in WEIGHTS and target.style in SLICES:
            split.setdefault(target.name.rpartition(".")[0], set()).add(target.param)
    summed = {target.name for target in targets if target.style == "moe_tp_experts"}
    for owner, names in split.items():
        if owner not in summed:
            raise ValueError(
                f"apply_tensor_parallel: {owner}.{min(names)} is split but {owner} is not planned 'moe_tp_experts': "
                f"its partial outputs would not be summed"
            )
    for target in targets:
        if target.style == "moe_tp_experts":
            weights = {n for n in WEIGHTS if isinstance(getattr(target.module, n, None), torch.nn.Parameter)}
            missing = sorted(weights - split.get(target.name, set()))
            if missing:
                raise ValueError(
                    f"{target.where}: {', '.join(missing)} not split: the output summed over the group would count "
                    f"whole experts {t} times; plan every expert weight"
                )


def _apply_experts(target: Target, split: Split) -> None:
    group = split.state.tp

    def enter(module, args, kwargs):
        args = list(args)
        for position, key in ((0, "hidden_states"), (2, "top_k_weights")):
            if len(args) > position:
                args[position] = copy_to_tensor_parallel_region(args[position], group)
            elif key in kwargs:
                kwargs[key] = copy_to_tensor_parallel_region(kwargs[key], group)
        return tuple(args), kwargs

    def leave(module, args, output):
        return reduce_from_tensor_parallel_region(output, group)

    target.module.register_forward_pre_hook(enter, with_kwargs=True)
    target.module.register_forward_hook(leave)


EXPERT_STYLES: dict[str, Style] = {"moe_tp_experts": Style(_check_experts, _apply_experts)}
"""Styles of modules."""
EXPERT_WEIGHT_STYLES: dict[str, Style] = {style: Style(_check_weight, _apply_weight) for style in SLICES}
"""Styles of plan entries that name an expert weight (a parameter)."""
