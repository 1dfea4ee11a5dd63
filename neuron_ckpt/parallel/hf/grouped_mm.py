"""transformers' ``grouped_mm`` experts need 16-byte strides: experts it cannot run get the eager loop, with a notice.

``torch._grouped_mm``, which transformers' default experts implementation ``grouped_mm`` calls (on
CPU and CUDA), needs the stride between the rows of each operand to be a multiple of 16 bytes. Its
operands are the routed rows ``[S, h]``, the gate/up weights, the SwiGLU product ``[S, F]`` and the
down weights, so the hidden size ``h`` and the intermediate size ``F`` must each be a multiple of 16
bytes: 4 elements in fp32, 8 in bf16 and fp16 (probed on torch 2.13, CPU: fp32 and bf16, every ``h``
in 16..32 and ``F`` in 12..40). Tensor parallelism slices ``F``: Mixtral with intermediate 36 at
TP 2 holds 18 fp32 per rank (72 bytes) and crashed mid-forward with ``RuntimeError: strides should
be multiple of 16 bytes``. Expert parallelism keeps experts whole, so there an odd size breaks the
rule as it would on one process (intermediate 18 in fp32, 36 in bf16).

After :func:`~.plan.apply_tensor_parallel` has split the model, :func:`run_eager_where_grouped_mm_cannot`
switches a model whose ``grouped_mm`` experts break the rule to transformers' ``eager`` per-expert
loop (``set_experts_implementation("eager")``) and says so in one warning, naming the size and the
tensor-parallel sizes at which grouped_mm would run. Running rather than refusing: the eager loop
computes the same experts (the model at TP 2 equals the dense one to rounding, as with grouped_mm)
on the same weights and checkpoints, keeps one ``[S, h]`` more per MoE layer, and is slower (one
loop step per expert hit); ``batched_mm``, the other implementation without the rule, keeps each
routed row's gathered expert weights for backward, ``S`` copies of ``[2F, h]`` and ``[h, F]``, far
more at real sizes. The rule is checked at the weights' dtype when the model is split: cast the
model before, not after.
"""

from __future__ import annotations

import sys
import warnings
from typing import Any

import torch

ALIGNMENT = 16  # bytes


def _grouped(module: torch.nn.Module) -> bool:
    """Experts dispatched through transformers' experts interface, set to ``grouped_mm``."""
    config = getattr(module, "config", None)
    down = getattr(module, "down_proj", None)
    return (
        hasattr(module, "is_transposed")
        and getattr(config, "_experts_implementation", None) == "grouped_mm"
        and isinstance(down, torch.Tensor)
        and down.dim() == 3
    )


def _sizes(experts: Any) -> dict[str, int]:
    """The hidden and intermediate sizes of ``experts``' weights as this rank holds them."""
    down = experts.down_proj
    h, f = (down.shape[2], down.shape[1]) if experts.is_transposed else (down.shape[1], down.shape[2])
    return {"hidden": h, "intermediate": f}


def _breaks(size: int, width: int) -> bool:
    return size * width % ALIGNMENT != 0


def _tp_sizes(experts: torch.nn.Module, width: int) -> tuple[int, int, list[int]] | None:
    """(whole intermediate size, tensor-parallel size, the sizes at which grouped_mm runs) where the
    experts are split over TP (``shards.take`` records the whole shape), else None."""
    taken = experts.__dict__.get("_full_shapes", {}).get("down_proj")
    if taken is None or taken[1] == 0:  # not split, or split over EP (dim 0: whole experts)
        return None
    whole, t = taken[0][taken[1]], taken[2]
    return whole, t, [d for d in range(1, whole + 1) if whole % d == 0 and not _breaks(whole // d, width)]


def _notice(name: str, experts: Any, more: int) -> str:
    width, dtype = experts.down_proj.element_size(), str(experts.down_proj.dtype).removeprefix("torch.")
    label, size = next((k, v) for k, v in _sizes(experts).items() if _breaks(v, width))
    split = _tp_sizes(experts, width) if label == "intermediate" else None
    where = f" per rank ({split[0]} over tensor-parallel size {split[1]})" if split else ""
    fix = (
        f"grouped_mm would run at tensor-parallel sizes {split[2]}"
        if split
        else f"grouped_mm needs the {label} size to be a multiple of {ALIGNMENT // width} in {dtype}"
    )
    others = f" and {more} more experts modules" if more else ""
    return (
        f"apply_tensor_parallel: {name} ({type(experts).__name__}){others}: {label} size {size}{where} is "
        f"{size * width} bytes in {dtype}, not a multiple of the {ALIGNMENT} bytes transformers' grouped_mm needs "
        f"(it would fail mid-forward: strides should be multiple of 16 bytes); running transformers' 'eager' "
        f"experts loop instead (the same results, slower); {fix}"
    )


def _outermost_models(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The ``PreTrainedModel``s in ``model`` (itself included) that no other one holds."""
    pretrained = sys.modules["transformers.modeling_utils"].PreTrainedModel
    found: list[torch.nn.Module] = []
    held: set[int] = set()
    for module in model.modules():
        if isinstance(module, pretrained) and id(module) not in held:
            found.append(module)
            held.update(id(m) for m in module.modules())
    return found


def run_eager_where_grouped_mm_cannot(model: torch.nn.Module) -> None:
    """Switch ``model`` to the eager experts loop, with one warning, where its ``grouped_mm`` experts
    (as this rank holds them) break the 16-byte rule (module docstring)."""
    found: list[tuple[str, Any]] = [
        (name, m)
        for name, m in model.named_modules()
        if _grouped(m) and any(_breaks(v, m.down_proj.element_size()) for v in _sizes(m).values())
    ]
    if not found:
        return
    ids = {id(m) for _, m in found}
    for owner in _outermost_models(model):
        if any(id(m) in ids for m in owner.modules()):
            owner.set_experts_implementation("eager")  # type: ignore[operator]  # a PreTrainedModel's method
    left = [name for name, m in found if m.config._experts_implementation != "eager"]
    if left:
        raise RuntimeError(
            f"apply_tensor_parallel: {left[0]} breaks grouped_mm's 16-byte stride rule and its model did not switch "
            "to the eager experts loop; call set_experts_implementation('eager') on it"
        )
    warnings.warn(_notice(*found[0], len(found) - 1), stacklevel=3)


__all__ = ["ALIGNMENT", "run_eager_where_grouped_mm_cannot"]
