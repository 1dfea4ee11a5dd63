"""The rows of ``device_report.py``'s report, with their goals, and the report as a markdown section.

``device_report.json`` (schema 1) holds ``device`` (type, name, driver, kind, peak_tflops_bf16,
memory_bytes), ``torch``, ``command``, ``date``, ``mode`` ("device" or "tiny"), ``shape``, and:

* ``memory``: one row per (layers, attention, preset), present whether measured or not (the
  budget is analytic): ``preset``, ``attention``, ``layers``, ``device_peak_bytes`` (None on CPU
  or where not measured), ``budget_total_bytes``, ``budget_activation_bytes``,
  ``budget_activation_peak_bytes``, ``budget_workspace`` (what the budget's peak workspace is),
  ``measured_activation_bytes`` (what autograd keeps, ``SavedTensorRecorder``),
  ``allocated_before_bytes`` (the device's bytes before the model was built), ``peak_over_budget``,
  ``saved_over_budget``, ``goal``, ``within_goal``, ``measured``;
* ``per_layer``: the bytes one more layer adds, by difference of two layer counts
  (``neuron_ckpt.memory.compare``), per source ("cuda-memory-stats": the allocator's peak, with
  the layer's weights, gradients and optimizer state; "recorder": what autograd keeps):
  ``measured_per_layer_bytes``, ``predicted_per_layer_bytes`` (compare's analytic figure),
  ``budget_per_layer_bytes`` (the budget's own difference, which knows where the step peaks),
  ``ratio``, ``goal``, ``within_goal``, ``agrees``, ``verdict``;
* ``speed``: one row per :data:`SPEED` name, present whether measured or not: ``name``,
  ``ratio`` (None where not measured), ``median_ratio``, ``numerator_s``, ``denominator_s``,
  ``flops_ratio`` (what the FLOPs alone predict, where that means something), ``goal``,
  ``within_goal``, ``note``;
* ``details`` (the bytes behind the transformers comparison, the first compiled steps' seconds), ``skipped``,
  ``errors``, ``elapsed_s``.
"""

from __future__ import annotations

import json
import platform
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import torch

from neuron_ckpt.files import write_atomic
from neuron_ckpt.recompute import PRESETS, RecomputeConfig

MEMORY_GOAL = 0.02  # the device's peak (or the per-layer slope) within 2% of the model's figure
MiB = 2**20


@dataclass(frozen=True)
class Ratio:
    """A speed row: the step seconds of variant ``num`` over ``den`` (for MFU, ``num``'s model
    FLOPs per second over the peak), its goal as (op, bound) where one is set, what it is, and
    for a preset's row the (attention, preset) whose recompute FLOPs predict it."""

    num: str
    den: str
    goal: tuple[str, float] | None
    note: str
    recompute: tuple[str, str] | None = None


SPEED: dict[str, Ratio] = {
    **{f"{a}: {p} / none": Ratio(f"{a}/{p}", f"{a}/none", ("<=", 1.03) if (a, p) == ("explicit", "selective") else None,
                                 f"full steps, {a} attention", (a, p))
       for a in ("explicit", "flash") for p in PRESETS[1:]},
    "flash / explicit": Ratio("flash/none", "explicit/none", ("<=", 1.0),
                              "full steps, no recompute; each model timed in its own stage, one after the other"),
    "compiled / eager": Ratio("compiled", "eager", ("<=", 1.0), "full steps, selective, flash attention"),
    "hf checkpointing / ours planned": Ratio("hf checkpointing", "ours planned", (">=", 1.25),
                                             "forward + backward, eager / explicit attention, equal activation memory"),
    "mfu: flash none": Ratio("flash/none", "", None, "model FLOPs per second of a full step over the dense bf16 peak"),
}  # fmt: skip


def _meets(value: float | None, goal: tuple[str, float] | None) -> bool | None:
    if value is None or goal is None:
        return None
    op, bound = goal
    return value <= bound if op == "<=" else value >= bound


def device_info(device: torch.device, kind: str | None) -> dict:
    """Name, driver, memory and the dense bf16 peak (``neuron_ckpt.train.peak_tflops``) of ``device``."""
    from neuron_ckpt.train import peak_tflops

    kind = kind or {"cuda": "h100", "neuron": "trn2"}.get(device.type, "cpu")
    info = {
        "type": device.type,
        "name": platform.processor() or platform.machine(),
        "driver": None,
        "kind": kind,
        "peak_tflops_bf16": peak_tflops(kind, torch.bfloat16),
        "memory_bytes": None,
    }
    if device.type == "cpu":
        return info
    module = getattr(torch, device.type, None)
    if hasattr(module, "get_device_name"):
        info["name"] = module.get_device_name(device)
    info["memory_bytes"] = max(torch.accelerator.get_memory_info(device))  # (free, total), as cuda.mem_get_info
    if device.type == "cuda":
        info["cuda_runtime"] = torch.version.cuda
        if shutil.which("nvidia-smi"):
            query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader", f"--id={device.index or 0}"]
            done = subprocess.run(query, capture_output=True, text=True, timeout=30)
            info["driver"] = done.stdout.strip() or None
    return info


