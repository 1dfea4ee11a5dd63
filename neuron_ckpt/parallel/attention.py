"""Core attention on this rank's heads: the part selective recompute targets.

``CoreAttention`` takes the local query/key/value projections ``[s, b, heads*d]`` and returns the
attention output ``[s, b, heads*d]``. Two implementations, same numerics up to rounding:

* ``explicit`` (default): scores ``QK^T/sqrt(d)``, causal mask (a finite ``finfo.min``, not
  ``-inf``: see :func:`masked_score`), softmax, dropout, weighted sum of ``V``, written out.
  Autograd then keeps the ``[b, a, s, s]`` softmax output, dropout mask and dropout output: the
  ``5as^2b`` term of Korthikanti et al. that selective recompute removes.
  Softmax runs in fp32 (``softmax_in_fp32``, as ``transformers`` Llama does) through
  :func:`~.fused_ops.masked_softmax`, which keeps only its output in the scores' dtype (2 bytes
  per element in bf16, as the paper and Megatron's fused softmax count), not the fp32 softmax
  that the plain expression would keep beside it.
* ``flash``: a fused kernel that keeps no ``s^2`` tensor (:mod:`.flash`: torch's SDPA flash
  kernel on CPU/CUDA, neuronx-distributed's NKI kernel on trn1). It keeps q, k, v, its output and
  an fp32 logsumexp per query row, so selective recompute of core attention has almost nothing
  left to save (the logsumexp) and full recompute is the lever. What the reference (NxD's trn1
  Llama-3 recipe) trains with. Where no kernel can run (XLA without the NKI module, or a shape
  it refuses) it runs ``explicit`` and says so once.

:data:`ATTENTION` is the one list of these names: the model, the memory model, the planner,
``neuron-ckpt memory`` / ``plan`` and the tutorial's ``--attention`` all take them.

Grouped-query attention: the query heads that share a key/value head are folded into the
sequence dim of one matmul, so key and value are never repeated in memory.

Dropout draws from the model-parallel RNG stream (heads differ per TP rank, and queries per CP
rank: :func:`~neuron_ckpt.distributed.random.model_parallel_manual_seed`).

Context parallelism (``context_parallel_group`` of more than one rank): ``q``, ``k``, ``v`` hold
this rank's ``s/c`` tokens (:mod:`.context_parallel.split`), keys and values are all-gathered
over CP and each query chunk attends to the keys before it
(:func:`~.context_parallel.context_parallel_attention`), with either implementation; on XLA the
NKI kernel cannot take a chunk against a longer key prefix, so ``flash`` runs ``explicit`` there.
"""

from __future__ import annotations

import contextlib
import functools
import math

import torch

from ..distributed.parallel_state import Group
from ..distributed.random import get_rng_tracker
from .context_parallel import context_parallel_attention
from .dropout import dropout
from .flash import flash_attention, unavailable, warn_fallback
from .fused_ops import masked_softmax

ATTENTION = ("explicit", "flash")


@functools.lru_cache(maxsize=16)
def causal_mask(s: int, device: torch.device) -> torch.Tensor:
    """One ``[s, s]`` bool mask per (size, device) for the whole process, shared by every layer.

    A per-layer cache would keep ``layers * s^2`` bytes alive (0.5 GiB for Llama-2 7B at
    s=4096); ``masked_fill`` saves the mask for backward, so sharing it also shares what autograd
    keeps.
    """
    return torch.ones(s, s, dtype=torch.bool, device=device).triu_(1)


def masked_score(dtype: torch.dtype) -> float:
    """The score written above the diagonal: ``torch.finfo(dtype).min``, finite, not ``-inf``.

    Neuron handles ``-inf`` badly (NxD masks with a large finite negative too). The value gives
    the same softmax as ``-inf``: the diagonal is never masked, so each row's max ``m`` is a real
    score and ``min - m`` is either finite and far below the point where ``exp`` underflows to
    exactly 0 (about -104 in fp32, -17 in fp16) or, for a huge ``m``, rounds to ``-inf``: exp
    gives 0 either way, never NaN. The probability of a masked position is exactly 0, so its
    softmax gradient is 0 too, and ``masked_fill`` passes no gradient to the masked scores.
    ``finfo(bf16).min`` is also finite in fp32, so the fp32-softmax path sees the same value.
    """
    return torch.finfo(dtype).min


def _flash_runs_on(device_type: str, s: int, d: int, context_parallel_size: int = 1) -> bool:
    why = unavailable(device_type, s, d, context_parallel_size)
    if why is not None:
        warn_fallback(why)
    return why is None


