"""One Llama decoder layer at context parallel 2 against CP 1, same global tokens, on gloo.

Two local processes (gloo, one thread each). CP 1: each rank runs the layer on the whole
sequence of ``s`` tokens (the two ranks are DP replicas, so both cores work as under CP 2). CP 2:
the two ranks split one sequence, ``s/2`` tokens each with causal load balance, attention
all-gathering keys and values over them (:mod:`neuron_ckpt.parallel.context_parallel`). Same
weights, same global tokens::

    python scripts/bench_context_parallel.py                  # s 2048, h 1024, 8 heads, 2 kv heads, fp32
    python scripts/bench_context_parallel.py --seq 4096 --iters 3

A step is the layer's forward and backward between barriers (the slower rank's time); the
variants take turns every iteration so load drift on a shared machine hits them alike; best and
median of ``--iters`` after ``--warmup``. Then one more step of each, untimed, with every
collective counted (:func:`neuron_ckpt.distributed.traffic.count_collectives`): the bytes each
rank sends in the layer, next to the formula with ``KV = 2 b (s/c) g d B`` (this rank's keys and
values, ``g`` kv heads of ``d``, ``B`` bytes each): forward one all-gather ``(c-1) KV``;
backward one all-gather again and one reduce-scatter of dK, dV, ``(c-1) KV`` each; ``3 (c-1) KV``
in all, with or without selective recompute of core attention (its rerun is the backward's
all-gather). Targets (printed, not asserted): time CP 2 / CP 1 below 1, bytes = formula.
"""

from __future__ import annotations

import argparse
import statistics
import time

VARIANTS = ("explicit", "flash")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--ffn", type=int, default=2816)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--iters", type=int, default=4)
    p.add_argument("--warmup", type=int, default=1)
    return p.parse_args(argv)


def _layers(a: argparse.Namespace, cp: int, recompute: str = "none"):
    """``{attention: (layer, x, cos, sin)}`` at CP ``cp`` on this rank: the same weights everywhere."""
    import torch

    import neuron_ckpt as nc
    from neuron_ckpt.models.llama import LlamaDecoderLayer, LlamaOptions
    from neuron_ckpt.models.llama_args import LlamaArgs
    from neuron_ckpt.models.rotary import RotaryEmbedding
    from neuron_ckpt.parallel.context_parallel import positions, shard
    from neuron_ckpt.recompute import RecomputeConfig, apply_recompute

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[a.dtype]
    nc.destroy_model_parallel()  # the groups stay; the state is the one asked for
    ps = nc.initialize_model_parallel(1, context_parallel_size=cp)
    args = LlamaArgs(
        vocab_size=128, hidden_size=a.hidden, intermediate_size=a.ffn, num_hidden_layers=1,
        num_attention_heads=a.heads, num_key_value_heads=a.kv_heads, max_position_embeddings=a.seq,
    )  # fmt: skip
    x = torch.randn(a.seq, a.batch, a.hidden, generator=torch.Generator().manual_seed(0)).to(dtype)
    pos = positions(a.seq, cp, ps.cp_rank) if ps.cp is not None else None
    cos, sin = RotaryEmbedding(args)(a.seq, dtype, torch.device("cpu"), pos)
    out = {}
    for attention in VARIANTS:
        torch.manual_seed(0)
        layer = LlamaDecoderLayer(args, LlamaOptions(False, attention, dtype, ps))
        if recompute != "none":
            apply_recompute(torch.nn.ModuleList([layer]), RecomputeConfig.preset(recompute))
        out[attention] = (layer, shard(x, 0, ps.cp) if ps.cp is not None else x, cos, sin)
    return out


def _step(layer, x, cos, sin) -> None:
    xi = x.clone().requires_grad_()
    layer(xi, cos, sin).float().square().mean().backward()
    layer.zero_grad(set_to_none=True)


def _run(a: argparse.Namespace) -> dict:
    """Worker (one gloo rank): seconds per step of each variant, and the collectives of one step."""
    import torch

    from neuron_ckpt.distributed import collectives as C
    from neuron_ckpt.distributed import host
    from neuron_ckpt.distributed.parallel_state import get_parallel_state
    from neuron_ckpt.distributed.traffic import count_collectives

    torch.set_num_threads(1)
    built = {(att, cp): v for cp in (1, 2) for att, v in _layers(a, cp).items()}
    world = get_parallel_state().dp_cp  # both ranks: for the slower rank's time
    times: dict = {k: [] for k in built}
    for i in range(a.warmup + a.iters):
        for key, args in built.items():
            host.barrier()
            start = time.perf_counter()
            _step(*args)
            elapsed = C.all_reduce(torch.tensor(time.perf_counter() - start), world, op="max").item()
            if i >= a.warmup:
                times[key].append(elapsed)
    sent = {}
    for recompute in ("none", "selective"):
        for att, args in _layers(a, 2, recompute).items():
            with count_collectives() as calls:
                _step(*args)
            sent[att, recompute] = [(c.kind, c.sent) for c in calls]
    return {"times": times, "sent": sent}


def main(argv=None) -> int:
    a = parse_args(argv)
    from neuron_ckpt.distributed.local import run_local

    out = run_local(_run, 2, a)[0]
    times, sent = out["times"], out["sent"]
    head_dim, itemsize = a.hidden // a.heads, {"fp32": 4, "bf16": 2}[a.dtype]
    print(
        f"one Llama decoder layer: s={a.seq} b={a.batch} h={a.hidden} heads={a.heads} kv={a.kv_heads} "
        f"ffn={a.ffn} {a.dtype}, TP 1, gloo, 2 ranks x 1 thread; best of {a.iters} steps (forward + backward)"
    )
    print(f"{'attention':<10}{'CP 1 ms':>9}{'CP 2 ms':>9}{'CP2/CP1':>9}{'  (medians)':>12}")
    for att in VARIANTS:
        one, two = times[att, 1], times[att, 2]
        print(
            f"{att:<10}{min(one) * 1e3:>9.0f}{min(two) * 1e3:>9.0f}{min(two) / min(one):>8.3f}x"
            f"{statistics.median(two) / statistics.median(one):>11.3f}x"
        )
    c = 2
    kv = 2 * a.batch * (a.seq // c) * a.kv_heads * head_dim * itemsize
    print(f"bytes each rank sends per layer at CP {c} (KV = 2 b (s/c) g d B = {kv} bytes: this rank's K and V):")
    columns = f"{'attention':<10}{'recompute':<11}{'collectives (kind: bytes)':<58}"
    print(f"{columns}{'measured':>10}{'formula 3(c-1)KV':>18}")
    for (att, recompute), calls in sent.items():
        listed = ", ".join(f"{k}: {b}" for k, b in calls)
        total = sum(b for _, b in calls)
        print(f"{att:<10}{recompute:<11}{listed:<58}{total:>10}{3 * (c - 1) * kv:>18}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
