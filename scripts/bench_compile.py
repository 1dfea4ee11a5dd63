"""Compiled against eager step time (forward + backward) of Llama decoder layers, TP 1 and TP 2.

One run: for each TP size, a gloo world of that size (``run_local``) build a stack of
``LlamaDecoderLayer``s (sequence parallel at TP 2), compile a copy with ``torch.compile``
(inductor on CPU), then time eager and compiled steps alternately, ``--repeats`` rounds of
``--steps`` steps each; prints the best and median per-step time of each and their ratio.

    PYTHONPATH=$PWD python scripts/bench_compile.py --hidden 256 --seq 256 --layers 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import neuron_ckpt as nc
from neuron_ckpt.distributed.local import run_local


def _bench(args: argparse.Namespace, tp: int) -> dict:
    from transformers import LlamaConfig

    from neuron_ckpt.models.llama import LlamaForCausalLM
    from neuron_ckpt.recompute import RecomputeConfig, apply_recompute

    torch.set_num_threads(args.threads)
    nc.initialize_model_parallel(tp)
    nc.model_parallel_manual_seed(0)
    config = LlamaConfig(
        vocab_size=128, hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3 // 64 * 64 or 64,
        num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64, num_key_value_heads=args.hidden // 64,
        max_position_embeddings=args.seq,
    )  # fmt: skip
    model = LlamaForCausalLM(config, sequence_parallel=tp > 1)
    apply_recompute(model, RecomputeConfig.preset(args.recompute) if args.recompute != "none" else None)
    layers = model.layers
    s_local = args.seq // tp
    x = torch.randn(s_local, args.batch, args.hidden, requires_grad=True)
    cos, sin = model.rotary(args.seq, x.dtype, x.device)

    def block(h):
        for layer in layers:
            h = layer(h, cos, sin)
        return h

    compiled = torch.compile(block)

    def step(fn):
        fn(x).sum().backward()

    for fn in (block, compiled):  # warm-up (compiles)
        step(fn)
        step(fn)
    times = {"eager": [], "compiled": []}
    for _ in range(args.repeats):
        for name, fn in (("eager", block), ("compiled", compiled)):
            torch.distributed.barrier()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                step(fn)
            times[name].append((time.perf_counter() - t0) / args.steps)
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--recompute", default="selective", choices=["none", "selective", "full"])
    p.add_argument("--steps", type=int, default=5, help="steps per timed round")
    p.add_argument("--repeats", type=int, default=5, help="alternating rounds per variant")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    args = p.parse_args()
    print(f"{vars(args)}; ms per forward+backward step of the layer stack, rank 0")
    for tp in (1, 2):
        t = run_local(_bench, tp, args, tp)[0]
        eager, comp = t["eager"], t["compiled"]
        print(
            f"TP {tp}: eager best {min(eager) * 1e3:.2f} median {statistics.median(eager) * 1e3:.2f} | "
            f"compiled best {min(comp) * 1e3:.2f} median {statistics.median(comp) * 1e3:.2f} | "
            f"eager/compiled best {min(eager) / min(comp):.2f}x median "
            f"{statistics.median(eager) / statistics.median(comp):.2f}x"
        )


if __name__ == "__main__":
    main()
