"""Step time with and without offloading one module, and the copy time left exposed, in one run.

::

    python scripts/bench_offload.py                      # CPU: the mechanics (no overlap possible, see below)
    python scripts/bench_offload.py --device cuda        # a lent GPU: Llama-2 7B's layer shape, bf16
    python scripts/bench_offload.py --device cuda --module core_attn --recompute selective --json out.json

Our ``LlamaForCausalLM`` (TP 1) built twice from one seed: ``--recompute`` alone, and
``--recompute`` with ``offload_modules=[--module]`` (every layer but the last, as one config does).
Forward + backward steps of the two take turns (the order alternates, so drift hits both alike),
``--iters`` timed steps after ``--warmup``, the device synchronized around each step. Printed:

* **bytes**: what one step offloads (``offload_stats``: each storage once) and what the
  activations kept on the device come to with and without it (``SavedTensorRecorder`` over one
  forward: the offloaded storages are not among them); on an accelerator also each variant's
  peak allocated memory over a step;
* **copies alone**: the time to copy that many bytes to host and back on their own (one buffer,
  pinned on CUDA, synchronized, each direction timed apart): what offload would cost if nothing
  overlapped, and the **host link** in GB/s each way, with the device's **matmul** TFLOP/s at the
  layer's MLP shape: the figures ``neuron-ckpt plan --host-link D2H,H2D --device-tflops F`` takes;
* **steps**: best and median step of each variant, and the **exposed** copy time: the offload
  step's time minus the plain step's (best of each, medians beside), as a share of the copies
  alone (``hidden``: 1 - exposed / copies alone, clipped to [0, 1]); ``settled``: copies to host the compute stream
  had to wait for per step (not done when the layer after next started);
* the ratio of the two steps.

On CPU the "device" is host memory: the copies are host-to-host and run inline (no streams), so
nothing overlaps and nothing is saved; the exposed time is simply the copies' cost, and the script
says so. The overlap shows only on an accelerator (CUDA here; TorchNeuron's streams are untested).
``scripts/device_report.py`` runs :func:`measure` as one of its stages on a lent device.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

CPU_SHAPE = dict(seq=512, hidden=1024, heads=8, kv_heads=8, ffn=2816, layers=4, dtype="fp32", iters=5, warmup=1)
GPU_SHAPE = dict(seq=4096, hidden=4096, heads=32, kv_heads=32, ffn=11008, layers=4, dtype="bf16", iters=10, warmup=2)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from neuron_ckpt.recompute import PRESETS
    from neuron_ckpt.recompute.config import OFFLOAD_MODULES

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu", help="cpu (default) or an accelerator (cuda)")
    p.add_argument("--module", default="mlp", choices=OFFLOAD_MODULES, help="the module offloaded (default mlp)")
    p.add_argument("--recompute", default="none", choices=PRESETS, help="the recompute preset of both variants")
    p.add_argument("--attention", default="explicit", choices=["explicit", "flash"])
    for name in ("seq", "hidden", "heads", "kv_heads", "ffn", "layers", "iters", "warmup"):
        p.add_argument("--" + name.replace("_", "-"), type=int, default=None, help="default: by device (docstring)")
    p.add_argument("--dtype", default=None, choices=list(DTYPES))
    p.add_argument("--json", default=None, help="also write the figures here")
    a = p.parse_args(argv)
    defaults = CPU_SHAPE if a.device == "cpu" else GPU_SHAPE
    for name, value in defaults.items():
        if getattr(a, name) is None:
            setattr(a, name, value)
    for name in ("seq", "hidden", "heads", "kv_heads", "ffn", "layers", "iters"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    if a.layers < 2:
        p.error(f"--layers must be >= 2 (the last layer is never offloaded), got {a.layers}")
    return a


def _sync(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def host_link(nbytes: int, device: torch.device, repeats: int = 5) -> dict[str, float]:
    """Best seconds to copy ``nbytes`` to host (``d2h``) and back (``h2d``), each direction on its
    own (one buffer, pinned on CUDA), and what they come to in GB/s: ``neuron-ckpt plan
    --host-link D2H,H2D``."""
    source = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    best = {"d2h": float("inf"), "h2d": float("inf")}
    for _ in range(repeats):
        for direction, (dst, src) in {"d2h": (host, source), "h2d": (source, host)}.items():
            _sync(device)
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            _sync(device)
            best[direction] = min(best[direction], time.perf_counter() - t0)
    return {**{f"{k}_s": v for k, v in best.items()}, **{f"{k}_gbps": nbytes / v / 1e9 for k, v in best.items()}}


def matmul_tflops(device: torch.device, dtype: torch.dtype, m: int, k: int, n: int, repeats: int = 5) -> float:
    """Achieved TFLOP/s of one ``[m, k] @ [k, n]`` matmul, best of ``repeats``: ``neuron-ckpt plan
    --device-tflops`` (the rate that prices a copy's exposed time against recompute)."""
    a, b = torch.randn(m, k, device=device, dtype=dtype), torch.randn(k, n, device=device, dtype=dtype)
    a @ b  # warm-up (kernel selection)
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        a @ b
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * m * k * n / best / 1e12


def measure(config, device: torch.device, dtype: torch.dtype, ids: torch.Tensor, module: str, recompute: str,
            attention: str, iters: int, warmup: int) -> dict:  # fmt: skip
    """The figures of the module docstring for our Llama of ``config`` (a ``LlamaArgs``) on ``device``."""
    from neuron_ckpt.memory import SavedTensorRecorder
    from neuron_ckpt.models.llama import LlamaForCausalLM
    from neuron_ckpt.recompute import RecomputeConfig, apply_recompute
    from neuron_ckpt.recompute.offload import offload_stats

    base = RecomputeConfig.preset(recompute)
    configs = {"plain": base, "offload": RecomputeConfig(**{**vars_of(base), "offload_modules": (module,)})}
    models = {}
    for name, rc in configs.items():
        torch.manual_seed(0)
        models[name] = LlamaForCausalLM(config, attention_implementation=attention, dtype=dtype).to(device).train()
        apply_recompute(models[name], rc)
    stats = offload_stats(models["offload"])

    def step(model) -> None:
        model.zero_grad(set_to_none=True)
        model(ids, labels=ids).loss.backward()

    kept = {}
    for name, model in models.items():
        with SavedTensorRecorder(exclude_modules=[model]) as rec:
            loss = model(ids, labels=ids).loss
        kept[name] = rec.total_bytes
        loss.backward()
        model.zero_grad(set_to_none=True)
    stats.reset()
    step(models["offload"])
    per_step = {"bytes": stats.total_bytes, "copies": stats.copies, "settled": stats.settled,
                "prefetched": stats.prefetched, "reloads": stats.reloads}  # fmt: skip
    peak = {}
    if device.type != "cpu":
        for name, model in models.items():
            _sync(device)
            torch.accelerator.reset_peak_memory_stats(device)
            step(model)
            _sync(device)
            peak[name] = torch.accelerator.max_memory_allocated(device)

    times: dict[str, list[float]] = {name: [] for name in models}
    settled: list[int] = []
    names = list(models)
    for it in range(warmup + iters):
        for name in names if it % 2 == 0 else names[::-1]:
            stats.reset()
            _sync(device)
            t0 = time.perf_counter()
            step(models[name])
            _sync(device)
            if it >= warmup:
                times[name].append(time.perf_counter() - t0)
                if name == "offload":
                    settled.append(stats.settled)
    best = {k: min(v) for k, v in times.items()}
    median = {k: statistics.median(v) for k, v in times.items()}
    link = host_link(per_step["bytes"], device) if per_step["bytes"] else None
    alone = link["d2h_s"] + link["h2d_s"] if link else 0.0
    tflops = matmul_tflops(device, dtype, ids.numel(), config.hidden_size, config.intermediate_size)
    exposed, exposed_median = best["offload"] - best["plain"], median["offload"] - median["plain"]
    return {
        "device": str(device), "module": module, "recompute": recompute, "attention": attention,
        "offloaded_bytes_per_step": per_step["bytes"], "copies_per_step": per_step["copies"],
        "reloads_per_step": per_step["reloads"], "prefetched_per_step": per_step["prefetched"],
        "settled_per_step": statistics.median(settled) if settled else None,
        "kept_bytes": kept, "peak_allocated_bytes": peak or None,
        "copies_alone_s": alone, "host_link": link, "matmul_tflops": tflops,
        "step_best_s": best, "step_median_s": median,
        "exposed_s": exposed, "exposed_median_s": exposed_median,
        "hidden_fraction": min(1.0, max(0.0, 1 - exposed / alone)) if alone > 0 else None,
        "ratio": best["offload"] / best["plain"], "median_ratio": median["offload"] / median["plain"],
    }  # fmt: skip


def vars_of(config) -> dict:
    import dataclasses

    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}


