"""RMSNorm, SwiGLU and the attention softmax as single autograd Functions that keep only what
their backward cannot do without.

Written as plain expressions, these let autograd keep every intermediate its ops need. Per
``n`` activation elements in a 16-bit dtype:

- ``rms_norm(x, w, eps)``: the plain expression keeps fp32 ``x`` (4n bytes), the fp32 rstd and
  the normalised ``x`` in 16 bits (2n); the Function keeps ``x`` (2n) and rstd (fp32, ``[..., 1]``).
- ``swiglu(gate, up)``: the plain expression keeps ``gate``, ``silu(gate)`` and ``up`` (6n); the
  Function keeps ``gate`` and ``up`` (4n).
- ``masked_softmax(scores, mask, fill)``: ``softmax(scores.masked_fill(mask, fill), dtype=fp32)
  .to(scores.dtype)`` keeps the fp32 softmax (4n) beside the 16-bit probabilities the matmul with
  V keeps anyway (2n), and in backward copies the ``[b, a, s, s]`` gradient three more times for
  the in-place mask (autograd's CopySlices and masked_fill backward); the Function keeps only
  the 16-bit output (the tensor the matmul keeps: 0 bytes of its own) and has no mask backward
  (the output, hence the gradient, is exactly 0 where masked). Megatron's fused scale-mask-softmax
  kernel keeps the same 16-bit output; the paper's ``5as^2b`` counts it that way.

Backward recomputes the rest: a few elementwise ops over tensors it reads anyway. The forward
runs the same ops as the plain expressions, so outputs are bit-identical to them. None of the
ops is one CPU autocast recasts, and those CUDA autocast runs in fp32 (pow, rsqrt) get fp32
here already, so under autocast the Functions compute what the expressions do (checked on CPU).

Backward of ``y = w * r(n)``, ``n = x * rstd``, ``rstd = (mean(x^2) + eps)^-1/2``, where ``r``
rounds to ``x``'s dtype and ``g = dy * w``:

- ``dw = sum over leading dims of dy * r(n)``: the forward multiplied ``w`` by the *rounded*
  ``n``, so that is the exact derivative of what was computed. ``n`` is recomputed by the same
  ops on the same bits (``x`` in fp32 times the saved rstd), so ``r(n)`` is the forward's
  tensor bit for bit. The product and the sum run in fp32 and round once to the weight's dtype:
  where the output is fp32 (x or the weight fp32) that is autograd's computation op for op, and
  equal bit for bit; where everything is 16-bit autograd rounds the product to 16 bits first.
- ``dx = rstd * (g - n * mean(g * n))``, in fp32, rounded once to ``x``'s dtype. ``r`` counts as
  the identity here, as autograd treats a cast; autograd also rounds ``g`` to ``x``'s dtype
  before using it, which this does not.

``swiglu`` backward is autograd's own ops in autograd's order (``dy * silu(gate)`` and
``silu_backward(dy * up, gate)``), so its gradients are bit-identical too; only ``silu(gate)``
is recomputed.

Statistics run in ``x``'s dtype promoted to at least fp32: fp32 for 16-bit and fp32 inputs,
exactly as ``x.float()``; fp64 inputs keep fp64 (``x.float()`` would round them to fp32), which
is what lets ``gradcheck`` check the backward.

``masked_softmax``: off XLA, 16-bit scores go through ATen's 16-bit softmax kernels, forward and
backward, which compute in fp32 and round once (forward 4x, backward 6x faster on CPU than
widening to fp32 first, at s = 1024); on XLA they are widened to fp32 first (a 16-bit lowering's
precision is not ours to know; the compiler fuses the casts). The forward equals the plain
expression bit for bit (tested on CPU). The backward reads the 16-bit output instead of the fp32
one: each probability carries one more 16-bit rounding (relative 2^-9 in bf16) into a gradient
that is then rounded to 16 bits anyway; ``tests/test_fused_ops.py`` bounds it against fp64
references. For fp32 scores it keeps the fp32 output and its backward is autograd's, bit for bit.

All are differentiable once (a second derivative through them raises): training needs no more.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

__all__ = ["masked_softmax", "rms_norm", "swiglu"]


def _stats_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)


def _normalise(x: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``x * rstd`` and ``rstd``, in at least fp32: the plain RMSNorm's own ops, in its order."""
    h = x.to(_stats_dtype(x))
    rstd = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return h * rstd, rstd


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        normalised, rstd = _normalise(x, eps)
        # The weight is saved too (autograd then checks it was not modified in place before
        # backward), but it is a parameter, alive anyway: of activations, only x and rstd.
        ctx.save_for_backward(x, rstd, weight)
        return weight * normalised.to(x.dtype)

    @staticmethod
    @once_differentiable  # rstd is saved without its history: a second derivative would be wrong
    def backward(ctx, grad: torch.Tensor):
        x, rstd, weight = ctx.saved_tensors
        compute = rstd.dtype  # the statistics' dtype: fp32 (fp64 for fp64 x)
        n = x.to(compute) * rstd  # bit for bit the forward's x * rstd
        dy = grad.to(compute)
        dx = dw = None
        if ctx.needs_input_grad[0]:
            g = dy * weight.to(compute)
            dx = (rstd * (g - n * (g * n).mean(-1, keepdim=True))).to(x.dtype)
        if ctx.needs_input_grad[1]:
            rounded = n.to(x.dtype).to(compute)  # what the forward multiplied the weight by
            dw = (dy * rounded).sum(dim=tuple(range(x.dim() - 1))).to(weight.dtype)
        return dx, dw, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)`` with statistics in fp32.

    Bit-identical to ``weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)``,
    ``h = x.float()`` (Llama's / ``transformers``' RMSNorm) for 16-bit and fp32 ``x``, output
    dtype included (``weight`` and ``x`` promote as in that product). Of activations it keeps
    only ``x`` and the fp32 rstd (``[..., 1]``) for backward. ``weight``: shape ``[x.shape[-1]]``.
    """
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"weight must have shape [{x.shape[-1]}] (x's last dim), got {list(weight.shape)}")
    return _RMSNorm.apply(x, weight, eps)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return torch.nn.functional.silu(gate) * up

    @staticmethod
    @once_differentiable  # silu_backward has no derivative
    def backward(ctx, grad: torch.Tensor):
        gate, up = ctx.saved_tensors
        d_gate = d_up = None
        if ctx.needs_input_grad[0]:
            d_silu = (grad * up).to(gate.dtype)  # silu(gate)'s dtype, as autograd casts it
            d_gate = torch.ops.aten.silu_backward(d_silu, gate)
        if ctx.needs_input_grad[1]:
            d_up = (grad * torch.nn.functional.silu(gate)).to(up.dtype)
        return d_gate, d_up


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``F.silu(gate) * up``, bit for bit, forward and backward; keeps only ``gate`` and ``up``."""
    return _SwiGLU.apply(gate, up)


