"""torch's own FLOP count, as the recompute pricing is checked against it: :func:`flop_counter`.

``torch.utils.flop_counter.FlopCounterMode`` counts the matmuls (``mm``, ``addmm``, ``bmm``...) and
the attention kernels of CUDA (flash, memory-efficient, cuDNN) with its own formulas, but has none
for the CPU flash kernel that ``scaled_dot_product_attention`` runs here
(``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward, torch 2.13): under a plain
``FlopCounterMode`` a CPU flash attention counts 0. :func:`flop_counter` hands the CPU ops torch's
formulas for the other kernels (``sdpa_flop_count``: ``QK^T`` and ``probs @ V`` over the whole
square, GQA as the query heads; the backward's five matmuls), through ``FlopCounterMode``'s
``custom_mapping``, so a CPU step counts what a CUDA step counts. Elementwise work (norms, softmax,
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


CPU_FLASH = {
    _aten._scaled_dot_product_flash_attention_for_cpu: _sdpa_forward,
    _aten._scaled_dot_product_flash_attention_for_cpu_backward: _sdpa_backward,
}
"""The CPU flash kernel's ops and torch's formulas for them (shapes in, FLOPs out)."""


def flop_counter() -> torch_flops.FlopCounterMode:
    """A ``FlopCounterMode`` (no table printed) that also counts the CPU flash kernel; use it as
    ``with counter: loss.backward()``, then ``counter.get_total_flops()``."""
    return torch_flops.FlopCounterMode(display=False, custom_mapping=CPU_FLASH)


__all__ = ["CPU_FLASH", "flop_counter"]
