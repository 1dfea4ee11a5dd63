"""Step time of one Llama decoder layer: explicit vs flash attention, without and with selective recompute.

One process, TP 1, on CPU (torch's SDPA flash kernel for ``flash``)::

    python scripts/bench_attention.py                   # s 1024, h 2048, 16 heads: bench_recompute.py's shape
    python scripts/bench_attention.py --seq 4096 --dtype bf16

Each variant is one real ``LlamaDecoderLayer`` (:func:`neuron_ckpt.memory.layers.build_layers`,
the layer ``neuron-ckpt memory --measure`` counts) with the same weights and input; a step is its
forward and backward. The variants take turns every iteration so drift hits them alike; the
table gives the best and the median of ``--iters`` timed steps after ``--warmup`` untimed ones,
the ratio of each best to explicit attention without recompute, and the activation bytes the
layer keeps (analytic, measured to the byte by tests/test_memory_llama.py).
"""

from __future__ import annotations

import argparse
import statistics
import time

VARIANTS = (("explicit", "none"), ("explicit", "selective"), ("flash", "none"), ("flash", "selective"))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=None, help="default: --heads")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    return p.parse_args(argv)


def _shape_and_setups(a: argparse.Namespace):
    from neuron_ckpt.memory import ModelShape, TrainingSetup
    from neuron_ckpt.memory.shape import default_ffn

    model = ModelShape("llama", a.hidden, a.heads, a.kv_heads or a.heads, default_ffn("llama", a.hidden), 1, 512)
    return model, {
        att: TrainingSetup(a.seq, a.batch, tp=1, dtype=a.dtype, sequence_parallel=False, attention=att)
        for att in ("explicit", "flash")
    }


def _time_variants(a: argparse.Namespace) -> dict[tuple[str, str], list[float]]:
    """Worker (one gloo rank): seconds per step of each variant."""
    from neuron_ckpt.distributed import initialize_model_parallel, model_parallel_manual_seed
    from neuron_ckpt.memory.layers import build_layers, layer_input
    from neuron_ckpt.recompute import run_layers

    model, setups = _shape_and_setups(a)
    initialize_model_parallel(1)
    built = {}
    for attention, recompute in VARIANTS:
        model_parallel_manual_seed(0)  # the same weights in every variant
        built[(attention, recompute)] = build_layers(model, setups[attention], recompute, num_layers=1)
    x = layer_input(model, setups["explicit"], tp_rank=0).detach()
    times = {v: [] for v in VARIANTS}
    for i in range(a.warmup + a.iters):
        for variant, (layers, extra) in built.items():
            xi = x.clone().requires_grad_()
            start = time.perf_counter()
            out = run_layers(layers, xi, *extra)
            out.float().square().mean().backward()
            elapsed = time.perf_counter() - start
            layers.zero_grad(set_to_none=True)
            if i >= a.warmup:
                times[variant].append(elapsed)
    return times


def main(argv=None) -> int:
    a = parse_args(argv)
    from neuron_ckpt.distributed.local import run_local
    from neuron_ckpt.memory import layer_activation_bytes

    times = run_local(_time_variants, 1, a)[0]
    model, setups = _shape_and_setups(a)
    base = min(times[("explicit", "none")])
    print(
        f"one Llama decoder layer: s={a.seq} b={a.batch} h={a.hidden} a={a.heads} kv={model.kv_heads} "
        f"ffn={model.ffn} {a.dtype}, TP 1, CPU; best of {a.iters} steps (forward + backward)"
    )
    print(f"{'attention':<10}{'recompute':<11}{'best ms':>9}{'median ms':>11}{'vs explicit none':>18}{'kept MiB':>10}")
    for attention, recompute in VARIANTS:
        t = times[(attention, recompute)]
        kept = layer_activation_bytes(model, setups[attention], recompute) / 2**20
        print(
            f"{attention:<10}{recompute:<11}{min(t) * 1e3:>9.1f}{statistics.median(t) * 1e3:>11.1f}"
            f"{min(t) / base:>17.3f}x{kept:>10.1f}"
        )
    flash_sel = min(times[("flash", "selective")]) / min(times[("flash", "none")])
    explicit_sel = min(times[("explicit", "selective")]) / min(times[("explicit", "none")])
    print(
        f"selective / none: explicit {explicit_sel:.3f}x, flash {flash_sel:.3f}x; "
        f"flash / explicit without recompute: {min(times[('flash', 'none')]) / base:.3f}x"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
