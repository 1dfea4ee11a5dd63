"""Step time of one Llama decoder layer under each recompute preset, side by side in one run, and
the recompute FLOPs the planner prices against torch's count.

::

    python scripts/bench_layer_recompute.py                 # s 1024, h 2048, 16 heads, f 5504, fp32
    python scripts/bench_layer_recompute.py --seq 2048 --iters 21
    python scripts/bench_layer_recompute.py --config llama2-7b --seq 512 --iters 5   # the 7B layer

One ``LlamaDecoderLayer`` (ours, TP 1), forward + backward of a fixed input with a fixed upstream
gradient, for every preset in :data:`neuron_ckpt.recompute.PRESETS`; the presets take turns every
iteration (drift hits them alike), ``--iters`` timed steps after ``--warmup``. Prints each preset's
best and median step and its ratios to ``none`` and to ``selective`` (best of each: on a shared
machine interference only adds time), and for the leanest layer also the median of its
per-iteration ratios to ``selective`` (the two ran back to back, so slow drift cancels). The target
printed beside them, not asserted: the leanest selective layer (``selective+mlp_act+norm``:
output-discarding norms and SwiGLU) within 1.03x of ``selective``: it reruns two RMSNorms and
SwiGLU, elementwise passes over ``[s, b, h]`` and ``[s, b, f]``, against the layer's matmuls.

Beside each measured ratio (best of each, medians, and the median of the per-iteration ratios:
each preset ran right after the others, so slow drift cancels), the priced one: 1 + the preset's
recompute FLOPs (matmul plus
elementwise, what the planner minimises: ``neuron_ckpt.memory.rerun``) over the layer's model
FLOPs (its share of ``6N + 12LHQT``). First, for both attentions, the recompute matmul FLOPs priced
against ``FlopCounterMode``'s count (a step with the preset less the step without) at the timed
shape and at ``--count-seq`` (default 4096, the 7B recipe's): counted on fake tensors
(``FakeTensorMode``: shapes without memory or compute, so the real shape counts in seconds), with
torch's SDPA formulas for the CPU flash kernel (``neuron_ckpt.memory.flop_count``).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default=None, help="a Llama preset or config.json: its h, heads, kv heads and ffn")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--ffn", type=int, default=5504)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--attention", default="explicit", choices=["explicit", "flash"])
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--iters", type=int, default=15)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--count-seq", type=int, default=4096, help="also count FLOPs at this sequence (0: not)")
    return p.parse_args()


def layer_args(a: argparse.Namespace, seq: int):
    from neuron_ckpt.models.config_file import load_llama_config
    from neuron_ckpt.models.llama_args import LlamaArgs

    if a.config is not None:
        c = load_llama_config(a.config)
        h, heads, kv, ffn = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.intermediate_size
    else:
        h, heads, kv, ffn = a.hidden, a.heads, a.heads, a.ffn
    return LlamaArgs(vocab_size=128, hidden_size=h, intermediate_size=ffn, num_hidden_layers=1,
                     num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=seq)  # fmt: skip


def build(args, attention: str, dtype: torch.dtype, preset: str) -> torch.nn.Module:
    import neuron_ckpt as nc
    from neuron_ckpt.models.llama import LlamaDecoderLayer, LlamaOptions
    from neuron_ckpt.recompute import RecomputeConfig, apply_recompute

    torch.manual_seed(0)
    layer = torch.nn.ModuleList(
        [LlamaDecoderLayer(args, LlamaOptions(False, attention, dtype, nc.get_parallel_state()))]
    )
    apply_recompute(layer, RecomputeConfig.preset(preset))
    return layer[0]


def priced(args, seq: int, batch: int, attention: str, dtype: str, preset: str):
    """(recompute matmul FLOPs, matmul + elementwise, the layer's model FLOPs per step), priced."""
    from neuron_ckpt.memory import ModelShape, TrainingSetup
    from neuron_ckpt.memory.options import layer_option
    from neuron_ckpt.memory.pipeline.stage_planner import stage_flops

    model = ModelShape.from_llama(args)
    setup = TrainingSetup(seq, batch, dtype=dtype, sequence_parallel=False, attention=attention)
    option = layer_option(model, setup, preset)
    return option.recompute_matmul_flops, option.recompute_flops, stage_flops(model, setup, 1, holds_head=False)


def counted(args, seq: int, batch: int, attention: str, dtype: torch.dtype, presets, fake) -> dict[str, int]:
    """Each preset's extra FLOPs over ``none`` in one forward + backward, torch's count."""
    from neuron_ckpt.memory.flop_count import flop_counter
    from neuron_ckpt.models.rotary import RotaryEmbedding

    total = {}
    with fake:
        cos, sin = RotaryEmbedding(args)(seq, dtype, torch.device("cpu"))
        x = torch.empty(seq, batch, args.hidden_size, dtype=dtype).requires_grad_()
        for name in ("none", *presets):
            layer = build(args, attention, dtype, name)
            with flop_counter() as counter:
                layer(x, cos, sin).backward(torch.empty_like(x))
            total[name] = counter.get_total_flops()
    return {name: total[name] - total["none"] for name in presets}


def flops_table(a: argparse.Namespace, dtype: torch.dtype, presets) -> None:
    # Fake tensors (torch's own FakeTensorMode, private module): shapes without storage, which is all
    # FlopCounterMode reads. One mode for every count: the causal mask is cached across layers.
    from torch._subclasses.fake_tensor import FakeTensorMode

    from neuron_ckpt.parallel.attention import causal_mask

    fake = FakeTensorMode()
    print("recompute FLOPs per layer and step, priced against FlopCounterMode's count (fake tensors):")
    print(f"  {'seq':>5} {'attention':9} {'preset':24} {'priced matmul':>14} {'counted':>14} {'ratio':>7} "
          f"{'+ elementwise':>14} {'priced overhead':>15}")  # fmt: skip
    for seq in dict.fromkeys([a.seq, *([a.count_seq] if a.count_seq else [])]):
        args = layer_args(a, seq)
        for attention in ("explicit", "flash"):
            got = counted(args, seq, a.batch, attention, dtype, presets, fake)
            for name in presets:
                matmul, total, step = priced(args, seq, a.batch, attention, a.dtype, name)
                ratio = f"{matmul / got[name]:.4f}" if got[name] else ("equal" if matmul == 0 else "-")
                print(f"  {seq:>5} {attention:9} {name:24} {matmul:>14.4g} {got[name]:>14.4g} {ratio:>7} "
                      f"{total - matmul:>14.4g} {total / step:>15.2%}")  # fmt: skip
    causal_mask.cache_clear()  # it holds fake masks now (a fake tensor says device "cpu")


def main() -> None:
    a = parse_args()
    import neuron_ckpt as nc
    from neuron_ckpt.models.rotary import RotaryEmbedding
    from neuron_ckpt.recompute import PRESETS

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[a.dtype]
    nc.initialize_model_parallel(1)
    nc.model_parallel_manual_seed(0)
    args = layer_args(a, a.seq)
    flops_table(a, dtype, PRESETS[1:])
    layers = {name: build(args, a.attention, dtype, name) for name in PRESETS}
    cos, sin = RotaryEmbedding(args)(a.seq, dtype, torch.device("cpu"))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(a.seq, a.batch, args.hidden_size, generator=g).to(dtype).requires_grad_()
    upstream = torch.randn(a.seq, a.batch, args.hidden_size, generator=g).to(dtype)

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
    print(f"one LlamaDecoderLayer: seq={a.seq} batch={a.batch} hidden={args.hidden_size} "
          f"heads={args.num_attention_heads} kv_heads={args.num_key_value_heads} ffn={args.intermediate_size} "
          f"{a.attention} {a.dtype} threads={torch.get_num_threads()} iters={a.iters} (+{a.warmup} warmup) "
          f"total {time.perf_counter() - start:.0f} s")  # fmt: skip
    for name in PRESETS:
        _, total, step = priced(args, a.seq, a.batch, a.attention, a.dtype, name)
        paired = statistics.median(u / v for u, v in zip(times[name], times["none"]))
        print(
            f"  {name:24s} fwd+bwd best {best[name] * 1e3:8.1f} ms   median {med[name] * 1e3:8.1f} ms   "
            f"vs none {best[name] / best['none']:.3f} (medians {med[name] / med['none']:.3f}, "
            f"paired {paired:.3f}; priced {1 + total / step:.3f})   "
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
