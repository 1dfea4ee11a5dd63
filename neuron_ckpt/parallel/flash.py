"""The fused attention kernel behind ``CoreAttention(implementation="flash")``, per device.

A flash kernel computes causal ``softmax(QK^T/sqrt(d)) V`` block by block and keeps, for
backward, its inputs, its output and one number per query row (the log of the softmax's
denominator, fp32): never an ``s x s`` tensor. Which kernel runs:

* **CPU, CUDA, TorchNeuron** (eager or compiled): ``torch.nn.functional.scaled_dot_product_attention``
  with ``is_causal=True`` and ``enable_gqa``. Without dropout torch picks its flash kernel (on
  CPU: ``_scaled_dot_product_flash_attention_for_cpu``), which keeps q, k and v (k and v at
  kv-head size: GQA is not expanded), the output and the fp32 logsumexp ``[b, a, s]``; that is
  what :mod:`neuron_ckpt.memory.analytic` counts for ``attention="flash"``, measured to the byte.
  With dropout on CPU, torch falls back to its math path, which keeps fp32 ``[b, a, s, s]``
  tensors: the memory model refuses that case (``ModelShape`` kind ``gpt``, the only layer here
  with attention dropout).
* **XLA (trn1)**: neuronx-distributed's NKI kernel, ``nki_flash_attn_func`` from
  :data:`NKI_MODULE`, called as NxD's own Llama calls it: q, k and v as ``[b, heads, d, s]``
  with ``transpose_nki_inputs=True``, k and v repeated to the query heads first (NxD's wrapper
  launches the kernel over query heads), causal, scale ``1/sqrt(d)``. It needs the sequence to
  be a multiple of 2048 and ``d <= 128``. Where it cannot run (not importable: any venv but the
  Neuron one; or the shape) :func:`unavailable` says why and ``CoreAttention`` runs the explicit
  attention, saying so once. torch-xla's own SDPA is not a fallback: it lowers to the math path.

The NKI kernel has not run on these machines (no Trainium); ``tests_xla`` drives this plumbing
with a stand-in that computes the same function and checks the layouts it receives.
"""

from __future__ import annotations

import functools
import importlib
import math
import warnings

import torch
import torch.nn.functional as F

NKI_MODULE = "neuronx_distributed.kernels.flash_attn"
NKI_SEQ_MULTIPLE = 2048  # nki_flash_attn_func raises NotImplementedError otherwise
NKI_MAX_HEAD_DIM = 128


@functools.cache
def nki_flash_attn_func():
    """NxD's ``nki_flash_attn_func``, or None where :data:`NKI_MODULE` cannot be imported."""
    try:
        return importlib.import_module(NKI_MODULE).nki_flash_attn_func
    except (ImportError, AttributeError):  # also a placeholder package without the module
        return None


def unavailable(device_type: str, seq_len: int, head_dim: int, context_parallel_size: int = 1) -> str | None:
    """Why no flash kernel can run for this device and shape (None: one can). ``seq_len``: the
    whole sequence (all CP ranks')."""
    if device_type != "xla":
        return None
    if context_parallel_size > 1:
        return (
            "under context parallelism each query chunk attends to a longer key prefix (a lower-right "
            "causal block), and the NKI flash kernel takes causal attention over equal query and key lengths only"
        )
    if nki_flash_attn_func() is None:
        return f"{NKI_MODULE}.nki_flash_attn_func is not importable (the Neuron venv has it)"
    if seq_len % NKI_SEQ_MULTIPLE:
        return f"the NKI flash kernel needs the sequence length to be a multiple of {NKI_SEQ_MULTIPLE}, got {seq_len}"
    if head_dim > NKI_MAX_HEAD_DIM:
        return f"the NKI flash kernel needs head_dim <= {NKI_MAX_HEAD_DIM}, got {head_dim}"
    return None


def kernel_name(device_type: str) -> str:
    """The kernel ``flash`` means on this device, for messages."""
    return f"{NKI_MODULE}.nki_flash_attn_func (NKI)" if device_type == "xla" else "torch SDPA (flash)"


@functools.cache
def _warn_once(message: str) -> None:
    warnings.warn(message, stacklevel=4)


def warn_fallback(why: str) -> None:
    """Say once per reason that flash attention fell back to the explicit one."""
    _warn_once(f"attention 'flash' runs the explicit attention instead: {why}")


def flash_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Causal attention of ``q [b, a, s, d]`` over ``k, v [b, g, s, d]`` (g divides a; views with
    any strides are fine); returns ``[b, a, s, d]``. Check :func:`unavailable` first on XLA.

    ``mask``: instead of the causal mask, an additive ``[s_q, s_k]`` mask in ``q``'s dtype (a
    query chunk against a longer key prefix under context parallelism; not on XLA). Pass one
    tensor shared by every call: SDPA keeps it for backward."""
    a, g = q.shape[1], k.shape[1]
    if dropout_p > 0 and q.device.type == "cpu" and not torch.compiler.is_compiling():
        _warn_once(
            "attention 'flash' with dropout on CPU: torch's SDPA runs its math path, which keeps fp32 "
            "[b, a, s, s] tensors (the memory model counts the flash kernel, without dropout)"
        )
    if mask is not None:
        if q.device.type == "xla":
            raise ValueError("flash_attention: a mask other than the causal one is not supported on XLA")
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, enable_gqa=a != g)
    if q.device.type != "xla":
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True, enable_gqa=a != g)
    if a != g:  # query head i reads kv head i // (a/g), as repeat_kv and the explicit path
        k, v = k.repeat_interleave(a // g, dim=1), v.repeat_interleave(a // g, dim=1)
    nki = nki_flash_attn_func()

    def t(x: torch.Tensor) -> torch.Tensor:  # [b, h, s, d] -> [b, h, d, s], a view
        return x.transpose(-1, -2)

    return nki(
        t(q),
        t(k),
        t(v),
        dropout_p=dropout_p,
        softmax_scale=1.0 / math.sqrt(q.shape[-1]),
        causal=True,
        transpose_nki_inputs=True,
    )


__all__ = ["NKI_MODULE", "flash_attention", "kernel_name", "nki_flash_attn_func", "unavailable", "warn_fallback"]
