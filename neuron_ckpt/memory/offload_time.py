"""Offload priced in time beside recompute: the copy time a layer's offload leaves exposed, in
the planner's currency (FLOPs), and the offload choices the planner weighs.

A layer's offloaded bytes go to host during the forward of the layer after it and come back
during the backward of the layer above it (the engine's prefetch, docs/offload.md). Each copy
hides under that compute; what does not hide is exposed:

    exposed = max(0, bytes / BW_d2h - T_forward) + max(0, bytes / BW_h2d - 2 T_forward)

``T_forward`` the layer's forward at the device's achieved rate ``F`` (a layer's FLOPs as full
recompute reruns them, :mod:`.rerun`), the backward taken as twice the forward. Recompute costs
its rerun FLOPs, ``FLOPs / F`` seconds; so the exposed seconds times ``F`` are the FLOPs a copy
costs, and the planner minimises recompute FLOPs plus exposed-copy FLOPs (``LayerOption.cost``):
it offloads where the copy hides, and recomputes where recomputing is cheaper than waiting.
The rates are the user's (``neuron-ckpt plan --host-link D2H[,H2D] --device-tflops F``;
``scripts/device_report.py`` measures both on a lent device): a bandwidth between the device and
pinned host memory per rank, and matmul throughput, not a datasheet's peak.

Assumptions, said plainly: copies in one direction do not slow compute (DMA engines beside the
SMs) and the ranks of a host do not share its link (on a GPU host with one PCIe switch per two
GPUs they do: give the bandwidth one rank gets while the others copy). Offload runs where there
are streams (CUDA; not XLA, which ``RecomputeConfig`` refuses), so a trn1 plan never offloads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from ..recompute import RecomputeConfig
from .offload import PRICED, layer_offloads
from .options import LayerOption, layer_option
from .shape import ModelShape, TrainingSetup


@dataclass(frozen=True)
class HostLink:
    """Device-to-host and host-to-device bandwidth per rank (GB/s, 1e9 bytes a second, pinned
    memory) and the device's achieved dense throughput (TFLOP/s)."""

    d2h_gbps: float
    h2d_gbps: float
    tflops: float

    def __post_init__(self) -> None:
        for name in ("d2h_gbps", "h2d_gbps", "tflops"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")

    def exposed_copy_flops(self, host_bytes: int, forward_flops: float) -> float:
        """The copy time not hidden under compute (module docstring), as FLOPs at ``tflops``."""
        rate = self.tflops * 1e12
        out = host_bytes / (self.d2h_gbps * 1e9) * rate - forward_flops
        back = host_bytes / (self.h2d_gbps * 1e9) * rate - 2 * forward_flops
        return max(0.0, out) + max(0.0, back)


OFFERED = (("norm",), ("core_attn",), ("mlp",), ("mlp_act",), ("layer",), ("norm", "core_attn", "mlp"))
"""The offload choices weighed beside each recompute choice: each module alone, the three that
keep most, and the whole layer (its input under full recompute)."""


def _valid(config: RecomputeConfig, names: tuple[str, ...]) -> RecomputeConfig | None:
    """``config`` offloading ``names``, or None where that is refused or means nothing (a module
    inside one recomputed whole keeps nothing: ``mlp_act`` under a recomputed ``mlp``)."""
    if config.granularity == "selective" and "mlp" in config.modules and "mlp_act" in names:
        return None
    try:
        return replace(config, offload_modules=names)
    except ValueError:
        return None


def offload_options(
    model: ModelShape,
    setup: TrainingSetup,
    link: HostLink,
    base: dict[str, LayerOption],
    names: tuple[str, ...] | None = None,
) -> dict[str, LayerOption]:
    """Every offered recompute choice (``base``, :func:`~.options.layer_options`) with each offload
    of :data:`OFFERED` (only those within ``names`` when given), its exposed copy time in
    ``copy_flops``; the ones another beats on every count left out. Each is priced as the first
    layer to offload: under ``layer`` that one also copies the rotary tables, so the search counts
    them for every such layer, and the plan's budget, priced layer by layer, holds no more."""
    if model.kind != "llama":
        raise ValueError(f"offload: priced for llama only, got model kind {model.kind!r}")
    if model.layers < 2:
        raise ValueError("offload: the last layer is never offloaded, so a 1-layer model has nothing to offload")
    if names is not None and (unknown := sorted(set(names) - set(PRICED))):
        raise ValueError(f"offload_modules: {unknown} not priced; choose from {list(PRICED)}")
    forward = layer_option(model, setup, "full").recompute_flops  # the layer's forward, as full reruns it
    out: dict[str, LayerOption] = {}
    for config in dict.fromkeys(o.recompute for o in base.values()):
        for wanted in OFFERED:
            if names is not None and not set(wanted) <= set(names):
                continue
            chosen = _valid(config, wanted)
            if chosen is None:
                continue
            x = layer_offloads(model, setup, chosen)[0]
            if not x.host:
                continue
            option = layer_option(model, setup, chosen, 0, x)
            option = replace(option, copy_flops=link.exposed_copy_flops(x.host, forward))
            out[option.name] = option
    everything = {**base, **out}
    return {n: o for n, o in out.items() if not any(_beats(other, o) for other in everything.values())}


def _key(o: LayerOption) -> tuple[float, ...]:
    return (o.saved_bytes, o.backward_peak_bytes + o.reload_bytes, o.cost, o.host_pinned_bytes)


def _beats(a: LayerOption, b: LayerOption) -> bool:
    """``a`` no worse than ``b`` on every count and better on one."""
    ka, kb = _key(a), _key(b)
    return all(x <= y for x, y in zip(ka, kb)) and ka != kb


__all__ = ["OFFERED", "HostLink", "offload_options"]