def render(r: dict) -> str:
    mib = 2**20
    kept = r["kept_bytes"]
    lines = [
        f"offload {r['module']} (every layer but the last), recompute {r['recompute']}, {r['attention']} attention, "
        + f"on {r['device']}",
        f"  offloaded per step {r['offloaded_bytes_per_step'] / mib:9.2f} MiB in {r['copies_per_step']} copies; "
        + f"{r['prefetched_per_step']} of {r['reloads_per_step']} reloads prefetched; settled (compute waited for a "
        + f"copy) {r['settled_per_step']} per step",
        f"  kept on the device  plain {kept['plain'] / mib:9.2f} MiB   offload {kept['offload'] / mib:9.2f} MiB"
        + "   (activations, SavedTensorRecorder)",
    ]
    if r["peak_allocated_bytes"]:
        p = r["peak_allocated_bytes"]
        lines.append(f"  peak allocated      plain {p['plain'] / mib:9.2f} MiB   offload {p['offload'] / mib:9.2f} MiB")
    b, m = r["step_best_s"], r["step_median_s"]
    lines += [
        f"  step plain    best {b['plain'] * 1e3:9.2f} ms   median {m['plain'] * 1e3:9.2f} ms",
        f"  step offload  best {b['offload'] * 1e3:9.2f} ms   median {m['offload'] * 1e3:9.2f} ms",
        f"  copies alone (to host and back, nothing else running) {r['copies_alone_s'] * 1e3:9.2f} ms",
        f"  exposed copy time {r['exposed_s'] * 1e3:9.2f} ms (medians {r['exposed_median_s'] * 1e3:.2f} ms)"
        + (f"; hidden {r['hidden_fraction']:.0%} of the copies" if r["hidden_fraction"] is not None else "")
        + (" (negative: below the run's noise)" if r["exposed_s"] < 0 else ""),
        f"  offload / plain {r['ratio']:.3f} (medians {r['median_ratio']:.3f})",
    ]
    if r["host_link"]:
        link = r["host_link"]
        lines.append(
            f"  host link {link['d2h_gbps']:.2f} GB/s to host, {link['h2d_gbps']:.2f} GB/s back; matmul "
            f"{r['matmul_tflops']:.2f} TFLOP/s: neuron-ckpt plan --host-link {link['d2h_gbps']:.1f},"
            f"{link['h2d_gbps']:.1f} --device-tflops {r['matmul_tflops']:.1f}"
        )
    if r["device"] == "cpu":
        lines.append(
            "  CPU: the copies are host-to-host and run inline (no streams): nothing can overlap and no "
            "memory is saved; the exposed time is the copies' own cost. Run with --device cuda on a GPU."
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    import neuron_ckpt as nc
    from neuron_ckpt.models.llama_args import LlamaArgs

    device = torch.device(a.device)
    if device.type != "cpu" and not (torch.accelerator.is_available() and
                                     torch.accelerator.current_accelerator().type == device.type):  # fmt: skip
        print(f"bench_offload.py: --device {a.device}: no such accelerator is visible to torch", file=sys.stderr)
        return 2
    if device.type == "cpu":
        torch.set_num_threads(max(1, torch.get_num_threads()))
    nc.initialize_model_parallel(1)
    nc.model_parallel_manual_seed(0)
    config = LlamaArgs(
        vocab_size=32000,
        hidden_size=a.hidden,
        intermediate_size=a.ffn,
        num_hidden_layers=a.layers,
        num_attention_heads=a.heads,
        num_key_value_heads=a.kv_heads,
        max_position_embeddings=a.seq,
    )
    ids = torch.randint(0, 32000, (1, a.seq), generator=torch.Generator().manual_seed(1)).to(device)
    print(f"our Llama: seq {a.seq}, hidden {a.hidden}, heads {a.heads}/{a.kv_heads}, ffn {a.ffn}, {a.layers} layers, "
          f"{a.dtype}, TP 1, {a.iters} timed steps each (+{a.warmup} warm-up), threads {torch.get_num_threads()}",
          flush=True)  # fmt: skip
    r = measure(config, device, DTYPES[a.dtype], ids, a.module, a.recompute, a.attention, a.iters, a.warmup)
    print(render(r), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(r, indent=1) + "\n")
    nc.destroy_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
