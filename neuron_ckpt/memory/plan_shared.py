"""What the ``neuron-ckpt plan`` commands share (this library's Llama and GPT in
:mod:`.plan_cli`, transformers models in :mod:`.moe.plan_cli`): the defaults, the device memory
read from the arguments, and a plan in one line and its recompute written as ``apply_recompute`` takes it."""

from __future__ import annotations

import argparse
import math

from ..recompute import RecomputeConfig
from .budget import GIB
from .planner import DEVICE_PRESETS, Plan, device_memory_bytes

DEFAULT_BUCKET_CAP_MB = 128.0
GPT_ONLY = ("hidden", "heads", "layers", "vocab")


def device_gib(args: argparse.Namespace) -> float:
    """The device memory in GiB, checked: finite, and more than ``--reserve``."""
    spec = args.device_memory
    if isinstance(spec, str) and spec.lower() not in DEVICE_PRESETS:
        try:
            number = float(spec)
        except ValueError:
            number = None
        if number is not None and not math.isfinite(number * GIB):  # inf, nan, or overflows in bytes
            raise ValueError(
                f"--device-memory must be a finite number of GiB (one that fits in bytes) or a preset "
                f"({', '.join(DEVICE_PRESETS)}), got {spec!r}"
            )
    total = device_memory_bytes(spec) / GIB
    if args.reserve is not None and args.reserve >= total:
        raise ValueError(
            f"--reserve {args.reserve:g} GiB leaves nothing of a {total:g} GiB device: "
            f"give a reserve below {total:g} GiB (default: 10% of the device)"
        )
    return total


def _config_text(config: RecomputeConfig) -> str:
    name = None if config.offload_modules else config.preset_name  # a preset's name says nothing of offload
    if name is not None:
        return f'RecomputeConfig.preset("{name}")'
    if not config.offload_modules:
        return repr(config)
    given: dict[str, object] = {"granularity": config.granularity}  # the fields that say something
    if config.granularity == "selective":
        given["modules"] = config.modules
    if config.granularity == "full":
        given |= {"method": config.method, "num_layers": config.num_layers}
    given["offload_modules"] = config.offload_modules
    return "RecomputeConfig(" + ", ".join(f"{k}={v!r}" for k, v in given.items() if v is not None) + ")"


def recompute_text(plan: Plan) -> str:
    """The plan's recompute as ``apply_recompute`` takes it, runs of equal entries together."""
    rc = plan.recompute
    if not isinstance(rc, list):
        return _config_text(rc)
    runs, start = [], 0
    for i in range(1, len(rc) + 1):  # compress runs of equal entries: "layers 0-13: ..."
        if i == len(rc) or rc[i] != rc[start]:
            runs.append(f"  layers {start}-{i - 1}: {_config_text(rc[start])}")
            start = i
    return "a per-layer list for apply_recompute(model, [...]):\n" + "\n".join(runs)


def plan_line(plan: Plan) -> str:
    """The plan in one line: its choices, its bytes, what it reruns and (offloading) what its copies
    leave exposed and pin on the host."""
    offload = (
        f"; offload: copies exposed {plan.copy_overhead:.2%} of the step's time, "
        f"{plan.host_pinned_bytes / GIB:.2f} GiB pinned host per rank"
        if plan.host_pinned_bytes
        else ""
    )
    return (
        f"plan: {plan.describe()} ({plan.budget.total_gib:.2f} GiB, recompute {plan.overhead:.2%} of a step's FLOPs, "
        f"{plan.matmul_overhead:.2%} in matmuls{offload})"
    )


__all__ = ["DEFAULT_BUCKET_CAP_MB", "GPT_ONLY", "device_gib", "plan_line", "recompute_text"]