class CoreAttention(torch.nn.Module):
    """Causal multi-head (or grouped-query) attention over local heads, sequence-first.

    ``context_parallel_group``: the CP group when the sequence is split over it (None or a group
    of one: the whole sequence is here).
    """

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        attention_dropout: float = 0.0,
        softmax_in_fp32: bool = True,
        implementation: str = "explicit",
        context_parallel_group: Group | None = None,
    ):
        super().__init__()
        for name, value in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}")
        if not 0.0 <= attention_dropout < 1.0:
            raise ValueError(f"attention_dropout must be in [0, 1), got {attention_dropout!r}")
        if implementation not in ATTENTION:
            raise ValueError(f"implementation must be one of {ATTENTION}, got {implementation!r}")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.attention_dropout, self.softmax_in_fp32 = attention_dropout, softmax_in_fp32
        self.implementation = implementation
        cp = context_parallel_group
        self.context_parallel_group = cp if cp is not None and cp.size > 1 else None

    def causal_mask(self, s: int, device: torch.device) -> torch.Tensor:
        """The ``[s, s]`` bool mask (True above the diagonal) every layer shares; see :func:`causal_mask`."""
        if torch.compiler.is_compiling():  # dynamo would trace through the cache and warn
            return torch.ones(s, s, dtype=torch.bool, device=device).triu_(1)
        return causal_mask(s, torch.device(device))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        s, b = q.shape[:2]
        a, g, d = self.num_heads, self.num_kv_heads, self.head_dim
        qh = q.view(s, b, a, d).permute(1, 2, 0, 3)  # [b, a, s, d]
        p = self.attention_dropout if self.training else 0.0
        cp = self.context_parallel_group
        with get_rng_tracker().fork() if p > 0 else contextlib.nullcontext():
            if cp is not None:
                out = self._context_parallel(qh, k, v, p, cp)
            else:
                kh = k.view(s, b, g, d).permute(1, 2, 0, 3)  # [b, g, s, d]
                vh = v.view(s, b, g, d).permute(1, 2, 0, 3)
                if self.implementation == "flash" and _flash_runs_on(q.device.type, s, d):
                    out = flash_attention(qh, kh, vh, p)
                else:
                    out = self._explicit(qh, kh, vh, self.causal_mask(s, q.device), p)
        return out.permute(2, 0, 1, 3).reshape(s, b, a * d)

    def _context_parallel(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: float, cp: Group) -> torch.Tensor:
        c, d = cp.size, self.head_dim
        if self.implementation == "flash" and _flash_runs_on(q.device.type, q.shape[2] * c, d, c):
            attend = functools.partial(_flash_chunk, p=p)
            mask_dtype = q.dtype  # an additive mask: SDPA would turn a bool one into a new one per call
        else:
            attend, mask_dtype = functools.partial(self._explicit, p=p), torch.bool
        return context_parallel_attention(q, k, v, cp, self.num_kv_heads, d, attend, mask_dtype)

    def _explicit(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, p: float
    ) -> torch.Tensor:
        """``q [b, a, sq, d]`` over ``k, v [b, g, sk, d]``; ``mask [sq, sk]`` bool, True where masked."""
        b, a, sq, d = q.shape
        g, sk = k.shape[1], k.shape[2]
        # Fold the a/g query heads of each kv group into the row dim: [b, g, (a/g)*sq, d]. Scale
        # q (s*d elements) rather than the scores (s*s), and mask the fresh scores in place: on
        # memory-bound devices every pass over an [b, a, s, s] tensor costs as much as a matmul.
        qg = q.reshape(b, g, (a // g) * sq, d) * (1.0 / math.sqrt(d))
        scores = torch.matmul(qg, k.transpose(-1, -2)).view(b, a, sq, sk)
        fill = masked_score(scores.dtype)
        if self.softmax_in_fp32:
            # One Function: keeps only the 16-bit probabilities (which the matmul with V keeps
            # anyway), not the fp32 softmax beside them; no backward pass for the mask.
            probs = masked_softmax(scores, mask, fill)
        else:
            probs = torch.softmax(scores.masked_fill_(mask, fill), dim=-1)
        if p > 0:
            probs = dropout(probs, p)  # 1-byte mask, as the paper counts
        out = torch.matmul(probs.view(b, g, (a // g) * sq, sk), v)
        return out.view(b, a, sq, d)

    def extra_repr(self) -> str:
        return (
            f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
            f"dropout={self.attention_dropout}, softmax_in_fp32={self.softmax_in_fp32}, "
            f"implementation={self.implementation!r}"
            + (f", context_parallel={self.context_parallel_group.size}" if self.context_parallel_group else "")
        )


def _flash_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, p: float) -> torch.Tensor:
    return flash_attention(q, k, v, p, mask)