def _native_16bit(t: torch.Tensor) -> bool:
    """A 16-bit tensor off XLA: ATen's softmax kernels (CPU, CUDA) read and write 16 bits and
    compute in fp32. On XLA a 16-bit softmax's precision is the lowering's, not ours to know, and
    the compiler fuses the casts of the widened form anyway."""
    return t.dtype in (torch.bfloat16, torch.float16) and t.device.type != "xla"


class _MaskedSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, scores: torch.Tensor, mask: torch.Tensor, fill: float) -> torch.Tensor:
        if _native_16bit(scores):
            # ATen's softmax of a 16-bit tensor computes in fp32 and rounds once: the fp32
            # softmax's bits cast back (tested on CPU), without the two fp32 [.., s, s] tensors.
            out = torch.softmax(scores.masked_fill(mask, fill), dim=-1)
        else:
            # A fresh copy in at least fp32 (fp64 stays fp64, for gradcheck) to mask in place; x
            # is rebound so each temporary goes as soon as the next exists.
            x = scores.to(_stats_dtype(scores), copy=True).masked_fill_(mask, fill)
            x = torch.softmax(x, dim=-1)
            out = x.to(scores.dtype)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        (out,) = ctx.saved_tensors
        if _native_16bit(out):
            # ATen's kernel reads 16-bit grad and output and computes in fp32 (CPU: 6x faster than
            # widening both first, at s = 1024; same result to one rounding, tested at s = 1024).
            return torch.ops.aten._softmax_backward_data(grad, out, -1, out.dtype), None, None
        # fp32 / fp64, and XLA: widen first.
        compute = _stats_dtype(out)
        d = torch.ops.aten._softmax_backward_data(grad.to(compute), out.to(compute), -1, compute)
        return d.to(out.dtype), None, None


def masked_softmax(scores: torch.Tensor, mask: torch.Tensor, fill: float) -> torch.Tensor:
    """``torch.softmax(scores.masked_fill(mask, fill), -1, dtype=torch.float32).to(scores.dtype)``,
    bit for bit, keeping only its output for backward.

    ``mask``: bool, broadcastable to ``scores`` (True: masked). ``fill`` must make the masked
    probabilities exactly 0 (a large negative finite value such as ``finfo(bf16).min``) and leave
    every row at least one unmasked entry: the backward relies on it (no mask of its own).
    """
    if mask.dtype != torch.bool:
        raise ValueError(f"mask must be a bool tensor, got {mask.dtype}")
    return _MaskedSoftmax.apply(scores, mask, fill)
