"""Run by test_recompute_xla.py in a fresh process (XLA_FLAGS must be set before XLA starts).

Builds forward + backward of core attention three ways (no checkpoint; ``checkpoint`` as is;
``checkpoint`` with its optimization barrier replaced by a no-op), compiles each as one graph
with XLA's HLO dumps switched on, and prints, as JSON, how many ``dot`` ops each graph has right
after XLA's target-independent common-subexpression elimination (the ``cse`` pass that runs
just before XLA:CPU's ``cse_barrier_expander``) and in the final optimised module.

    python -m tests_xla.cse_probe DUMP_DIR
"""

from __future__ import annotations

import glob
import json
import os
import sys

DUMP = sys.argv[1]
os.environ["XLA_FLAGS"] = f"--xla_dump_to={DUMP} --xla_dump_hlo_as_text --xla_dump_hlo_pass_re=cse"
os.environ.setdefault("PJRT_DEVICE", "CPU")

import torch  # noqa: E402
import torch_xla  # noqa: E402

import neuron_ckpt as nc  # noqa: E402
from neuron_ckpt.parallel import CoreAttention  # noqa: E402
from neuron_ckpt.recompute import activation_checkpoint, checkpoint  # noqa: E402


def dots(pattern: str, before: set[str]) -> int:
    files = sorted(set(glob.glob(os.path.join(DUMP, pattern))) - before)
    assert len(files) == 1, files
    return open(files[0]).read().count(" dot(")


def graph(device, use_checkpoint: bool) -> dict[str, int]:
    attn = CoreAttention(4, 2, 8)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(16, 2, n * 8, generator=g).to(device).requires_grad_() for n in (4, 2, 2))
    out = checkpoint(attn, q, k, v) if use_checkpoint else attn(q, k, v)
    out.pow(2).sum().backward()
    before = set(glob.glob(os.path.join(DUMP, "*")))
    torch_xla.sync()
    return {
        "after_first_cse": dots("*after_cse.before_cse_barrier_expander.txt", before),
        "final": dots("*cpu_after_optimizations.txt", before),
    }


def main() -> None:
    device = nc.init_distributed().device
    nc.initialize_model_parallel(1)
    result = {"plain": graph(device, False), "barrier": graph(device, True)}
    activation_checkpoint._xla_barrier = lambda tensors, modules: None
    result["no_barrier"] = graph(device, True)
    print(json.dumps(result))
    nc.destroy_distributed()


if __name__ == "__main__":
    main()
