"""RMSNorm and LayerNorm that also work on sequence-parallel ``[s/t, b, h]`` activations.

Normalisation is over the hidden dim, so a sequence shard needs no communication forward. The
weight (and bias) are replicated on every TP rank but each rank sees only its sequence chunk, so
their gradients are partial: with ``sequence_parallel=True`` they pass through
``copy_to_tensor_parallel_region``, whose backward all-reduces them over TP. Optimizers must not
all-reduce them again.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..distributed.mappings import copy_to_tensor_parallel_region
from ..distributed.parallel_state import ParallelState
from .fused_ops import rms_norm
from .layer_args import check_sizes, resolve_parallel_state


class _Norm(torch.nn.Module):
    def __init__(self, hidden_size: int, eps: float, sequence_parallel: bool, parallel_state: ParallelState | None):
        super().__init__()
        check_sizes(hidden_size=hidden_size)
        if not eps > 0:
            raise ValueError(f"eps must be > 0, got {eps!r}")
        self.hidden_size, self.eps, self.sequence_parallel = hidden_size, eps, sequence_parallel
        # Only sequence parallel needs the TP group (to complete the weight gradients).
        self.parallel_state = resolve_parallel_state(parallel_state) if sequence_parallel else None

    def _param(self, p: torch.Tensor | None) -> torch.Tensor | None:
        if p is None or not self.sequence_parallel:
            return p
        assert self.parallel_state is not None  # set with sequence_parallel
        return copy_to_tensor_parallel_region(p, self.parallel_state.tp)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}, sequence_parallel={self.sequence_parallel}"


class RMSNorm(_Norm):
    """Llama's RMSNorm: statistics in fp32, result cast back, then scaled (as ``transformers`` does).

    One autograd Function (:func:`~.fused_ops.rms_norm`): the same outputs bit for bit, but it
    keeps only its input and the fp32 ``1/rms`` for backward, not an fp32 copy of the input and
    the normalised tensor (2sbh + 4sb bytes per 16-bit ``[s, b, h]`` input instead of 6sbh + 4sb).
    """

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-6,
        sequence_parallel: bool = False,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        parallel_state: ParallelState | None = None,
    ):
        super().__init__(hidden_size, eps, sequence_parallel, parallel_state)
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self._param(self.weight), self.eps)  # type: ignore[arg-type]  # a weight in, a weight out


class LayerNorm(_Norm):
    """``torch.nn.functional.layer_norm`` with sequence-parallel-aware weight and bias."""

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-5,
        sequence_parallel: bool = False,
        bias: bool = True,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        parallel_state: ParallelState | None = None,
    ):
        super().__init__(hidden_size, eps, sequence_parallel, parallel_state)
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device))
        self.bias = torch.nn.Parameter(torch.zeros(hidden_size, dtype=dtype, device=device)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (self.hidden_size,), self._param(self.weight), self._param(self.bias), self.eps)
