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
    """``F.dropout(x, p, training)`` that is right on XLA and keeps a 1-byte mask elsewhere.

    Use it for the dropouts of your own blocks (residual, attention-probability, MLP dropout)
    when they may run on torch-xla (Trainium): there ``torch.native_dropout``'s backward is
    wrong by a factor ``1/(1-p)`` (torch-xla 2.9 scales twice), so this calls ``F.dropout``,
    whose gradient is right. On CPU and CUDA it calls ``torch.native_dropout``, which saves a bool
    mask (1 byte per element, what the activation-memory model counts) where CPU ``F.dropout``
    saves a 2- or 4-byte noise tensor. Draws from the current RNG stream: wrap it in
    ``neuron_ckpt.get_rng_tracker().fork()`` for activations split over the tensor-parallel group
    (per-rank masks); recompute replays it bit-identically either way. Our layers use it already.

    ``p`` is the drop probability; with ``training=False`` or ``p == 0`` ``x`` is returned as is.
    """
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability must be in [0, 1], got {p!r}")
    if not training or p == 0.0:
        return x
    if x.device.type == "xla":
        return F.dropout(x, p, True)
    return torch.native_dropout(x, p, True)[0]