def memory_row(shape, setup, attention: str, preset: str, layers: int, measured: dict | None) -> dict:
    """One memory row: the budget of (shape, setup, preset) next to what was measured (or None)."""
    from neuron_ckpt.memory import memory_budget

    budget = memory_budget(shape, setup, RecomputeConfig.preset(preset))
    measured = measured or {}
    peak, saved = measured.get("device_peak_bytes"), measured.get("saved_bytes")
    ratio = peak / budget.total_bytes if peak is not None else None
    return {
        "preset": preset, "attention": attention, "layers": layers, "device_peak_bytes": peak,
        "budget_total_bytes": budget.total_bytes, "budget_activation_bytes": budget.activation_bytes,
        "budget_activation_peak_bytes": budget.activation_peak_bytes, "budget_workspace": budget.items[-1].note,
        "measured_activation_bytes": saved, "allocated_before_bytes": measured.get("allocated_before_bytes"),
        "peak_over_budget": ratio,
        "saved_over_budget": saved / budget.activation_bytes if saved is not None else None,
        "goal": f"device peak within {MEMORY_GOAL:.0%} of the budget's total",
        "within_goal": None if ratio is None else abs(ratio - 1) <= MEMORY_GOAL,
        "measured": bool(measured),
    }  # fmt: skip


def per_layer_row(shapes: tuple, setup, attention: str, preset: str, comparison) -> dict:
    """One per-layer row: ``comparison`` (:class:`neuron_ckpt.memory.compare.Comparison` of runs at
    the layer counts of ``shapes``) next to the budget's difference between those shapes."""
    from neuron_ckpt.memory import memory_budget
    from neuron_ckpt.memory.compare import COVERAGE

    lo, hi = (memory_budget(s, setup, RecomputeConfig.preset(preset)) for s in shapes)
    source = comparison.source
    whole = COVERAGE[source].with_state  # the allocator's peak: the budget's total moves with the layers
    diff = (hi.total_bytes - lo.total_bytes) if whole else (hi.activation_bytes - lo.activation_bytes)
    measured, predicted = comparison.measured.bytes_per_layer, comparison.predicted
    ratio = measured / predicted if predicted else None
    return {
        "preset": preset, "attention": attention, "source": source, "layers": [s.layers for s in shapes],
        "measured_per_layer_bytes": measured, "predicted_per_layer_bytes": predicted,
        "budget_per_layer_bytes": diff / (shapes[1].layers - shapes[0].layers), "ratio": ratio,
        "goal": f"within {MEMORY_GOAL:.0%} of the analytic per-layer figure",
        "within_goal": None if ratio is None else abs(ratio - 1) <= MEMORY_GOAL,
        "agrees": comparison.agrees, "verdict": comparison.verdict(),
    }  # fmt: skip


def speed_rows(shape, setups: dict, best: dict[str, float], median: dict[str, float], peak_tflops: float) -> list[dict]:
    """Every :data:`SPEED` row from the best (and median) step seconds measured, by variant;
    ``setups``: the job's :class:`TrainingSetup` by attention."""
    from neuron_ckpt.memory.options import layer_option, step_flops

    rows = []
    for name, r in SPEED.items():
        row = {
            "name": name,
            "ratio": None,
            "median_ratio": None,
            "numerator_s": best.get(r.num),
            "denominator_s": best.get(r.den),
            "flops_ratio": None,
            "goal": None if r.goal is None else f"{r.goal[0]} {r.goal[1]:g}",
            "within_goal": None,
            "note": r.note,
        }
        if not r.den:  # MFU
            flops = step_flops(shape, setups["flash"])
            if r.num in best:
                row["ratio"] = flops / best[r.num] / (peak_tflops * 1e12)
                row["median_ratio"] = flops / median[r.num] / (peak_tflops * 1e12)
            row["note"] += f" ({peak_tflops:g} TFLOP/s; {flops / 1e12:.2f} TFLOP a step)"
        elif r.num in best and r.den in best:
            row["ratio"], row["median_ratio"] = best[r.num] / best[r.den], median[r.num] / median[r.den]
        if r.recompute is not None:  # one more forward of what the preset recomputes
            setup = setups[r.recompute[0]]
            rerun = layer_option(shape, setup, RecomputeConfig.preset(r.recompute[1])).recompute_flops
            row["flops_ratio"] = 1 + shape.layers * rerun / step_flops(shape, setup)
        row["within_goal"] = _meets(row["ratio"], r.goal)
        rows.append(row)
    return rows


def write_json(path: Path, report: dict) -> None:
    write_atomic(path, (json.dumps(report, indent=1, default=str) + "\n").encode("utf-8"))


def mib(value) -> str:
    return "n/a" if value is None else f"{value / MiB:,.1f}"


def _num(value, digits: int = 3) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def _met(value: bool | None) -> str:
    return {True: "yes", False: "**no**", None: "n/a"}[value]


