"""Does the analytic model tell the truth for a job? Measured bytes per layer, by difference.

No device tool isolates one layer, so the comparison is by difference (issue #23; the method
is in docs/memory.md, "Checking the model against a device"):

* **per-layer slope**: runs of the same job with N1 < N2 < ... decoder layers; the
  least-squares slope of what a report measures (the scratchpad on Neuron, the temporaries in
  XLA's buffer assignment, what autograd keeps on CPU) against N is the bytes one more layer
  adds, which the model predicts as the activations one layer keeps (plus the layer's weights,
  gradients and optimizer state where the report counts them too: CUDA's allocator);
* **uncertainty**: a figure rounded up to a page (512 MiB scratchpad pages on SDK 2.28) is off
  by [0, page); the slope ``sum w_i y_i`` with ``w_i = (N_i - mean) / Sxx`` is then off by at
  most ``page * sum(w_i > 0)`` (``page / k`` for two runs k layers apart); with three or more
  layer counts, twice the fit's standard error is added;
* **control**: the slope of what holds state between steps (Neuron's ``tensors``, XLA's entry
  parameters) must equal the weights (+ gradients + optimizer state) of one layer, or the runs
  differ in more than their layer count and the method is broken, not the model;
* **saving**: runs at the largest N with another recompute preset; the predicted difference is
  N x (kept bytes per layer) less what the preset rematerializes during one layer's backward.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from .analytic import layer_activation_bytes
from .readers import MemoryReading
from .shape import ModelShape, TrainingSetup

_FP32 = 4
RESOLVE = 0.10  # a slope resolves the model when its uncertainty is at most this share of the prediction


@dataclass(frozen=True)
class Coverage:
    """What one report's categories hold. measured: summed into the figure compared (those
    present; the first is required). with_state: the figure also holds the layers' weights,
    gradients and optimizer state. control: the category that holds state between steps, and
    which state ("state": weights + gradients + optimizer; "weights": weights only). peak: the
    figure is the step's peak (with what recompute brings back in backward), not only what is kept."""

    measured: tuple[str, ...]
    with_state: bool = False
    control: tuple[str, str] | None = None
    peak: bool = True


COVERAGE = {
    "neuron-monitor": Coverage(("model_shared_scratchpad",), control=("tensors", "state")),
    "prometheus": Coverage(("model_shared_scratchpad",), control=("tensors", "state")),
    "sysfs": Coverage(("model_shared_scratchpad", "nonshared_scratchpad"), control=("tensors", "state")),
    "neff": Coverage(("model_shared_scratchpad",)),
    "neuron-explorer": Coverage(("shared_scratchpad", "scratchpad"), control=("tensors", "state")),
    "neuron-oom-table": Coverage(("shared_scratchpad", "scratchpad"), control=("tensors", "state")),
    "neuron-load-log": Coverage(("neff_scratchpad",)),
    "xla-buffer-assignment": Coverage(("temp",), control=("parameters", "weights")),
    "cuda-memory-stats": Coverage(("allocated_bytes",), with_state=True),
    "cuda-snapshot": Coverage(("requested",), with_state=True),
    "recorder": Coverage(("saved",), peak=False),
}


def measured_bytes(reading: MemoryReading, core: int) -> int:
    cov = COVERAGE[reading.source]
    values = reading.core(core)
    if cov.measured[0] not in values:
        raise ValueError(f"{reading.path}: core {core} has no {cov.measured[0]!r}")
    return sum(values.get(c, 0) for c in cov.measured)


def layer_state_bytes(model: ModelShape, setup: TrainingSetup, which: str = "state") -> int:
    """One decoder layer's weights (``which="weights"``), or weights + gradients + fp32 master
    and AdamW moments (sharded over dp by ZeRO-1), on one rank."""
    one = replace(model, layers=1).local_parameters(setup.tp)
    two = replace(model, layers=2).local_parameters(setup.tp)
    n = two - one
    if which == "weights":
        return n * setup.width
    per_shard = n / setup.optimizer_shards
    master = per_shard * _FP32 if setup.keeps_master_weights else 0
    return round(n * (setup.width + setup.grad_width) + master + 2 * per_shard * _FP32)


def predicted_per_layer(model: ModelShape, setup: TrainingSetup, preset: str, source: str) -> int:
    per = layer_activation_bytes(model, setup, preset) * setup.microbatches_in_flight
    return per + (layer_state_bytes(model, setup) if COVERAGE[source].with_state else 0)


