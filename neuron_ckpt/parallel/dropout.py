"""Dropout that keeps a 1-byte mask for backward, and is correct on XLA.

``torch.native_dropout`` saves a bool mask (1 byte per element), which is what the activation
memory accounting of Korthikanti et al. assumes; ``F.dropout`` on CPU saves a 2- or 4-byte noise
tensor instead. On XLA (torch-xla 2.9) the backward of ``native_dropout`` scales by 1/(1-p)
twice, so there we use ``F.dropout``, whose gradient is right (tests_xla checks both facts).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def dropout(x: torch.Tensor, p: float, training: bool = True) -> torch.Tensor:
    if not training or p == 0.0:
        return x
    if x.device.type == "xla":
        return F.dropout(x, p, True)
    return torch.native_dropout(x, p, True)[0]
