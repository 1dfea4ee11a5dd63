"""Step time of one Llama decoder layer under each recompute preset, side by side in one run.

::

    python scripts/bench_layer_recompute.py                 # s 1024, h 2048, 16 heads, f 5504, fp32
    python scripts/bench_layer_recompute.py --seq 2048 --iters 21

One ``LlamaDecoderLayer`` (ours, TP 1), forward + backward of a fixed input with a fixed upstream
gradient, for every preset in :data:`neuron_ckpt.recompute.PRESETS`; the presets take turns every
iteration (drift hits them alike), ``--iters`` timed steps after ``--warmup``. Prints each preset's
best and median step and its ratios to ``none`` and to ``selective`` (best of each: on a shared
machine interference only adds time), and for the leanest layer also the median of its
per-iteration ratios to ``selective`` (the two ran back to back, so slow drift cancels). The
target printed beside them, not asserted: the leanest selective layer (``selective+mlp_act+norm``:
output-discarding norms and SwiGLU) within 1.03x of ``selective``: it reruns two RMSNorms and
SwiGLU, elementwise passes over ``[s, b, h]`` and ``[s, b, f]``, against the layer's matmuls.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--ffn", type=int, default=5504)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--attention", default="explicit", choices=["explicit", "flash"])
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--iters", type=int, default=15)
    p.add_argument("--warmup", type=int, default=2)
    return p.parse_args()


def main() -> None:
    a = parse_args()
    import neuron_ckpt as nc
    from neuron_ckpt.models.llama import LlamaDecoderLayer, LlamaOptions
    from neuron_ckpt.models.llama_args import LlamaArgs
    from neuron_ckpt.models.rotary import RotaryEmbedding
    from neuron_ckpt.recompute import PRESETS, RecomputeConfig, apply_recompute

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[a.dtype]
    state = nc.initialize_model_parallel(1)
    nc.model_parallel_manual_seed(0)
    args = LlamaArgs(
        vocab_size=128,
        hidden_size=a.hidden,
        intermediate_size=a.ffn,
        num_hidden_layers=1,
        num_attention_heads=a.heads,
        num_key_value_heads=a.heads,
        max_position_embeddings=a.seq,
    )
    options = LlamaOptions(False, a.attention, dtype, state)
    layers = {}
    for name in PRESETS:
        torch.manual_seed(0)
        layer = torch.nn.ModuleList([LlamaDecoderLayer(args, options)])
        apply_recompute(layer, RecomputeConfig.preset(name))
        layers[name] = layer[0]
    cos, sin = RotaryEmbedding(args)(a.seq, dtype, torch.device("cpu"))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(a.seq, a.batch, a.hidden, generator=g).to(dtype).requires_grad_()
    upstream = torch.randn(a.seq, a.batch, a.hidden, generator=g).to(dtype)

    times: dict[str, list[float]] = {name: [] for name in PRESETS}
    start = time.perf_counter()
    for it in range(a.warmup + a.iters):
        for name, layer in layers.items():
            layer.zero_grad(set_to_none=True)
            x.grad = None
            t0 = time.perf_counter()
            layer(x, cos, sin).backward(upstream)
            if it >= a.warmup:
                times[name].append(time.perf_counter() - t0)
    best = {k: min(v) for k, v in times.items()}
    med = {k: statistics.median(v) for k, v in times.items()}
    print(
        f"one LlamaDecoderLayer: seq={a.seq} batch={a.batch} hidden={a.hidden} heads={a.heads} ffn={a.ffn} "
        f"{a.attention} {a.dtype} threads={torch.get_num_threads()} iters={a.iters} (+{a.warmup} warmup) "
        f"total {time.perf_counter() - start:.0f} s"
    )
    for name in PRESETS:
        print(
            f"  {name:24s} fwd+bwd best {best[name] * 1e3:8.1f} ms   median {med[name] * 1e3:8.1f} ms   "
            f"vs none {best[name] / best['none']:.3f} (medians {med[name] / med['none']:.3f})   "
            f"vs selective {best[name] / best['selective']:.3f} (medians {med[name] / med['selective']:.3f})"
        )
    lean = "selective+mlp_act+norm"
    paired = statistics.median(u / v for u, v in zip(times[lean], times["selective"]))
    print(
        f"{lean} / selective: best {best[lean] / best['selective']:.3f}, medians {med[lean] / med['selective']:.3f}, "
        f"median of the per-iteration ratios {paired:.3f}  target <= 1.03"
    )
    nc.destroy_distributed()


if __name__ == "__main__":
    main()
