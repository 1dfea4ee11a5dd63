"""Step time and per-rank optimizer state of ``Zero1Optimizer`` against torch's
``ZeroRedundancyOptimizer``, side by side in one run.

DP 2 on gloo (two local processes, one thread each), the same model (a stack of square Linear
layers, ~200 MB of fp32 parameters by default) and the same data on both::

    python scripts/bench_zero1.py                     # 12 x Linear(2048, 2048), fp32, 8 timed steps
    python scripts/bench_zero1.py --caps auto 128 4   # ours at each bucket cap (MiB), torch once
    python scripts/bench_zero1.py --dtype bf16        # bf16 parameters: ours accumulates in fp32

* ours: ``Zero1Optimizer(AdamW)``: backward with no communication, then per bucket a
  reduce-scatter of the gradients, AdamW on this rank's fp32 slices, an all-gather of parameters,
  at each ``--caps`` bucket cap (default: ``auto``, the backend's default cap, 8 MiB on gloo; 128,
  Neuron's; and 16). On gloo the collectives take their gloo forms
  (:mod:`neuron_ckpt.distributed.collectives`: an all-to-all then a local sum for the
  reduce-scatter, broadcasts for the all-gather, reused buffers);
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

Bytes on the wire: one more step of each variant, untimed, with every collective counted (the
torch.distributed functions wrapped in this process; torch's step on a copy of its model whose DDP
all-reduces through torch's Python ``allreduce_hook``, which the wrapper sees). Each call is
charged the bytes one rank sends, averaged over the group's p ranks, for the algorithm gloo runs,
of the call's full tensor n (an all-reduce's tensor, a reduce-scatter's or all-to-all's input, an
all-gather's output, a broadcast's tensor): all-reduce 2(p-1)/p n (ring), reduce-scatter,
all-gather and all-to-all (p-1)/p n (ring or pairwise), broadcast (p-1)/p n (a tree: every rank
but the root receives n once), reduce (p^2-1)/p^2 n (gloo's: a ring reduce-scatter, then every
rank but the root sends its 1/p to the root). Printed next to ZeRO-1's minimum, a reduce-scatter
and an all-gather of the flat parameters: 2(p-1)/p of their bytes.
"""

from __future__ import annotations

import argparse
import copy
import inspect
import statistics
import time
from collections import defaultdict
from contextlib import contextmanager

