"""Shared helpers of the torch-xla suite (the relative errors are the main suite's:
``tests.helpers.rel_norm``)."""

from __future__ import annotations

import torch

# fp32 XLA:CPU against eager CPU: the same ops through different kernels (XLA's emitted loops and
# Eigen dots versus ATen's), so results differ by summation order only: a few ulps (unit roundoff
# 6e-8) per element; the worst measured over the layer tests is 9e-7 relative (attention
# gradients). 1e-5 leaves 10x margin and is still five orders below what a wrong slice, a
# dropped collective or a double-counted gradient gives (~1).
TOL = 1e-5


def hlo(*tensors: torch.Tensor) -> str:
    """The unoptimised HLO text of the pending lazy graph that computes ``tensors``."""
    import torch_xla

    return torch_xla._XLAC._get_xla_tensors_hlo(list(tensors))
