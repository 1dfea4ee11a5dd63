"""Run by test_experts_xla.py in a fresh process, because the second step kills it: transformers'
``grouped_mm`` experts on the XLA device, then ``torch._grouped_mm`` (what grouped_mm calls once
it has counted the tokens of each expert) on XLA tensors directly. Prints one line per step that
returns.

    python -m tests_xla_hf5.grouped_mm_probe
"""

from __future__ import annotations

import os

os.environ.setdefault("PJRT_DEVICE", "CPU")

import torch
import torch_xla

from .test_experts_xla import tiny_mixtral


def main() -> None:
    device = torch_xla.device()
    model = tiny_mixtral(device, "grouped_mm")
    ids = torch.zeros(2, 12, dtype=torch.long, device=device)
    try:
        model(input_ids=ids)
        torch_xla.sync()
        print("forward: ran", flush=True)
    except NotImplementedError as e:
        print(f"forward: NotImplementedError: {e}", flush=True)
    x, w = torch.randn(8, 16, device=device), torch.randn(4, 16, 32, device=device)
    offsets = torch.tensor([2, 4, 6, 8], dtype=torch.int32, device=device)
    torch._grouped_mm(x, w, offs=offsets).cpu()
    print("_grouped_mm: ran", flush=True)


if __name__ == "__main__":
    main()
