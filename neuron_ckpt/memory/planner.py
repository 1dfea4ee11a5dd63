"""The recompute planner: the cheapest per-layer recompute that fits a device's memory.

Every layer chooses among no recompute, selective (core attention; for Llama also with SwiGLU's
activation) and full recompute. The layers are identical, so a plan is a count of layers per
option; :func:`plan_recompute` tries every split of the ``L`` layers (``O(L^3)`` for four
options, a few thousand for Llama-2 7B), prices each with :func:`~.budget.memory_budget` in the
layer order that keeps the backward peak lowest (:func:`~.options.canonical_order`) and keeps the
one with the fewest recompute FLOPs that fits (ties: less memory): the forward FLOPs the backward
reruns, matmul plus elementwise, where the backend's rerun stops (:mod:`.rerun`). ``tests/test_planner.py``
checks it against a brute force over every per-layer assignment.

When nothing fits, :class:`NothingFits` says by how much and what would: the smallest
tensor-parallel degree that fits (same dp and micro-batch), the smallest context-parallel degree
that fits (same tp, dp and micro-batch: each rank then runs ``s/c`` of the sequence) and the
largest micro-batch that fits at this degree. :func:`longest_sequence` finds the longest sequence
a job fits at its degrees.

:func:`plan_activations` does the same search against a limit on the activations alone (what
``SavedTensorRecorder`` measures), to compare with another implementation at equal activation
memory (``scripts/bench_equal_memory.py``).

The plan becomes one :class:`~neuron_ckpt.recompute.RecomputeConfig` when it can (one option on
every layer; or full recompute of the first ``k`` layers and none on the rest, which is
``method="block"``) and otherwise a per-layer list; ``apply_recompute(model, plan.recompute)``
takes either.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from ..recompute import RecomputeConfig
from .budget import GIB, BudgetParts, MemoryBudget, memory_budget
from .offload_time import HostLink, offload_options
from .options import LayerOption, canonical_order, layer_options, per_layer_options, stack_options, step_flops
from .search import cheapest_per_layer
from .shape import ModelShape, TrainingSetup

if TYPE_CHECKING:
    from .moe.model import Model

# HBM per NeuronCore-v2: a Trainium1 chip has 32 GiB for its two cores (trn1.32xlarge: 16 chips,
# 32 cores, 512 GiB).
DEVICE_PRESETS: dict[str, int] = {"trn1": 16 * GIB}
DEFAULT_RESERVE_FRACTION = 0.1


def device_memory_bytes(spec: float | int | str | None) -> int:
    """Bytes of one device: a number of GiB, a preset name (``"trn1"``: 16 GiB per NeuronCore),
    or None for the detected accelerator (total memory from ``torch.accelerator.get_memory_info``
    where torch has it (2.13 does, 2.9 does not), else the device module's ``mem_get_info``)."""
    if spec is None:
        import torch

        if torch.accelerator.is_available():
            get_info = getattr(torch.accelerator, "get_memory_info", None)
            if get_info is None:
                acc = torch.accelerator.current_accelerator()
                assert acc is not None  # is_available() said there is one
                get_info = getattr(torch.get_device_module(acc.type), "mem_get_info", None)
            if get_info is not None:
                return int(get_info()[1])
        raise ValueError(
            "device memory: no accelerator with a memory counter is visible (CPU); pass it in GiB or "
            f"as a preset ({', '.join(DEVICE_PRESETS)})"
        )
    if isinstance(spec, str):
        if spec.lower() in DEVICE_PRESETS:
            return DEVICE_PRESETS[spec.lower()]
        try:
            spec = float(spec)
        except ValueError:
            raise ValueError(
                f"device memory must be GiB (a number) or a preset ({', '.join(DEVICE_PRESETS)}), got {spec!r}"
            ) from None
    if isinstance(spec, bool) or not spec > 0:
        raise ValueError(f"device memory must be > 0 GiB, got {spec!r}")
    return int(spec * GIB)


@dataclass(frozen=True)
class Plan:
    """A recompute choice for every layer, its memory and its cost.

    layers: the option of each layer in layer order. limit_bytes: what it was planned for: the
    device memory after ``reserve`` (``limit_on="total"``, :func:`plan_recompute`) or the
    activations alone (``limit_on="activations"``, :func:`plan_activations`). recompute_flops:
    the forward FLOPs backward reruns, matmul plus elementwise (what the planner minimises), of
    which recompute_matmul_flops in matmuls (:attr:`~.options.LayerOption.recompute_matmul_flops`);
    step_flops: the model FLOPs of forward + backward; all per micro-batch on one device.
    """

    budget: MemoryBudget
    options: dict[str, LayerOption]
    limit_bytes: int
    recompute_flops: float
    recompute_matmul_flops: float
    step_flops: float
    limit_on: str = "total"
    copy_flops: float = 0.0  # exposed offload copies as FLOPs (:mod:`.offload_time`); 0 without offload
    host_pinned_bytes: int = 0  # pinned host blocks the offload holds per rank (all micro-batches in flight)

    @property
    def layers(self) -> tuple[str, ...]:
        return self.budget.layers

    @property
    def counts(self) -> dict[str, int]:
        """Layers per option, in the options' order (presets first; zeros left out)."""
        return {name: self.layers.count(name) for name in self.options if name in self.layers}

    @property
    def used_bytes(self) -> int:
        """What the limit applies to: the budget's total, or its activations (``limit_on``)."""
        return _used(self.budget, self.limit_on)

    @property
    def fits(self) -> bool:
        return self.used_bytes <= self.limit_bytes

    @property
    def overhead(self) -> float:
        """Recompute FLOPs (matmul plus elementwise) as a fraction of the step's model FLOPs."""
        return self.recompute_flops / self.step_flops

    @property
    def copy_overhead(self) -> float:
        """Exposed offload copy time as a fraction of the step's model FLOPs' time."""
        return self.copy_flops / self.step_flops

    @property
    def matmul_overhead(self) -> float:
        """Recompute matmul FLOPs as a fraction of the step's model FLOPs."""
        return self.recompute_matmul_flops / self.step_flops

    @property
    def recompute(self) -> RecomputeConfig | list[RecomputeConfig]:
        """What ``apply_recompute(model, ...)`` takes for this plan."""
        counts = self.counts
        if len(counts) == 1:
            return self.options[self.layers[0]].recompute
        if set(counts) == {"none", "full"} and self.layers == canonical_order(counts, self.options):
            return RecomputeConfig(granularity="full", method="block", num_layers=counts["full"])
        return [self.options[name].recompute for name in self.layers]

    def describe(self) -> str:
        """One line: the counts, e.g. ``18 x none + 14 x selective``."""
        return " + ".join(f"{n} x {name}" for name, n in self.counts.items())

    def to_dict(self) -> dict[str, Any]:
        rc = self.recompute
        configs = rc if isinstance(rc, list) else [rc]
        return {
            "fits": self.fits,
            "limit_on": self.limit_on,
            "limit_bytes": self.limit_bytes,
            "limit_gib": round(self.limit_bytes / GIB, 4),
            "counts": self.counts,
            "layers": list(self.layers),
            "recompute": [_config_dict(c) for c in configs],
            "recompute_is_per_layer": isinstance(rc, list),
            "recompute_flops": self.recompute_flops,
            "recompute_matmul_flops": self.recompute_matmul_flops,
            "step_flops": self.step_flops,
            "overhead": self.overhead,
            "matmul_overhead": self.matmul_overhead,
            "copy_flops": self.copy_flops,
            "copy_overhead": self.copy_overhead,
            "offloaded_bytes_per_layer": [self.options[n].reload_bytes for n in self.layers],
            "host_pinned_bytes": self.host_pinned_bytes,
            "budget": self.budget.to_dict(),
        }


def _config_dict(config: RecomputeConfig) -> dict[str, Any]:
    return {
        "granularity": config.granularity,
        "method": config.method,
        "num_layers": config.num_layers,
        "modules": list(config.modules) if config.granularity == "selective" else None,
        "offload_modules": list(config.offload_modules),
    }


class NothingFits(ValueError):
    """No recompute choice fits; the message says by how much and what would.

    least: the plan with the least memory (full recompute everywhere). smallest_tp: the smallest
    tensor-parallel degree that fits (same dp, micro-batch), or None. largest_micro_batch: the
    largest micro-batch that fits at this degree, or None. smallest_cp: the smallest
    context-parallel degree above this one that fits (same tp, dp, micro-batch), or None.
    """

    def __init__(
        self,
        message: str,
        least: Plan,
        smallest_tp: int | None,
        largest_micro_batch: int | None,
        smallest_cp: int | None = None,
    ):
        super().__init__(message)
        self.least, self.smallest_tp, self.largest_micro_batch = least, smallest_tp, largest_micro_batch
        self.smallest_cp = smallest_cp


LIMITS_ON = ("total", "activations")


def _used(budget: MemoryBudget, limit_on: str) -> int:
    return budget.activation_bytes if limit_on == "activations" else budget.total_bytes


def evaluate(
    model: Model,
    setup: TrainingSetup,
    layers: str | tuple[str, ...] | RecomputeConfig,
    limit_bytes: int,
    options: dict[str, LayerOption] | None = None,
    limit_on: str = "total",
) -> Plan:
    """The :class:`Plan` of a given assignment (one option name, or one per layer; or a grouped
    full-recompute config for the whole stack), fitting or not."""
    if limit_on not in LIMITS_ON:
        raise ValueError(f"limit_on must be one of {LIMITS_ON}, got {limit_on!r}")
    options = dict(options if options is not None else layer_options(model, setup))
    if not isinstance(model, ModelShape):  # a transformers model: its options for these layers, by name
        named = model.per_layer_options(setup, layers, options)
        options |= {o.name: o for o in named}
        layers = tuple(o.name for o in named)
    elif isinstance(layers, RecomputeConfig):
        priced = stack_options(model, setup, layers)  # a group's first layer carries the group's FLOPs
        options = {priced[0].name: priced[0]}  # the plan's one option: its recompute is the config
    budget = memory_budget(model, setup, layers, options)
    if isinstance(model, ModelShape) and not isinstance(layers, RecomputeConfig):
        priced = per_layer_options(model, setup, layers, options)  # offload: the list exactly (rotary tables once)
        options |= {o.name: o for o in priced if o.name not in options}
    elif not isinstance(layers, RecomputeConfig):
        priced = [options[name] for name in budget.layers]
    matmul = sum(o.recompute_matmul_flops for o in priced)
    total = sum(o.recompute_flops for o in priced)
    copies = sum(o.copy_flops for o in priced)
    m = setup.microbatches_in_flight
    pinned = m * sum(o.host_pinned_bytes for o in priced)
    return Plan(budget, options, limit_bytes, total, matmul, step_flops(model, setup), limit_on, copies, pinned)


def _splits(total: int, parts: int) -> np.ndarray:
    """Every way to write ``total`` as an ordered sum of ``parts`` non-negative ints, one per
    row (``[C(total + parts - 1, parts - 1), parts]``, in ``itertools.combinations``' order)."""
    cuts = np.array(list(itertools.combinations(range(total + parts - 1), parts - 1)), dtype=np.int64)
    cuts = cuts.reshape(-1, parts - 1)
    ends = np.full((len(cuts), 1), -1, dtype=np.int64), np.full((len(cuts), 1), total + parts - 1, dtype=np.int64)
    return np.diff(np.concatenate([ends[0], cuts, ends[1]], axis=1), axis=1) - 1


def _best(
    model: Model,
    setup: TrainingSetup,
    limit_bytes: int,
    allowed: tuple[str, ...] | None,
    limit_on: str = "total",
    choices: Choices | None = None,
) -> tuple[Plan | None, Plan]:
    """(cheapest fitting plan or None, least-memory plan); memory is what ``limit_on`` names."""
    if not isinstance(model, ModelShape):
        if choices is not None:
            raise ValueError("choices: recompute_modules and offload are planned for this library's llama only")
        return _best_by_layer(model, setup, limit_bytes, allowed, limit_on)
    if choices is not None and choices.link is not None:
        return _best_offloading(model, setup, limit_bytes, allowed, limit_on, choices)
    options = layer_options(model, setup, choices.recompute_modules if choices else None)
    names = [n for n in options if allowed is None or n in allowed]
    if not names:
        raise ValueError(f"allowed: no known option among {allowed}; choose from {list(options)}")
    parts, m = BudgetParts.of(model, setup), setup.microbatches_in_flight
    names = list(dict.fromkeys(canonical_order(dict.fromkeys(names, 1), options)))  # the layer order's
    # Every split at once (numpy: 59k splits of Llama-2 7B's 32 layers over 5 options, 1.9M of
    # an 80-layer model's): bytes as BudgetParts.used prices them, FLOPs summed as Python would.
    order = [options[n] for n in names]
    splits = _splits(model.layers, len(names))
    totals = parts.used_by_counts(order, splits, m, limit_on)
    costs = np.zeros(len(splits))
    for j, option in enumerate(order):
        costs = costs + splits[:, j] * option.recompute_flops
    first = int(np.lexsort((costs, totals))[0])  # the least (total, cost); ties: the first split
    least: tuple[int, float, Any] = (int(totals[first]), float(costs[first]), tuple(splits[first].tolist()))
    best: tuple[float, int, Any] | None = None
    fitting = np.flatnonzero(totals <= limit_bytes)
    if len(fitting):
        i = int(fitting[np.lexsort((totals[fitting], costs[fitting]))[0]])
        best = (float(costs[i]), int(totals[i]), tuple(splits[i].tolist()))
    # Grouped full recompute: every layer rerun, the inner ones of each group to their end (more
    # FLOPs than full on every layer), fewer inputs kept, k layers alive again at once. It wins
    # only where full on every layer does not fit, or fits with more memory (layer inputs that
    # outweigh k - 1 layers' activations). Against a limit on the kept activations alone its
    # buffer would not count: total limits only.
    if limit_on == "total" and (allowed is None or "full" in allowed):
        for k in range(2, model.layers + 1):
            config = RecomputeConfig(granularity="full", method="uniform", num_layers=k)
            group = stack_options(model, setup, config)
            flops = sum(o.recompute_flops for o in group)
            total = parts.used([(o, 1) for o in group], m, limit_on)
            if (total, flops) < least[:2]:
                least = (total, flops, config)
            if total <= limit_bytes and (best is None or (flops, total) < best[:2]):
                best = (flops, total, config)

    def layers(choice: Any) -> Any:  # a split in the layer order, or a grouped config
        return (
            choice if isinstance(choice, RecomputeConfig) else tuple(n for n, k in zip(names, choice) for _ in range(k))
        )

    plan = evaluate(model, setup, layers(best[2]), limit_bytes, options, limit_on) if best else None
    return plan, evaluate(model, setup, layers(least[2]), limit_bytes, options, limit_on)


@dataclass(frozen=True)
class Choices:
    """What the planner may choose for a layer beyond its defaults (:func:`~.options.layer_options`).

    recompute_modules: the selective recompute it offers instead of the presets' (any set
        ``RecomputeConfig(granularity="selective", modules=...)`` takes), beside none and full.
    link: offload offered too, its copies priced by this host link and device rate
        (:mod:`.offload_time`); offload_modules: the names it may offload (None: each of
        :data:`~.offload_time.OFFERED`); host_bytes: the most pinned host bytes per rank the
        offload may take (:func:`~.host.offload_room`; None: no limit).
    """

    recompute_modules: tuple[str, ...] | None = None
    link: HostLink | None = None
    offload_modules: tuple[str, ...] | None = None
    host_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.offload_modules is not None and self.link is None:
            raise ValueError("offload_modules: offload is priced by a host link; give link=HostLink(...) too")


def _best_offloading(
    model: ModelShape, setup: TrainingSetup, limit: int, allowed: tuple[str, ...] | None, limit_on: str,
    choices: Choices,
) -> tuple[Plan | None, Plan]:  # fmt: skip
    """:func:`_best` weighing keep, recompute and offload per layer (every layer but the last may
    offload): the cost being recompute FLOPs plus exposed copies (:attr:`~.options.LayerOption.cost`),
    the pinned blocks within ``choices.host_bytes``."""
    if setup.cp > 1:
        raise ValueError("offload: planned without context parallelism only (cp=1)")
    every = layer_options(model, setup, choices.recompute_modules)
    base = {n: o for n, o in every.items() if allowed is None or n in allowed}
    if not base:
        raise ValueError(f"allowed: no known option among {allowed}; choose from {list(every)}")
    assert choices.link is not None
    more = offload_options(model, setup, choices.link, base, choices.offload_modules)
    more = {n: o for n, o in more.items() if allowed is None or n.partition("+")[0] in allowed}
    per_layer = [{**base, **more}] * (model.layers - 1) + [base]
    m = setup.microbatches_in_flight
    host = None if choices.host_bytes is None else choices.host_bytes // m  # pinned blocks per micro-batch
    return _search(model, setup, per_layer, {**base, **more}, limit, limit_on, host)


def _best_by_layer(
    model: Model, setup: TrainingSetup, limit: int, allowed: tuple[str, ...] | None, limit_on: str
) -> tuple[Plan | None, Plan]:
    """:func:`_best` for layers of several kinds (a transformers model)."""
    assert not isinstance(model, ModelShape)
    options = layer_options(model, setup)
    return _search(model, setup, model.options_by_layer(options, allowed), options, limit, limit_on)


def _search(
    model: Model, setup: TrainingSetup, per_layer: list[dict[str, LayerOption]], options: dict[str, LayerOption],
    limit: int, limit_on: str, host_limit: int | None = None,
) -> tuple[Plan | None, Plan]:  # fmt: skip
    """(cheapest fitting plan or None, least-memory plan) over per-layer choices (``per_layer``:
    each layer's options; :func:`~.search.cheapest_per_layer`, exact), each run of layers offered
    the same options then put in the order that keeps the backward peak lowest
    (:func:`~.options.canonical_order`: the same cost, easier to read). With offload a layer's
    backward also holds the reload below it, so the search's own order is kept where that order
    holds less."""
    parts, m = BudgetParts.of(model, setup), setup.microbatches_in_flight

    def used(kept: int, held: int) -> int:  # one stand-in layer keeping P and holding Q: the budget's sums
        return parts.used([(LayerOption("", RecomputeConfig(), kept, held, 0.0, 0.0), 1)], m, limit_on)

    def plan(names: tuple[str, ...]) -> Plan:
        ordered: list[str] = []
        start = 0
        for i in range(1, len(names) + 1):
            if i == len(names) or per_layer[i] is not per_layer[start]:
                run = names[start:i]
                ordered += canonical_order({n: run.count(n) for n in dict.fromkeys(run)}, options)
                start = i
        tidy = evaluate(model, setup, tuple(ordered), limit, options, limit_on)
        if not any(options[n].reload_bytes for n in names):
            return tidy
        exact = evaluate(model, setup, names, limit, options, limit_on)
        return tidy if tidy.used_bytes <= exact.used_bytes else exact

    best, least = cheapest_per_layer(per_layer, used, limit, separable=m == 1, host_limit=host_limit)
    return (plan(best) if best is not None else None), plan(least)


def valid_tp_degrees(model: Model, setup: TrainingSetup) -> list[int]:
    """Tensor-parallel degrees that can shard ``model`` at ``setup``'s sequence length (under
    context parallelism sequence parallel splits each of the ``2c`` chunks over TP)."""
    if not isinstance(model, ModelShape):
        return model.valid_tp_degrees(setup)
    chunk = setup.seq_len // (2 * setup.cp) if setup.cp > 1 else setup.seq_len
    seq = chunk if setup.sequence_parallel else None
    return [t for t in range(1, model.heads + 1) if model.valid_tp(t, seq) is None]


def limit_bytes(device_memory: float | int | str | None, reserve_gib: float | None = None) -> int:
    """What a plan may use of ``device_memory`` (:func:`device_memory_bytes`): all of it less
    ``reserve_gib``, by default :data:`DEFAULT_RESERVE_FRACTION` of it (:func:`plan_recompute`)."""
    total = device_memory_bytes(device_memory)
    if reserve_gib is None:
        reserve_gib = DEFAULT_RESERVE_FRACTION * total / GIB
    if not reserve_gib >= 0:
        raise ValueError(f"reserve_gib must be >= 0, got {reserve_gib!r}")
    return total - int(reserve_gib * GIB)


def plan_recompute(
    model: Model,
    setup: TrainingSetup,
    device_memory: float | int | str | None,
    reserve_gib: float | None = None,
    allowed: tuple[str, ...] | None = None,
    choices: Choices | None = None,
) -> Plan:
    """The per-layer recompute with the fewest recompute FLOPs whose peak fits ``device_memory``
    (GiB, a preset such as ``"trn1"``, or None to detect) less ``reserve_gib``.

    ``reserve_gib`` defaults to :data:`DEFAULT_RESERVE_FRACTION` of the device: the budget counts
    what the model, optimizer and autograd hold, not the runtime's own reservation, collective
    buffers, compiler scratch or fragmentation, so a plan that fills the device to the byte
    would not run. Pass 0 to plan to the byte.

    ``allowed``: restrict the options (names from :data:`~neuron_ckpt.recompute.PRESETS`).
    ``choices``: what else it may choose (:class:`Choices`: the selective recompute to offer, and
    offload, keep, recompute or offload per layer at the least recompute FLOPs plus exposed copy
    time, :mod:`.offload_time`).
    Raises :class:`NothingFits` (a ValueError) naming what would fit.
    """
    limit = limit_bytes(device_memory, reserve_gib)
    plan, least = _best(model, setup, limit, allowed, choices=choices)
    if plan is not None:
        return plan
    raise _nothing_fits(model, setup, limit, least, allowed, choices)


def plan_activations(
    model: Model,
    setup: TrainingSetup,
    activation_bytes: int,
    allowed: tuple[str, ...] | None = None,
) -> Plan:
    """The per-layer recompute with the fewest recompute FLOPs whose activations kept for
    backward are at most ``activation_bytes``: ``budget.activation_bytes``, the layers plus the
    embedding, rotary tables, final norm, LM head input and loss, which is what
    ``SavedTensorRecorder`` measures over a forward with labels (parameters and the shared
    causal mask left out).

    For comparing with another implementation at equal activation memory
    (``scripts/bench_equal_memory.py``). Parameters, gradients, optimizer state and workspace
    are not limited, so the plan does not say the job fits a device: :func:`plan_recompute`
    does. The plan's ``limit_on`` is ``"activations"``. Raises :class:`NothingFits` when even
    the least (full recompute of every layer) keeps more.
    """
    if isinstance(activation_bytes, bool) or not isinstance(activation_bytes, int) or activation_bytes < 0:
        raise ValueError(f"activation_bytes must be an int >= 0, got {activation_bytes!r}")
    plan, least = _best(model, setup, activation_bytes, allowed, "activations")
    if plan is not None:
        return plan
    raise NothingFits(
        f"no recompute choice keeps at most {activation_bytes / 2**20:,.1f} MiB of activations: the least "
        f"({least.describe()}) keeps {least.used_bytes / 2**20:,.1f} MiB",
        least,
        None,
        None,
    )


def fits(
    model: Model,
    setup: TrainingSetup,
    limit: int,
    allowed: tuple[str, ...] | None = None,
    choices: Choices | None = None,
) -> bool:
    """Whether some recompute choice (of ``choices``, offload included) keeps ``model`` run as
    ``setup`` within ``limit`` bytes."""
    return _best(model, setup, limit, allowed, choices=choices)[1].fits


MAX_CONTEXT_PARALLEL = 64
"""The largest context-parallel degree :class:`NothingFits` tries."""


def valid_cp_degrees(model: Model, setup: TrainingSetup, largest: int = MAX_CONTEXT_PARALLEL) -> list[int]:
    """Context-parallel degrees up to ``largest`` that split ``setup``'s sequence (``s % 2c == 0``,
    ``s % 2ct == 0`` with sequence parallel); 1 always. The Llama layer only (GPT takes no CP)."""
    if model.kind != "llama":
        return [1]
    step = 2 * setup.tp if setup.sequence_parallel else 2
    return [1] + [c for c in range(2, largest + 1) if setup.seq_len % (step * c) == 0]


def _nothing_fits(
    model: Model, setup: TrainingSetup, limit: int, least: Plan, allowed, choices: Choices | None = None
) -> NothingFits:
    bigger = [t for t in valid_tp_degrees(model, setup) if t > setup.tp]
    smallest_tp = next((t for t in bigger if fits(model, replace(setup, tp=t), limit, allowed, choices)), None)
    more_cp = [c for c in valid_cp_degrees(model, setup) if c > setup.cp]
    smallest_cp = next((c for c in more_cp if fits(model, setup.at_context_parallel(c), limit, allowed)), None)
    largest_b = None
    if setup.micro_batch > 1:
        lo, hi = 0, setup.micro_batch - 1  # memory grows with b: bisect the largest that fits
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if fits(model, replace(setup, micro_batch=mid), limit, allowed, choices):
                lo = mid
            else:
                hi = mid - 1
        largest_b = lo or None
    static = least.budget.bytes_of("static")
    what = least.describe()
    parts = [
        (
            f"nothing fits in {limit / GIB:.2f} GiB per device: the least memory ({what}) needs "
            f"{least.budget.total_gib:.2f} GiB, of which {static / GIB:.2f} GiB is parameters, gradients, "
            f"optimizer state and mask cache"
        )
    ]
    if smallest_tp is not None:
        parts.append(
            f"would fit: tp={smallest_tp} (the smallest tensor-parallel degree that fits, dp={setup.dp}, "
            f"micro-batch {setup.micro_batch})"
        )
    else:
        parts.append(f"no tensor-parallel degree above {setup.tp} fits at this micro-batch")
    if smallest_cp is not None:
        ranks = setup.tp * smallest_cp
        parts.append(
            f"fits with --cp {smallest_cp} (the smallest context-parallel degree that fits at tp={setup.tp}, "
            f"dp={setup.dp}, micro-batch {setup.micro_batch}: {ranks} ranks per replica, s/{smallest_cp} = "
            f"{setup.seq_len // smallest_cp} tokens each)"
        )
    elif model.kind == "llama":
        parts.append(f"no context-parallel degree above {setup.cp} fits (tried {more_cp or 'none: s does not split'})")
    if largest_b is not None:
        parts.append(f"would fit: micro-batch {largest_b} at tp={setup.tp} (the largest that fits)")
    elif setup.micro_batch > 1:
        parts.append(f"no smaller micro-batch fits at tp={setup.tp}")
    if not isinstance(model, ModelShape):  # a transformers model's own: the smallest EP that fits
        parts += model.nothing_fits_hints(setup, lambda other, s: fits(other, s, limit, allowed))
    if not setup.zero1 and setup.dp > 1:
        parts.append("ZeRO-1 (--zero1) would shard the optimizer state over dp")
    return NothingFits("; ".join(parts), least, smallest_tp, largest_b, smallest_cp)


def longest_sequence(
    model: Model,
    setup: TrainingSetup,
    device_memory: float | int | str | None,
    reserve_gib: float | None = None,
    allowed: tuple[str, ...] | None = None,
    longest: int = 1 << 22,
    choices: Choices | None = None,
) -> int | None:
    """The longest sequence (up to ``longest``) at which ``setup``'s job fits, with the recompute
    :func:`plan_recompute` would choose there; a multiple of what the sequence must split into
    (``2c``, ``2ct`` with sequence parallel, ``t`` with it at CP 1). None if not even the shortest
    fits. Memory grows with the sequence, so a bisection."""
    limit = limit_bytes(device_memory, reserve_gib)
    c, t = setup.cp, setup.tp
    step = (2 * c if c > 1 else 1) * (t if setup.sequence_parallel else 1)

    def fits_at(n: int) -> bool:
        return fits(model, replace(setup, seq_len=n * step), limit, allowed, choices)

    lo, hi = 0, longest // step
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits_at(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo * step or None


__all__ = [
    "Choices",
    "DEVICE_PRESETS",
    "LIMITS_ON",
    "NothingFits",
    "Plan",
    "device_memory_bytes",
    "evaluate",
    "fits",
    "limit_bytes",
    "longest_sequence",
    "plan_activations",
    "plan_recompute",
    "valid_cp_degrees",
    "valid_tp_degrees",
]
