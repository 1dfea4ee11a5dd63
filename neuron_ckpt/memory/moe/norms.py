"""transformers' RMSNorms, storage by storage (transformers 5.24, torch 2.13 on CPU).

Every family's norm casts its input to fp32 (``x.to(float32)``; in an fp32 model that is the
input itself, so the norm keeps its input's storage, all of it even when the input is a slice of
a wider tensor, as DeepSeek's ``kv_a_layernorm`` is), keeps it for the pow and the multiply, and
keeps the fp32 ``1/rms`` (one per row). Then the weight:

* ``"rms"`` (Llama and most): ``weight * x.to(dtype)``: the multiply keeps the normalised value
  in the activation dtype.
* ``"rms_fp32"`` (GPT-OSS): ``(weight * x).to(dtype)``: it keeps the fp32 normalised value.
* ``"gemma"`` (Gemma2): ``x * (1 + weight.float())``: it keeps the fp32 normalised value and the
  fp32 ``1 + w`` it computes (``h`` values, per norm, on every rank).
* ``"l2"`` (Llama 4's q/k norm): no weight; only the cast to fp32 and ``1/rms`` are kept.

The output is kept by whatever reads it next (:func:`rms_norm` returns its name).
"""

from __future__ import annotations

from .rules import LayerTensors

FP32 = 4
KINDS = ("rms", "rms_fp32", "gemma", "l2")


def rms_norm(
    layer: LayerTensors, place: str, source: str, elements: int, rows: int, w: int, split: bool, kind: str = "rms"
) -> str:
    """A norm at ``place`` over ``elements`` values in ``rows`` rows, read from the storage
    ``source``; returns its output's name (kept by nobody yet)."""
    if w == FP32:
        layer.keep(source, place)  # .to(float32) is the input: its whole storage stays
    else:
        layer.save(f"{place}.input_fp32", FP32 * elements, split, place)
    layer.save(f"{place}.rstd_fp32", FP32 * rows, split, place)
    if kind == "rms":
        layer.save(f"{place}.normalized", w * elements, split, place)
    elif kind in ("rms_fp32", "gemma"):
        layer.save(f"{place}.normalized_fp32", FP32 * elements, split, place)
        if kind == "gemma":
            layer.save(f"{place}.one_plus_weight_fp32", FP32 * (elements // rows), False, place)
    elif kind != "l2":
        raise ValueError(f"norm kind must be one of {KINDS}, got {kind!r}")
    return layer.save(f"{place}.out", w * elements, split)


__all__ = ["KINDS", "rms_norm"]
