"""An MoE layer's step time at EP 2 against TP 2, on two gloo processes, side by side in one run.

One transformers ``MixtralSparseMoeBlock`` (router, ``E`` experts, top ``k``; experts on
``grouped_mm``, transformers' default), forward and backward, on the same global tokens:

* **TP 2** (``moe_tp_experts``): both ranks see all ``T`` tokens; each runs every expert at half its
  intermediate size; the output is all-reduced, and so are the gradients of the input and of the
  routing weights.
* **EP 2** (``ep_dispatch_experts``, the dropless all-to-all): each rank holds ``E/2`` whole experts
  and routes its own ``T/2`` tokens (expert parallelism is carved from data parallelism); the routes
  go to their experts' rank and back by two uneven all-to-alls, after a count exchange.

Both do the same expert FLOPs per rank; TP moves ``2 T h`` elements per rank through two
all-reduces (forward and backward), EP about ``T/2 k h`` through four all-to-alls (half of which
stay on the rank). Each iteration times one step of each layout (barrier, then the slower rank's
time), alternating, so a ratio compares steps taken under the same machine load. Checks first that
EP's output equals TP's rows of the same tokens::

    python scripts/bench_expert_parallel.py                       # h 512, F 1408, E 8, k 2, T 4096
    python scripts/bench_expert_parallel.py --tokens 8192 --iters 10
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from neuron_ckpt.distributed.local import LocalWorld

TP_PLAN = {"experts.gate_up_proj": "packed_colwise", "experts.down_proj": "rowwise", "experts": "moe_tp_experts"}
EP_PLAN = {
    "experts.gate_up_proj": "grouped_gemm",
    "experts.down_proj": "grouped_gemm",
    "experts": "ep_dispatch_experts",
}


def _block(a):
    import transformers

    config = transformers.MixtralConfig(hidden_size=a.hidden, intermediate_size=a.ffn, num_local_experts=a.experts,
                                        num_experts_per_tok=a.top_k)  # fmt: skip
    config._experts_implementation = "grouped_mm"
    torch.manual_seed(0)
    block = transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock(config)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.05)
    return block


def _run(a) -> dict:
    import torch.distributed as dist

    import neuron_ckpt as nc
    from neuron_ckpt.distributed import collectives as C

    tp_state = nc.initialize_model_parallel(2)
    nc.destroy_model_parallel()  # its groups stay usable
    ep_state = nc.initialize_model_parallel(1, expert_model_parallel_size=2)
    tp_block = nc.apply_tensor_parallel(_block(a), TP_PLAN, parallel_state=tp_state)
    ep_block = nc.apply_tensor_parallel(_block(a), EP_PLAN, parallel_state=ep_state)
    rank = dist.get_rank()
    x = torch.randn(1, a.tokens, a.hidden, generator=torch.Generator().manual_seed(1))
    mine = x[:, rank * a.tokens // 2 : (rank + 1) * a.tokens // 2]  # EP: this rank's half (its own batch)

    def step(block, inp):
        inp = inp.clone().requires_grad_()
        out = block(inp)
        out.float().pow(2).mean().backward()
        return out.detach()

    same = (step(ep_block, mine) - step(tp_block, x)[:, rank * a.tokens // 2 : (rank + 1) * a.tokens // 2]).abs().max()
    times: dict[str, list[float]] = {"TP 2": [], "EP 2": []}
    for i in range(a.warmup + a.iters):
        for name, block, inp in (("TP 2", tp_block, x), ("EP 2", ep_block, mine)):
            dist.barrier()
            start = time.perf_counter()
            step(block, inp)
            elapsed = float(C.all_reduce(torch.tensor(time.perf_counter() - start), tp_state.tp, op="max"))
            if i >= a.warmup:
                times[name].append(elapsed)
            block.zero_grad(set_to_none=True)
    return {"times": times, "same": float(same)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--ffn", type=int, default=1408, help="each expert's intermediate size")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--tokens", type=int, default=4096, help="global tokens per step (EP: half on each rank)")
    p.add_argument("--iters", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    a = p.parse_args(argv)
    with LocalWorld(2) as world:
        r = world.run(_run, a)[0]
    print(f"MoE block: h {a.hidden}, F {a.ffn}, E {a.experts}, top {a.top_k}, {a.tokens} tokens per step, "
          f"forward + backward, 2 gloo ranks, 1 thread each; "
          f"EP output vs TP output max abs diff {r['same']:.1e}")  # fmt: skip
    tp = r["times"]["TP 2"]
    print("| layout | best | median | ratio to TP 2, best | ratio to TP 2, median |")
    print("| --- | --- | --- | --- | --- |")
    for name, t in r["times"].items():
        best, med = min(t), statistics.median(t)
        print(f"| {name} | {best * 1e3:.1f} ms | {med * 1e3:.1f} ms | {best / min(tp):.3f} | "
              f"{med / statistics.median(tp):.3f} |")  # fmt: skip


if __name__ == "__main__":
    main()