import torch
from torch import nn

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--batch", type=int, default=32, help="rows per rank per step")
    p.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    p.add_argument(
        "--caps",
        type=_cap,
        nargs="+",
        default=["auto", 128.0, 16.0],
        help="ours' bucket_cap_mb values (MiB, or auto: the backend's default)",
    )
    p.add_argument(
        "--accumulate-fp32",
        default="auto",
        choices=["auto", "on", "off"],
        help="ours: gradients into fp32 buffers by hooks (auto: for bf16 parameters only)",
    )
    p.add_argument("--iters", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--dp", type=int, default=2)
    return p.parse_args(argv)


def _cap(text: str) -> float | str:
    return text if text == "auto" else float(text)


# Bytes one rank sends in a call on a full tensor of n bytes over p ranks (module docstring).
SENT_FRACTION = {
    "all_reduce": lambda p: 2 * (p - 1) / p,
    "reduce_scatter": lambda p: (p - 1) / p,
    "all_gather": lambda p: (p - 1) / p,
    "all_to_all": lambda p: (p - 1) / p,
    "broadcast": lambda p: (p - 1) / p,
    "reduce": lambda p: (p * p - 1) / (p * p),
}

# torch.distributed function -> (collective, the argument that holds the full tensor).
_COUNTED = {
    "all_reduce": ("all_reduce", "tensor"),
    "broadcast": ("broadcast", "tensor"),
    "reduce": ("reduce", "tensor"),
    "all_gather_into_tensor": ("all_gather", "output_tensor"),
    "all_gather_single": ("all_gather", "output_tensor"),
    "reduce_scatter_tensor": ("reduce_scatter", "input"),
    "reduce_scatter_single": ("reduce_scatter", "input"),
    "all_to_all_single": ("all_to_all", "input"),
}


class WireCount:
    """Calls and bytes sent by one rank, by collective: ``{name: [calls, payload, sent]}``."""

    def __init__(self) -> None:
        self.by_op: dict[str, list[float]] = defaultdict(lambda: [0, 0, 0.0])

    def add(self, op: str, tensor: torch.Tensor, p: int) -> None:
        if p < 2:
            return
        n = tensor.numel() * tensor.element_size()
        row = self.by_op[op]
        row[0] += 1
        row[1] += n
        row[2] += SENT_FRACTION[op](p) * n

    @property
    def sent(self) -> float:
        return sum(row[2] for row in self.by_op.values())

    @contextmanager
    def counting(self):
        """Count every call of the torch.distributed collectives (also through the names
        ``neuron_ckpt.distributed.collectives`` bound at import) while inside."""
        import torch.distributed as dist

        from neuron_ckpt.distributed import collectives

        patched = []

        def wrap(fn, op, arg):
            sig = inspect.signature(fn)

            def counted(*args, **kwargs):
                bound = sig.bind(*args, **kwargs)
                self.add(op, bound.arguments[arg], dist.get_world_size(bound.arguments.get("group")))
                return fn(*args, **kwargs)

            return counted

        for name, (op, arg) in _COUNTED.items():
            fn = getattr(dist, name, None)
            if fn is None:
                continue
            patched.append((dist, name, fn))
            setattr(dist, name, wrap(fn, op, arg))
            for alias in ("_all_gather_single", "_reduce_scatter_single"):
                if getattr(collectives, alias) is fn:
                    patched.append((collectives, alias, fn))
                    setattr(collectives, alias, getattr(dist, name))
        try:
            yield self
        finally:
            for owner, name, fn in reversed(patched):
                setattr(owner, name, fn)


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
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
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
        variants[f"ours {opt.bucket_cap_mb:g} MiB" + (" (auto)" if cap == "auto" else "")] = (
            model,
            opt,
            stepper(model, opt),
        )
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
    # One more step of each, untimed, counting bytes (after the trajectory check: ours take one
    # more step; torch's is a copy).
    wire = out["wire"] = {}
    for name in names[:-1]:
        with WireCount().counting() as count:
            variants[name][2]()
        wire[name] = dict(count.by_op)
    count = WireCount()
    model = copy.deepcopy(variants["torch"][0])
    counted_ddp = DistributedDataParallel(model)
    # DDP's all-reduce as a Python comm hook (the default one's Python twin), so the wrapper sees it.
    counted_ddp.register_comm_hook(None, allreduce_hook)
    counted_opt = ZeroRedundancyOptimizer(counted_ddp.parameters(), optimizer_class=torch.optim.AdamW, **hyper)
    stepper(counted_ddp, counted_opt)()  # DDP's first step has one bucket; it cuts them after it
    with count.counting():
        stepper(counted_ddp, counted_opt)()
    wire["torch"] = dict(count.by_op)

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
        ratio = ""
        if k != "torch":
            ratio = f"  ratio to torch: best {best[k] / best['torch']:.3f}, median {med[k] / med['torch']:.3f}"
            ratio += " (target <= 1.0)"
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
    print(wire_table(r0["wire"], n * itemsize, a.dp))


def wire_table(wire: dict[str, dict[str, list[float]]], param_bytes: int, p: int) -> str:
    """The bytes-on-the-wire lines: each variant's collectives next to ZeRO-1's minimum."""
    minimum = 2 * (p - 1) / p * param_bytes
    lines = [
        (
            f"  bytes each rank sends per step (MiB; per call, averaged over ranks, for gloo's algorithms: "
            f"see the docstring); ZeRO-1's minimum, a reduce-scatter and an all-gather of the "
            f"{param_bytes / 2**20:.1f} MiB of parameters: 2(p-1)/p of them = {minimum / 2**20:.1f}"
        )
    ]
    for name, ops in wire.items():
        parts = " + ".join(
            f"{op} {sent / 2**20:.1f} ({calls} call{'s' * (calls != 1)})" for op, (calls, _, sent) in ops.items()
        )
        total = sum(row[2] for row in ops.values())
        lines.append(f"    {name:18s}: {parts} = {total / 2**20:.1f} = {total / minimum:.3f} x minimum")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