def predicted_saving(
    model: ModelShape, setup: TrainingSetup, base: str, preset: str, layers: int, peak: bool = True
) -> int:
    """Difference between ``base`` and ``preset`` on every one of ``layers`` layers: the kept
    bytes of every layer, less (for a ``peak``) what ``preset`` brings back during one layer's backward."""
    kept = {p: layer_activation_bytes(model, setup, p) for p in {"none", base, preset}}

    def again(p: str) -> int:
        return kept["none"] if p == "full" else kept["none"] - kept[p]

    return layers * (kept[base] - kept[preset]) - ((again(preset) - again(base)) if peak else 0)


@dataclass(frozen=True)
class Slope:
    bytes_per_layer: float
    uncertainty: float  # page rounding + 2 standard errors of the fit
    page_part: float


def fit_slope(points: list[tuple[int, int]], quantum: int | None) -> Slope:
    """Least-squares slope of ``(layers, bytes)`` and its uncertainty (module docstring)."""
    xs = [x for x, _ in points]
    if len(set(xs)) < 2:
        raise ValueError(f"--run: need two or more different layer counts, got {sorted(set(xs))}")
    mean_x, mean_y = sum(xs) / len(xs), sum(y for _, y in points) / len(points)
    sxx = sum((x - mean_x) ** 2 for x in xs)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / sxx
    page = (quantum or 0) * sum((x - mean_x) / sxx for x in xs if x > mean_x)
    stderr = 0.0
    if len(set(xs)) >= 3:
        residual = sum((y - mean_y - slope * (x - mean_x)) ** 2 for x, y in points)
        stderr = math.sqrt(residual / (len(points) - 2) / sxx)
    return Slope(slope, page + 2 * stderr, page)


@dataclass(frozen=True)
class Comparison:
    """One report format's comparison: the slope per core, and the verdict on the largest."""

    source: str
    predicted: int
    per_core: dict[int, Slope]
    quantum: int | None
    control: dict | None = None
    savings: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def measured(self) -> Slope:
        return max(self.per_core.values(), key=lambda s: s.bytes_per_layer)

    @property
    def agrees(self) -> bool:
        m = self.measured
        return abs(m.bytes_per_layer - self.predicted) <= m.uncertainty + 0.5

    @property
    def resolved(self) -> bool:
        return self.measured.uncertainty <= RESOLVE * self.predicted

    def verdict(self) -> str:
        m, p = self.measured, self.predicted
        words = []
        if self.control is not None and not self.control["ok"]:
            words.append(
                f"the control fails ({self.control['category']} per layer {self.control['measured']:,.0f} B "
                f"measured vs {self.control['predicted']:,} B predicted): the runs differ in more than their "
                f"layer count, so the per-layer figure says nothing about the model"
            )
        if self.agrees:
            words.append(
                f"agrees within the uncertainty: {m.bytes_per_layer:,.0f} B measured vs {p:,} B predicted "
                f"per layer (±{m.uncertainty:,.0f} B)"
            )
        else:
            off = (m.bytes_per_layer - p) / p if p else math.inf
            words.append(
                f"disagrees by {off:+.1%}: {m.bytes_per_layer:,.0f} B measured vs {p:,} B predicted per "
                f"layer (uncertainty ±{m.uncertainty:,.0f} B)"
            )
        if not self.resolved:
            words.append(f"unresolved: the uncertainty is more than {RESOLVE:.0%} of a layer's bytes; {self.needed()}")
        return "; ".join(words)

    def needed(self) -> str:
        """What would resolve an unresolved slope."""
        if not self.quantum or not self.measured.page_part or self.predicted <= 0:
            return "add layer counts (the fit's scatter dominates)"
        k = math.ceil(self.quantum / (RESOLVE * self.predicted))  # page / k <= share * predicted
        return (
            f"two runs {k} or more layers apart would resolve it (one {self.quantum / 2**20:,.0f} MiB page against "
            f"{self.predicted / 2**20:,.2f} MiB per layer), or more bytes per layer (a longer sequence, a larger "
            f"micro-batch), or the step NEFF's def.json (exact bytes, no page)"
        )