def render_section(r: dict) -> str:
    """The report as a dated markdown section: the device, the command, every figure with its goal."""
    d, s = r["device"], r["shape"]
    lines = [
        "",
        f"## {r['date'][:10]}: {d['name']} ({d['type']}{', tiny: plumbing only' if r['mode'] == 'tiny' else ''})",
        "",
        (
            f"Device {d['name']}, driver {d['driver'] or 'n/a'}, memory {mib(d['memory_bytes'])} MiB, dense bf16 peak "
            f"{d['peak_tflops_bf16']:g} TFLOP/s ({d['kind']}); torch {r['torch']}. Ran {r['elapsed_s']:.0f} s:"
        ),
        "",
        f"    {r['command']}",
        "",
        (
            f"Llama h {s['hidden']}, {s['layers'][1]} layers ({s['layers'][0]} for the difference), "
            f"{s['heads']} heads, {s['kv_heads']} kv heads, f {s['ffn']}, v {s['vocab']}, s {s['seq']}, "
            f"micro-batch 1, bf16, TP 1, ZeRO-1 AdamW at dp 1."
        ),
        "",
        "Memory, one step after a warm-up (MiB; goal: the device's peak within 2% of the budget's total):",
        "",
        (
            "| layers | attention | preset | device peak | budget total | peak / budget | goal met | kept (recorder) "
            "| budget activations | budget activation peak | budget workspace |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for m in r["memory"]:
        lines.append(
            f"| {m['layers']} | {m['attention']} | {m['preset']} | {mib(m['device_peak_bytes'])} | "
            f"{mib(m['budget_total_bytes'])} | {_num(m['peak_over_budget'], 4)} | {_met(m['within_goal'])} | "
            f"{mib(m['measured_activation_bytes'])} | {mib(m['budget_activation_bytes'])} | "
            f"{mib(m['budget_activation_peak_bytes'])} | {m['budget_workspace']} |"
        )
    before = [m["allocated_before_bytes"] for m in r["memory"] if m["allocated_before_bytes"] is not None]
    if before:  # a model or a cache a stage left would sit under every later peak
        lines += ["", f"Allocated on the device before each model was built: at most {mib(max(before))} MiB."]
    lines += [
        "",
        "Per layer, by difference of the two layer counts (MiB; goal: within 2% of the analytic figure):",
        "",
        "| attention | preset | source | measured | analytic | budget difference | ratio | goal met | verdict |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for p in r["per_layer"]:
        lines.append(
            f"| {p['attention']} | {p['preset']} | {p['source']} | {mib(p['measured_per_layer_bytes'])} | "
            f"{mib(p['predicted_per_layer_bytes'])} | {mib(p['budget_per_layer_bytes'])} | "
            f"{_num(p['ratio'], 4)} | {_met(p['within_goal'])} | {p['verdict']} |"
        )
    lines += [
        "",
        "Speed (best step of each; medians beside):",
        "",
        "| ratio | value | median | FLOPs alone | goal | goal met | what |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in r["speed"]:
        lines.append(
            f"| {row['name']} | {_num(row['ratio'])} | {_num(row['median_ratio'])} | "
            f"{_num(row['flops_ratio'])} | {row['goal'] or 'none set'} | {_met(row['within_goal'])} | "
            f"{row['note']} |"
        )
    e = r["details"]
    if "hf_saved_bytes" in e:
        lines += [
            "",
            (
                f"Equal memory: transformers keeps {mib(e['hf_saved_bytes'])} MiB (+{mib(e['hf_closure_bytes'])} "
                f"MiB held by its checkpoints' arguments, not counted), ours as planned ({e['plan']}) "
                f"{mib(e['ours_saved_bytes'])} MiB measured, {mib(e['planned_bytes'])} MiB planned."
            ),
        ]
    if e.get("offload", {}).get("host_link"):
        o, link = e["offload"], e["offload"]["host_link"]
        lines += [
            "",
            (
                f"Offload of the MLP (every layer but the last): step {_num(o['ratio'])} of the plain one, "
                f"{o['exposed_s'] * 1e3:.2f} ms exposed of {o['copies_alone_s'] * 1e3:.2f} ms of copies alone. "
                f"Host link {link['d2h_gbps']:.2f} GB/s to host, {link['h2d_gbps']:.2f} GB/s back; matmul "
                f"{o['matmul_tflops']:.1f} TFLOP/s: `neuron-ckpt plan --host-link {link['d2h_gbps']:.1f},"
                f"{link['h2d_gbps']:.1f} --device-tflops {o['matmul_tflops']:.1f}` (docs/offload.md)."
            ),
        ]
    if "compile_s" in e:
        lines += ["", f"torch.compile: the first two compiled steps took {e['compile_s']:.1f} s."]
    for label, items in (("Skipped", r["skipped"]), ("Failed", r["errors"])):
        if items:
            lines += ["", f"{label}:", ""] + [f"- {item}" for item in items]
    return "\n".join(lines) + "\n"


__all__ = [
    "MEMORY_GOAL",
    "SPEED",
    "Ratio",
    "device_info",
    "memory_row",
    "mib",
    "per_layer_row",
    "render_section",
    "speed_rows",
    "write_json",
]
