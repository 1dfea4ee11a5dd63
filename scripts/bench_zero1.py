"""Step time and per-rank optimizer state of ``Zero1Optimizer`` against torch's
``ZeroRedundancyOptimizer``, side by side in one run.

DP 2 on gloo (two local processes, one thread each), the same model (a stack of square Linear
layers, ~200 MB of fp32 parameters by default) and the same data on both::

    python scripts/bench_zero1.py                  # 12 x Linear(2048, 2048), fp32, 8 timed steps
    python scripts/bench_zero1.py --caps 128 8 2   # ours at each bucket cap (MiB), torch once
    python scripts/bench_zero1.py --dtype bf16     # bf16 parameters: ours accumulates in fp32

* ours: ``Zero1Optimizer(AdamW)``: backward with no communication, then per bucket a
  reduce-scatter of the gradients, AdamW on this rank's fp32 slices, an all-gather of parameters,
  at each ``--caps`` bucket cap (the default 128 MiB, sized for Neuron, and 8 MiB: on CPU,
  buckets that stay in cache make AdamW and the copies faster and let more collectives overlap);
* torch: ``DistributedDataParallel`` (gradient all-reduce overlapped with backward, 25 MB
  buckets) + ``ZeroRedundancyOptimizer(AdamW)`` (AdamW on this rank's parameters, then a
  broadcast of every rank's parameters). torch's ZeRO needs DDP (or any all-reduce) for the
  gradients, so a step against a step is the fair comparison.

A step is ``zero_grad`` + forward + backward + optimizer step, between barriers (the slowest
rank's time). The variants take turns every iteration (in rotating order) so load drift on a
shared machine hits them alike; best and median of ``--iters`` after ``--warmup``. State bytes are the tensors each rank
holds for the optimizer: ours the fp32 master slices + AdamW moments, torch's its local AdamW's
moments (its parameters are the model's own). "of dense" divides by what one unsharded optimizer
of the same kind holds. Targets (printed, not asserted): time ratio <= 1.0, state 1/dp.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from torch import nn

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--batch", type=int, default=32, help="rows per rank per step")
    p.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    p.add_argument("--caps", type=float, nargs="+", default=[128, 8], help="ours' bucket_cap_mb values")
    p.add_argument("--accumulate-fp32", default="auto", choices=["auto", "on", "off"],
                   help="ours: gradients into fp32 buffers by hooks (auto: for bf16 parameters only)")
    p.add_argument("--iters", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--dp", type=int, default=2)
    return p.parse_args(argv)


def _model(a: argparse.Namespace) -> nn.Module:
    torch.manual_seed(0)
    layers = []
    for _ in range(a.layers):
        layers += [nn.Linear(a.width, a.width), nn.Tanh()]
    return nn.Sequential(*layers).to(DTYPES[a.dtype])


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if torch.is_tensor(t) and t.dim() > 0)


def _max_diff(a: nn.Module, b) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b))


def _on_rank(a: argparse.Namespace) -> dict:
    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    import neuron_ckpt as nc
    from neuron_ckpt.optim import Zero1Optimizer

    ps = nc.initialize_model_parallel(1)
    base = _model(a)
    init = [p.detach().clone() for p in base.parameters()]
    hyper = {"lr": 1e-4, "weight_decay": 0.1}
    g = torch.Generator().manual_seed(ps.dp_rank)
    x = torch.randn(a.batch, a.width, generator=g).to(DTYPES[a.dtype])

    def stepper(model: nn.Module, opt: torch.optim.Optimizer):
        def step() -> None:
            opt.zero_grad()
            model(x).float().pow(2).mean().backward()
            opt.step()

        return step

    variants: dict[str, tuple] = {}  # name: (model, optimizer, step)
    accumulate = {"auto": None, "on": True, "off": False}[a.accumulate_fp32]
    for cap in a.caps:
        model = copy.deepcopy(base)
        opt = Zero1Optimizer(
            model.parameters(), torch.optim.AdamW, bucket_cap_mb=cap, accumulate_fp32=accumulate, **hyper
        )
        variants[f"ours {cap:g} MiB"] = (model, opt, stepper(model, opt))
    model = copy.deepcopy(base)
    ddp = DistributedDataParallel(model)
    opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, **hyper)
    variants["torch"] = (model, opt, stepper(ddp, opt))
    del base

    names = list(variants)
    times: dict[str, list[float]] = {name: [] for name in names}
    for i in range(a.warmup + a.iters):
        for name in names[i % len(names) :] + names[: i % len(names)]:
            dist.barrier()
            t0 = time.perf_counter()
            variants[name][2]()
            dist.barrier()
            if i >= a.warmup:
                times[name].append(time.perf_counter() - t0)

    torch_model, theirs, _ = variants["torch"]
    out = {
        "times": times,
        "params": sum(p.numel() for p in torch_model.parameters()),
        "torch_state": _bytes(t for s in theirs.optim.state.values() for t in s.values()),
        "moved": _max_diff(torch_model, init),
        "ours": {},
    }
    for name in names[:-1]:
        model, opt, _ = variants[name]
        out["ours"][name] = {
            "state": _bytes([b.master for b in opt.buckets])
            + _bytes(t for s in opt.inner.state.values() for t in s.values()),
            "buckets": len(opt.buckets),
            # Same trajectory: both are AdamW on the DP-mean gradient (fp32 masters in ours).
            "drift": _max_diff(model, torch_model.parameters()),
        }
    return out


def main(argv: list[str] | None = None) -> None:
    from neuron_ckpt.distributed.local import LocalWorld

    a = parse_args(argv)
    with LocalWorld(a.dp, threads=1) as world:
        results = world.run(_on_rank, a)
    r0 = results[0]
    n = r0["params"]
    itemsize = torch.empty((), dtype=DTYPES[a.dtype]).element_size()
    print(
        f"model {a.layers} x Linear({a.width}, {a.width}) {a.dtype}: {n / 1e6:.1f} M parameters "
        f"({n * itemsize / 2**20:.0f} MiB), batch {a.batch}/rank, dp {a.dp} on gloo, 1 thread/rank, "
        f"AdamW; {a.iters} timed steps each after {a.warmup} warm-up"
    )
    t = r0["times"]  # every rank's times span the same barriers: rank 0's are the steps'
    best = {k: min(v) for k, v in t.items()}
    med = {k: statistics.median(v) for k, v in t.items()}
    for k in t:
        extra = f" ({r0['ours'][k]['buckets']} buckets)" if k in r0["ours"] else " (DDP + ZeroRedundancyOptimizer)"
        ratio = "" if k == "torch" else (
            f"  ratio to torch: best {best[k] / best['torch']:.3f}, median {med[k] / med['torch']:.3f} (target <= 1.0)"
        )
        print(f"  step {k:14s}: best {best[k]:.3f} s  median {med[k]:.3f} s{extra}{ratio}")
    # Dense = one unsharded optimizer of the same kind: ours fp32 master + 2 moments (12 bytes a
    # parameter), torch's 2 moments in the parameter dtype.
    for rank, r in enumerate(results):
        for k, o in r["ours"].items():
            print(
                f"  rank {rank} optimizer state: {k} {o['state'] / 2**20:.1f} MiB = {o['state'] / (12 * n):.4f} of "
                f"dense (1/dp = {1 / a.dp:.4f}); torch {r['torch_state'] / 2**20:.1f} MiB = "
                f"{r['torch_state'] / (2 * itemsize * n):.4f} of dense; ours/torch {o['state'] / r['torch_state']:.2f}"
            )
    drift = max(o["drift"] for r in results for o in r["ours"].values())
    moved = max(r["moved"] for r in results)
    print(
        f"  same trajectory: max |ours - torch| parameter difference {drift:.2e}, "
        f"while parameters moved up to {moved:.2e}"
    )


if __name__ == "__main__":
    main()
