"""Saved bytes and forward + backward time of ``fused_ops.rms_norm`` / ``swiglu`` against the plain expressions.

Shapes are one TP rank's at Llama-2 7B, seq 4096, TP 8, sequence parallel, bf16::

    python scripts/bench_fused_ops.py                    # CPU, best of 20
    python scripts/bench_fused_ops.py --iters 50 --device cuda

- RMSNorm: x ``[seq/tp, 1, hidden]`` = ``[512, 1, 4096]``, weight ``[4096]`` (bf16, as the bf16
  model builds it, and fp32).
- SwiGLU: gate and up ``[seq, 1, intermediate/tp]`` = ``[4096, 1, 1376]`` (the MLP runs on the
  gathered sequence).

Saved bytes: the distinct storages kept for backward (``SavedTensorRecorder``, the weight left
out: it is a parameter). Time: forward + backward, the variants taking turns every iteration so
drift hits them alike, best of ``--iters`` after ``--warmup`` (interference only adds time, so
the minimum is the stable estimate); medians beside. Ratios are fused / plain.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from neuron_ckpt.memory.measure import SavedTensorRecorder
from neuron_ckpt.parallel.fused_ops import rms_norm, swiglu

EPS = 1e-5


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--intermediate", type=int, default=11008)
    p.add_argument("--tp", type=int, default=8)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    return p.parse_args()


def plain_rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)
    return weight * h.to(x.dtype)


def plain_swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def saved_bytes(fn, inputs: list[torch.Tensor], exclude: list[torch.Tensor]) -> int:
    leaves = [t.detach().requires_grad_() for t in inputs]
    with SavedTensorRecorder(exclude_tensors=exclude) as rec:
        out = fn(*leaves)  # kept alive until the recorder exits: its graph holds the saves
    del out
    return rec.total_bytes


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, inputs: list[torch.Tensor], grad: torch.Tensor, device: torch.device) -> float:
    leaves = [t.detach().requires_grad_() for t in inputs]
    sync(device)
    t0 = time.perf_counter()
    fn(*leaves).backward(grad)
    sync(device)
    return time.perf_counter() - t0


def main() -> None:
    a = parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    device = torch.device(a.device)
    g = torch.Generator().manual_seed(0)

    def randn(*shape: int, dtype=torch.bfloat16) -> torch.Tensor:
        return torch.randn(shape, generator=g).to(device, dtype)

    x = randn(a.seq // a.tp, 1, a.hidden)
    gate, up = randn(a.seq, 1, a.intermediate // a.tp), randn(a.seq, 1, a.intermediate // a.tp)
    cases = {}
    for wdtype in (torch.bfloat16, torch.float32):
        w = (1 + 0.1 * randn(a.hidden, dtype=torch.float32)).to(wdtype)
        dy = randn(*x.shape, dtype=torch.promote_types(x.dtype, wdtype))
        name = f"rms_norm x{list(x.shape)} bf16, weight {str(wdtype)[6:]}"
        cases[name] = ((lambda x, w: rms_norm(x, w, EPS)), plain_rms_norm, [x, w], dy, [w])
    name = f"swiglu gate/up {list(gate.shape)} bf16"
    cases[name] = (swiglu, plain_swiglu, [gate, up], randn(*gate.shape), [])

    times = {(k, v): [] for k in cases for v in ("fused", "plain")}
    for it in range(a.warmup + a.iters):
        for k, (fused, plain, inputs, dy, _) in cases.items():
            for v, fn in (("fused", fused), ("plain", plain)):
                dt = timed(fn, inputs, dy, device)
                if it >= a.warmup:
                    times[(k, v)].append(dt)

    print(f"device={device} threads={torch.get_num_threads()} iters={a.iters} (+{a.warmup} warmup) "
          f"torch {torch.__version__}")
    for k, (fused, plain, inputs, _, exclude) in cases.items():
        fb, pb = saved_bytes(fused, inputs, exclude), saved_bytes(plain, inputs, exclude)
        best = {v: min(times[(k, v)]) for v in ("fused", "plain")}
        med = {v: statistics.median(times[(k, v)]) for v in ("fused", "plain")}
        print(k)
        print(f"  saved for backward   fused {fb / 2**20:7.2f} MiB   plain {pb / 2**20:7.2f} MiB   "
              f"ratio {fb / pb:.3f}")
        print(f"  fwd+bwd best         fused {best['fused'] * 1e3:7.2f} ms    plain {best['plain'] * 1e3:7.2f} ms    "
              f"ratio {best['fused'] / best['plain']:.3f}  (medians {med['fused'] / med['plain']:.3f})")


if __name__ == "__main__":
    main()
