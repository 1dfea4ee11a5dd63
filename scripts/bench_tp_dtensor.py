"""Step time of a TP=2 transformer block (attention + MLP, sequence parallel) built from
neuron_ckpt's layers, against the same block parallelised with PyTorch's DTensor
(ColwiseParallel / RowwiseParallel / SequenceParallel, the torchtitan plan), on gloo.

Both blocks compute the same function (LayerNorm -> QKV -> causal SDPA -> output projection ->
residual; LayerNorm -> 4h GeLU MLP -> residual) on the same shapes; each timed step is forward +
backward. The two are timed alternately in one run so machine drift hits both alike.

    .venv/bin/python scripts/bench_tp_dtensor.py            # ratio = ours / DTensor; target <= 1.0
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import neuron_ckpt as nc
from neuron_ckpt.distributed.local import run_local
from neuron_ckpt.parallel import ColumnParallelLinear, CoreAttention, LayerNorm, QKVParallelLinear, RowParallelLinear


class OurBlock(nn.Module):
    """Sequence-first ``[s/t, b, h]`` in and out."""

    def __init__(self, h: int, heads: int):
        super().__init__()
        self.norm1 = LayerNorm(h, sequence_parallel=True)
        self.qkv = QKVParallelLinear(h, heads, heads, bias=False, sequence_parallel=True)
        self.core = CoreAttention(self.qkv.local_heads, self.qkv.local_kv_heads, h // heads, implementation="flash")
        self.proj = RowParallelLinear(h, h, bias=False, sequence_parallel=True)
        self.norm2 = LayerNorm(h, sequence_parallel=True)
        self.fc1 = ColumnParallelLinear(h, 4 * h, bias=False, sequence_parallel=True)
        self.fc2 = RowParallelLinear(4 * h, h, bias=False, sequence_parallel=True)

    def forward(self, x):
        x = x + self.proj(self.core(*self.qkv(self.norm1(x))))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class DenseAttention(nn.Module):
    def __init__(self, h: int, heads: int):
        super().__init__()
        self.heads, self.d = heads, h // heads  # `heads` becomes local heads after parallelize
        self.wq, self.wk, self.wv = (nn.Linear(h, h, bias=False) for _ in range(3))
        self.wo = nn.Linear(h, h, bias=False)

    def forward(self, x):  # [b, s, h]
        b, s, _ = x.shape
        q, k, v = (w(x).view(b, s, -1, self.d).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class DenseMLP(nn.Module):
    def __init__(self, h: int):
        super().__init__()
        self.w1, self.w2 = nn.Linear(h, 4 * h, bias=False), nn.Linear(4 * h, h, bias=False)

    def forward(self, x):
        return self.w2(F.gelu(self.w1(x)))


class DenseBlock(nn.Module):
    """Batch-first ``[b, s, h]``, the layout DTensor's SequenceParallel shards on dim 1."""

    def __init__(self, h: int, heads: int):
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(h), DenseAttention(h, heads)
        self.norm2, self.mlp = nn.LayerNorm(h), DenseMLP(h)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


def dtensor_block(h: int, heads: int, tp: int) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (tp,))
    block = DenseBlock(h, heads)
    plan = {
        "norm1": SequenceParallel(),
        "attn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "attn.wq": ColwiseParallel(),
        "attn.wk": ColwiseParallel(),
        "attn.wv": ColwiseParallel(),
        "attn.wo": RowwiseParallel(output_layouts=Shard(1)),
        "norm2": SequenceParallel(),
        "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "mlp.w1": ColwiseParallel(),
        "mlp.w2": RowwiseParallel(output_layouts=Shard(1)),
    }
    parallelize_module(block, mesh, plan)
    block.attn.heads = heads // tp
    return block


def _time_steps(step, iters: int) -> list[float]:
    times = []
    for _ in range(iters):
        torch.distributed.barrier()
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return times


def _bench(args) -> dict[str, float]:
    nc.initialize_model_parallel(args.tp)
    torch.manual_seed(0)
    s, b, h = args.seq, args.batch, args.hidden
    ours = OurBlock(h, args.heads)
    theirs = dtensor_block(h, args.heads, args.tp)
    _copy_weights(ours, theirs)
    x_ours = torch.randn(s // args.tp, b, h, requires_grad=True)
    # As in torchtitan, the residual stream stays a local [b, s/t, h] tensor between blocks.
    x_theirs = x_ours.detach().transpose(0, 1).contiguous().requires_grad_()
    with torch.no_grad():  # same function before timing it
        y_ours, y_theirs = ours(x_ours).transpose(0, 1), theirs(x_theirs)
        max_rel = ((y_ours - y_theirs).norm() / y_theirs.norm()).item()

    def step_ours():
        ours(x_ours).sum().backward()

    def step_theirs():
        theirs(x_theirs).sum().backward()

    for _ in range(args.warmup):
        step_ours()
        step_theirs()
    t_ours, t_theirs = [], []
    for _ in range(args.rounds):  # alternate so drift hits both
        t_ours += _time_steps(step_ours, args.iters)
        t_theirs += _time_steps(step_theirs, args.iters)
    return {"ours_s": statistics.median(t_ours), "dtensor_s": statistics.median(t_theirs), "rel_err": max_rel}


@torch.no_grad()
def _copy_weights(ours: OurBlock, theirs: nn.Module) -> None:
    """Give the DTensor block our shards (same sharding: colwise = dim 0, rowwise = dim 1)."""
    pairs = [
        (theirs.attn.wq, ours.qkv.q_weight),
        (theirs.attn.wk, ours.qkv.k_weight),
        (theirs.attn.wv, ours.qkv.v_weight),
        (theirs.attn.wo, ours.proj.weight),
        (theirs.mlp.w1, ours.fc1.weight),
        (theirs.mlp.w2, ours.fc2.weight),
    ]
    for linear, shard in pairs:
        linear.weight.to_local().copy_(shard)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    res = run_local(_bench, args.tp, args)[0]
    ratio = res["ours_s"] / res["dtensor_s"]
    print(
        f"TP={args.tp} block (attention + MLP, sequence parallel), s={args.seq} b={args.batch} h={args.hidden} "
        f"heads={args.heads}, gloo, median of {args.iters * args.rounds} fwd+bwd steps"
    )
    print(f"  neuron_ckpt layers : {res['ours_s'] * 1e3:8.1f} ms/step")
    print(f"  DTensor (torch)    : {res['dtensor_s'] * 1e3:8.1f} ms/step")
    print(f"  outputs agree      : relative error {res['rel_err']:.1e} (same weights, same input)")
    print(f"  ratio ours/DTensor : {ratio:.3f}  (target <= 1.0)")


if __name__ == "__main__":
    main()
