"""torch's own FLOP count, as the recompute pricing is checked against it: :func:`flop_counter`.

``torch.utils.flop_counter.FlopCounterMode`` counts the matmuls (``mm``, ``addmm``, ``bmm``...) and
the attention kernels of CUDA (flash, memory-efficient, cuDNN) with its own formulas, but has none
for the CPU flash kernel that ``scaled_dot_product_attention`` runs here
(``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward, torch 2.13): under a plain
``FlopCounterMode`` a CPU flash attention counts 0. :func:`flop_counter` hands the CPU ops torch's
formulas for the other kernels (``sdpa_flop_count``: ``QK^T`` and ``probs @ V`` over the whole
square, GQA as the query heads; the backward's five matmuls), through ``FlopCounterMode``'s
``custom_mapping``, so a CPU step counts what a CUDA step counts. Likewise ``aten._grouped_mm``
(what transformers' ``grouped_mm`` experts run), which it does not count on any device: one
matmul's FLOPs, split over the groups. Elementwise work (norms, softmax,
activations) is never counted: the matmul part of :mod:`.rerun`'s prices is what compares.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils import flop_counter as torch_flops

_aten = torch.ops.aten


def _sdpa_forward(query: Any, key: Any, value: Any, *rest: Any, **kwargs: Any) -> int:
    return torch_flops.sdpa_flop_count(query, key, value)  # shapes; the rest (out_shape...) unused


def _sdpa_backward(grad_out: Any, query: Any, key: Any, value: Any, *rest: Any, **kwargs: Any) -> int:
    return torch_flops.sdpa_backward_flop_count(grad_out, query, key, value)


def _grouped_mm(a: Any, b: Any, *rest: Any, **kwargs: Any) -> int:
    """2 FLOPs per multiply-add, as torch's ``mm`` formula: the groups split one operand's rows or
    columns (or the contraction, 2D x 2D), so the total is one matmul's. 2D x 3D ``[S, K] x [E, K,
    N]`` (the experts' projections, the input gradient), 2D x 2D ``[K, S] x [S, N]`` with the
    groups along ``S`` (the weight gradient, ``[E, K, N]``), 3D x 2D and 3D x 3D alike."""
    if len(a) == 3 and len(b) == 3:
        return 2 * a[0] * a[1] * a[2] * b[2]
    return 2 * a[-2] * a[-1] * b[-1]


EXTRA = {
    _aten._scaled_dot_product_flash_attention_for_cpu: _sdpa_forward,
    _aten._scaled_dot_product_flash_attention_for_cpu_backward: _sdpa_backward,
    _aten._grouped_mm: _grouped_mm,
}
"""The ops ``FlopCounterMode`` has no formula for, with one (shapes in, FLOPs out): the CPU flash
kernel (torch's SDPA formulas) and ``_grouped_mm`` (transformers' MoE experts)."""


def flop_counter() -> torch_flops.FlopCounterMode:
    """A ``FlopCounterMode`` (no table printed) that also counts the CPU flash kernel and grouped
    matmuls; use it as
    ``with counter: loss.backward()``, then ``counter.get_total_flops()``."""
    return torch_flops.FlopCounterMode(display=False, custom_mapping=EXTRA)


__all__ = ["EXTRA", "flop_counter"]