def _used_cores(cores: list[int], readings: list[MemoryReading], categories: tuple[str, ...]) -> list[int]:
    """The cores the job used: those holding bytes of the compared ``categories`` in some report.
    Neuron's tools list every core of the instance, zeros or only the runtime's baseline on the
    ones no process of the job used (a 32-core trn1.32xlarge running 8 ranks), and those have
    nothing to compare. A core used in some runs and idle in others means the runs ran on
    different cores, and a per-core slope across them would be wrong: refused."""

    def holds(reading: MemoryReading, core: int) -> bool:
        return any(reading.core(core).get(c, 0) for c in categories)

    used = [c for c in cores if any(holds(r, c) for r in readings if c in r.cores)]
    for core in used:
        idle = [r.path for r in readings if core in r.cores and not holds(r, core)]
        if idle:
            raise ValueError(
                f"{idle[0]}: NeuronCore {core} holds nothing there but does in other runs: the runs ran "
                f"on different cores (compare runs placed alike, e.g. the same NEURON_RT_VISIBLE_CORES)"
            )
    return used or cores


def compare(
    model: ModelShape,
    setup: TrainingSetup,
    preset: str,
    runs: list[tuple[int, MemoryReading]],
    recompute_runs: Sequence[tuple[str, MemoryReading]] = (),
) -> Comparison:
    """Compare ``runs`` (layer count, reading; all of one report format, ``preset`` on every
    layer) and ``recompute_runs`` (another preset at the largest layer count) with the model."""
    source = runs[0][1].source
    if source not in COVERAGE:
        raise ValueError(f"{runs[0][1].path}: no comparison is defined for {source!r} reports")
    for _, reading in [*runs, *recompute_runs]:
        if reading.source != source:
            raise ValueError(
                f"{reading.path}: a {reading.source} report among {source} ones: compare one format at a time"
            )
    cores = sorted(set.intersection(*(set(r.cores) for _, r in runs)))
    if not cores:
        raise ValueError(f"--run: the reports share no core ({[sorted(r.cores) for _, r in runs]})")
    coverage = COVERAGE[source]
    compared = coverage.measured + ((coverage.control[0],) if coverage.control else ())
    cores = _used_cores(cores, [r for _, r in [*runs, *recompute_runs]], compared)
    quantum = max((r.quantum or 0) for _, r in runs) or None
    per_core = {c: fit_slope([(n, measured_bytes(r, c)) for n, r in runs], quantum) for c in cores}
    result = Comparison(source, predicted_per_layer(model, setup, preset, source), per_core, quantum)
    notes = list(dict.fromkeys(n for _, r in runs for n in r.notes))  # one line per distinct note
    if any(r.kind == "current" for _, r in runs):
        notes.append("current values, not peaks: read while the step ran, they may miss its peak")
    if any(r.samples == 1 for _, r in runs) and source in ("neuron-monitor", "prometheus"):
        notes.append("a single sample per run: a lower bound on what the run held")
    control = COVERAGE[source].control
    if control is not None and all(control[0] in r.core(c) for _, r in runs for c in cores):
        category, which = control
        slopes = [fit_slope([(n, r.core(c)[category]) for n, r in runs], None) for c in cores]
        worst = max(slopes, key=lambda s: s.bytes_per_layer)
        predicted = layer_state_bytes(model, setup, which)
        tolerance = max(worst.uncertainty, 0.01 * predicted)  # allocation alignment: 1%
        result = replace(
            result,
            control={
                "category": category,
                "state": which,
                "measured": worst.bytes_per_layer,
                "predicted": predicted,
                "ok": abs(worst.bytes_per_layer - predicted) <= tolerance,
            },
        )
    largest = max(n for n, _ in runs)
    base = {c: measured_bytes(r, c) for n, r in runs if n == largest for c in cores}
    savings = []
    for name, reading in recompute_runs:
        measured = max(base[c] - measured_bytes(reading, c) for c in cores)
        predicted = predicted_saving(model, setup, preset, name, largest, COVERAGE[source].peak)
        savings.append(
            {
                "preset": name,
                "layers": largest,
                "measured": measured,
                "uncertainty": quantum or 0,
                "predicted": predicted,
                "agrees": abs(measured - predicted) <= (quantum or 0),
            }
        )
    return replace(result, savings=savings, notes=notes)


__all__ = [
    "COVERAGE",
    "Comparison",
    "Coverage",
    "Slope",
    "compare",
    "fit_slope",
    "layer_state_bytes",
    "measured_bytes",
    "predicted_per_layer",
    "predicted_saving",
]
