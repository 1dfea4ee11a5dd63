"""Profile one training step (forward + backward) of the GPT stack per recompute configuration.

For each of no recompute / selective / full (with or without ``--sequence-parallel``) it prints,
per layer and per rank, side by side:

* analytic: ``neuron_ckpt.memory`` (the paper's Table 2 row for this layer);
* measured: distinct storages kept for backward (``SavedTensorRecorder``);
* profiler: PyTorch's profiler over the whole step. With ``--timeline`` (which needs
  ``with_stack=True``) the memory timeline is exported per configuration and rank
  (``export_memory_timeline``, JSON) and its peak above the step's start is shown; without it,
  or when torch's timeline analysis rejects the graph (it does for this stack in torch 2.13:
  "duplicate outputs" / "version mismatch" assertions), the sum of the positive
  ``self_cpu_memory_usage`` of all ops from ``key_averages()`` (bytes allocated during the step,
  a measure of allocation traffic, not a peak);
* device peak: ``torch.cuda.max_memory_allocated`` with ``--device cuda`` (``--tp 1`` only), or
  the XLA runtime's peak where it reports one; "n/a" on CPU.

Run here (CPU, gloo ranks spawned by ``run_local``)::

    python scripts/profile_memory.py --hidden 256 --heads 8 --seq 512 --micro-batch 2 --tp 2 \
        --sequence-parallel --timeline --out profiles/

Neither a GPU nor Trainium has run this script; only CPU. It is not the way to check the memory
model on trn1: there the compiled step decides what is kept, and no profiler isolates a layer.
Use the capture script and the comparison by difference instead (docs/memory.md, "Checking the
model against a device"; neither has run on a device)::

    python scripts/capture_trn1_memory.py --data ~/data/llama2_train.safetensors --layers 4,8,12,16 --out cap
    neuron-ckpt compare --capture cap
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from neuron_ckpt.distributed import initialize_model_parallel, model_parallel_manual_seed
from neuron_ckpt.distributed.local import run_local
from neuron_ckpt.memory import ModelShape, TrainingSetup, layer_activation_bytes
from neuron_ckpt.memory.layers import build_layers, layer_input, measure_layers
from neuron_ckpt.memory.measure import device_peak_bytes, reset_device_peak
from neuron_ckpt.recompute import run_layers

MIB = 1 << 20


def _timeline_peak(path: Path) -> int:
    """Peak of the exported raw timeline (``[times, sizes per category]``) above its start."""
    times, sizes = json.loads(path.read_text())
    totals = [sum(row) for row in sizes]
    return max(totals) - totals[0] if totals else 0


def _step(model: ModelShape, setup: TrainingSetup, recompute: str, device: torch.device, out_dir: Path | None) -> dict:
    layers, extra = build_layers(model, setup, recompute, model.layers)
    layers.to(device)
    model_parallel_manual_seed(0)
    rank = initialize_model_parallel(setup.tp).tp_rank
    x = layer_input(model, setup, rank).detach().to(device).requires_grad_()
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    reset_device_peak(device)
    timeline = out_dir is not None
    with torch.profiler.profile(
        activities=activities, profile_memory=True, record_shapes=True, with_stack=timeline
    ) as prof:
        out = run_layers(layers, x, *extra)
        out.float().square().mean().backward()
    figures = {"device_peak": device_peak_bytes(device), "timeline_error": None}
    if timeline:
        path = out_dir / f"{recompute}_rank{rank}.json"
        try:
            prof.export_memory_timeline(str(path), device="cuda:0" if device.type == "cuda" else "cpu")
            figures["profiler"] = _timeline_peak(path)
            return figures
        except Exception as exc:  # noqa: BLE001  torch's data-flow analysis rejects some graphs (see docs/memory.md)
            figures["timeline_error"] = f"{type(exc).__name__}: {str(exc)[:120]}"
    figures["profiler"] = sum(max(e.self_cpu_memory_usage, 0) for e in prof.key_averages())
    return figures


def profile_all(
    model: ModelShape, setup: TrainingSetup, presets: tuple[str, ...], device: str, out_dir: str | None
) -> dict[str, dict]:
    """On every rank: measured (recorder) and profiled figures of one step per recompute preset."""
    results = {}
    for name in presets:
        measured = measure_layers(model, setup, name, model.layers, backward=True)
        figures = _step(model, setup, name, torch.device(device), Path(out_dir) if out_dir else None)
        results[name] = {"measured_per_layer": measured.bytes_per_layer, **figures}
    return results


def _fmt(value: int | float | None) -> str:
    return "n/a" if value is None else f"{value / MIB:.3f}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--sequence-parallel", action="store_true")
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="cuda: --tp 1 only (untested here)")
    p.add_argument("--timeline", action="store_true", help="with_stack=True and export the memory timeline")
    p.add_argument("--out", default="profiles", help="directory for the timelines (with --timeline)")
    args = p.parse_args(argv)
    if args.device == "cuda" and (args.tp != 1 or not torch.cuda.is_available()):
        p.error("--device cuda needs a CUDA device and --tp 1 (gloo carries the TP collectives here)")
    presets = ("none", "selective", "full")  # the paper's rows
    try:
        model = ModelShape.gpt(args.hidden, args.heads, args.layers)
        setup = TrainingSetup(
            args.seq, args.micro_batch, args.tp, dtype=args.dtype, sequence_parallel=args.sequence_parallel
        )
        analytic = {name: layer_activation_bytes(model, setup, name) for name in presets}
    except ValueError as exc:
        p.error(str(exc))
    out_dir = None
    if args.timeline:
        os.makedirs(args.out, exist_ok=True)
        out_dir = os.path.abspath(args.out)
    per_rank = run_local(profile_all, args.tp, model, setup, presets, args.device, out_dir)
    errors = {r[name]["timeline_error"] for r in per_rank for name in presets} - {None}
    for error in sorted(errors):
        print(f"memory timeline unusable, fell back to key_averages(): {error}")
    what = "timeline peak" if args.timeline and not errors else "allocated in step"
    print(
        f"GPT stack, {args.layers} layers, s={args.seq} b={args.micro_batch} h={args.hidden} a={args.heads} "
        f"t={args.tp}{' SP' if args.sequence_parallel else ''} {args.dtype} on {args.device}; MiB, rank 0"
    )
    print(
        f"{'recompute':<11}{'analytic/layer':>15}{'measured/layer':>15}{'ratio':>8}"
        f"{'profiler ' + what:>28}{'device peak':>13}"
    )
    for name in presets:
        r = per_rank[0][name]
        print(
            f"{name:<11}{_fmt(analytic[name]):>15}{_fmt(r['measured_per_layer']):>15}"
            f"{r['measured_per_layer'] / analytic[name]:>8.4f}{_fmt(r['profiler']):>28}{_fmt(r['device_peak']):>13}"
        )
    if out_dir and not errors:
        print(f"memory timelines: {out_dir}/<recompute>_rank<r>.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
