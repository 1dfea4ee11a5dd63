"""Will it fit? The per-device memory of a whole training job, line by line.

One device (a NeuronCore, a GPU) holds one tensor-parallel rank of one data-parallel replica:

* **parameters** and **gradients**: its 1/t shard of every split weight plus the replicated
  norm weights, in the model dtype (gradients as wide as the parameters);
* **optimizer state**: fp32 master weights and AdamW's two fp32 moments, divided by dp under
  ZeRO-1 (:class:`~neuron_ckpt.optim.Zero1Optimizer`, which always keeps an fp32 master slice);
* **the attention mask**: explicit ``CoreAttention`` keeps one ``[s, s]`` bool mask per process,
  shared by every layer (it lives as long as the process); flash attention has none;
* **activations kept for backward**: per layer from the analytic model
  (:mod:`.analytic`) under the layer's recompute option (:mod:`.options`), plus what sits outside the layers:
  rotary tables, embedding indices, the final norm, the LM head input and what the
  vocab-parallel cross entropy saves (its softmax ``[s, b, v/t]``, bf16 with bf16 logits and fp32
  otherwise, and the targets), times
  the micro-batches in flight (1 without pipeline parallelism: a micro-batch's backward ends
  before the next forward starts);
* **peak workspace**: the largest transient on top, whichever is worst of (a) the loss: the
  ``[s, b, v/t]`` logits plus the cross entropy's fp32 working copy (and its bf16 softmax), (b) the
  explicit attention's forward in the last layer: its ``[b, a/t, s, s]`` 16-bit scores plus, at
  worst (XLA widens them), an fp32 copy and the fp32 softmax (flash attention works in blocks:
  nothing of that size), (c) recompute in backward: the peak of live activations
  (:attr:`MemoryBudget.activation_peak_bytes`) above what the forward keeps, when a recomputed
  layer's (or a group of k layers') activations are alive again on top of what the layers
  before it hold, (d) the optimizer step (after the activations are freed): the flattened
  gradients and fp32 slices.

Not modelled: gradient temporaries inside one op's backward, collective buffers, the device
runtime's own reservation and allocator fragmentation; keep some headroom (``reserve`` in the
planner). The Llama activation terms are the ones ``tests/test_memory_llama.py`` measures to
the byte, and ``tests/test_planner.py`` checks the whole-model activations against a
measured ``LlamaForCausalLM``. The GPT terms outside the layers are analytic only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import TYPE_CHECKING, Any

import numpy as np

from ..recompute import PRESETS
from .analytic import rotary_terms, stack_peak
from .options import LayerOption, Layers, layer_options, per_layer_options
from .shape import ModelShape, TrainingSetup

if TYPE_CHECKING:
    from .moe.model import Model

GIB = 1 << 30
_FP32, _INT64, _BOOL = 4, 8, 1


@dataclass(frozen=True)
class LineItem:
    """One line of the budget: ``category`` is "static", "activations" or "workspace"."""

    name: str
    nbytes: int
    category: str
    note: str = ""

    @property
    def gib(self) -> float:
        return self.nbytes / GIB


@dataclass(frozen=True)
class MemoryBudget:
    """Per-device memory of one training job, by line item; ``total_bytes`` is the peak estimate.

    layers: the recompute of each layer, in layer order, by name (a preset, or a
    :class:`~.options.LayerOption` label). activation_peak_bytes: the most activation bytes alive
    at once over a micro-batch's forward and backward, recompute buffers included (the other
    micro-batches in flight keep theirs meanwhile); at least :attr:`activation_bytes` / m of it.
    """

    model: Model
    setup: TrainingSetup
    layers: tuple[str, ...]
    items: tuple[LineItem, ...]
    notes: tuple[str, ...] = field(default=())
    activation_peak_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        return sum(item.nbytes for item in self.items)

    @property
    def total_gib(self) -> float:
        return self.total_bytes / GIB

    def bytes_of(self, category: str) -> int:
        return sum(item.nbytes for item in self.items if item.category == category)

    @property
    def activation_bytes(self) -> int:
        """Activations kept for backward (what ``SavedTensorRecorder`` measures), all micro-batches."""
        return self.bytes_of("activations")

    def table(self) -> str:
        """The line items in GiB, one per line, then the total."""
        width = max(len(item.name) for item in self.items) + 2
        lines = [f"{'item':<{width}}{'GiB':>9}  note"]
        for item in self.items:
            lines.append(f"{item.name:<{width}}{item.gib:>9.3f}  {item.note}".rstrip())
        lines.append(f"{'total':<{width}}{self.total_gib:>9.3f}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "layers": list(self.layers),
            "items": [
                {"name": i.name, "bytes": i.nbytes, "gib": round(i.gib, 4), "category": i.category, "note": i.note}
                for i in self.items
            ],
            "total_bytes": self.total_bytes,
            "total_gib": round(self.total_gib, 4),
            "activation_peak_bytes": self.activation_peak_bytes,
            "notes": list(self.notes),
        }


def largest_collective_bytes(model: ModelShape, setup: TrainingSetup, parameters: int | None = None) -> int:
    """The optimizer step's largest collective operand on one rank: ZeRO-1 reduce-scatters the
    gradients (in ``grad_width``) and all-gathers the parameters bucket by bucket, so at most the
    bucket cap; without a cap (or without ZeRO-1: a DP all-reduce of every gradient) all of them.
    ``parameters``: the rank's local parameters when it holds part of the model (a pipeline stage);
    None: ``model.local_parameters(tp)``."""
    n = model.local_parameters(setup.tp) if parameters is None else parameters
    whole = n * setup.grad_width
    if not setup.zero1 or setup.bucket_cap_mb is None:
        return whole
    return min(whole, int(setup.bucket_cap_mb * 2**20))


def optimizer_step_bytes(model: ModelShape, setup: TrainingSetup, parameters: int | None = None) -> int:
    """Device bytes the optimizer step allocates on top of the static ones (activations freed).

    ZeRO-1 keeps every bucket's reduce-scattered fp32 slice (``n/dp`` values) until the update,
    plus one bucket-sized collective buffer at a time (the flattened gradients going out, or the
    all-gathered parameters coming back; with fp32 accumulation the reduce-scatter reads the
    gradient buffer itself). Eager backends keep up to 4 buckets in flight: add 3 caps when
    planning for those. Unbucketed: the whole flattened gradient and its slice in the gradient
    dtype. Plain AdamW: about one fp32 temporary per parameter (foreach kernels).
    ``parameters``: as for :func:`largest_collective_bytes`.
    """
    n = model.local_parameters(setup.tp) if parameters is None else parameters
    if not setup.zero1:
        return n * _FP32
    per_shard = -(-n // setup.optimizer_shards)
    if setup.bucket_cap_mb is None:
        return n * setup.grad_width + per_shard * (setup.grad_width + _FP32)
    return per_shard * _FP32 + largest_collective_bytes(model, setup, n)


def _static_items(model: ModelShape, setup: TrainingSetup, parameters: int | None = None) -> tuple[list[LineItem], int]:
    """The parameters, gradients, optimizer state and mask of a rank holding ``parameters`` local
    parameters (None: the whole model's), and the optimizer step's bytes."""
    n = model.local_parameters(setup.tp) if parameters is None else parameters
    shards = setup.optimizer_shards
    per_shard = -(-n // shards)  # ZeRO-1 pads the flat buffer to a multiple of dp
    where = f"/dp={shards} (ZeRO-1)" if setup.zero1 else "(not sharded)"
    fp32_grads = setup.grad_width != setup.width
    items = [
        LineItem("parameters", n * setup.width, "static", f"{n / 1e6:,.1f} M local parameters, {setup.dtype}"),
        LineItem(
            "gradients",
            n * setup.grad_width,
            "static",
            "fp32 accumulation buffers, full local size (ZeRO-1)"
            if fp32_grads
            else f"{setup.dtype}, full local size (ZeRO-1 keeps them whole)",
        ),
    ]
    if setup.keeps_master_weights:
        items.append(LineItem("master weights", per_shard * _FP32, "static", f"fp32 {where}"))
    items.append(
        LineItem("optimizer moments", 2 * per_shard * _FP32, "static", f"AdamW exp_avg + exp_avg_sq, fp32 {where}")
    )
    s, c = setup.seq_len, setup.cp
    if c > 1:  # the query chunks' lower-right masks: views of one [s/(2c), s] tensor (parallel.context_parallel)
        explicit = setup.attention == "explicit"
        what = "bool" if explicit else f"additive {setup.dtype}"
        items.append(
            LineItem(
                "attention mask",
                s // (2 * c) * s * (_BOOL if explicit else setup.width),
                "static",
                f"context parallel: one [s/(2c), s] {what} mask shared by every chunk and layer",
            )
        )
    elif setup.attention == "explicit":
        items.append(
            LineItem(
                "attention mask",
                s * s * _BOOL,
                "static",
                "explicit CoreAttention: one [s, s] bool mask shared by every layer",
            )
        )
    return items, optimizer_step_bytes(model, setup, n)


def attention_transient_bytes(model: ModelShape, setup: TrainingSetup) -> int:
    """The most one layer's attention holds for a moment beyond what it keeps, on one rank.

    Explicit, CP 1: the ``[b, a/t, s, s]`` 16-bit scores and, at worst (XLA widens them), an fp32
    copy and the fp32 softmax; flash: nothing of that size. Under context parallelism ``c > 1``
    (``G = c x`` this rank's K and V, the gathered copy): the forward holds the gathered K and V
    twice while it puts them in sequence order (rank order, then sequence order), then the
    sequence-ordered copy while the chunks attend (explicit: with the largest chunk's scores,
    ``[b, a/t, s/(2c), s]`` widened as above); the backward the regathered copy, its gradient and
    the reduce-scatter's input (``3 G``)."""
    t, b, w, c = setup.tp, setup.micro_batch, setup.width, setup.cp
    explicit = setup.attention == "explicit"
    if c == 1:
        return model.local_heads(t) * setup.seq_len**2 * b * (w + 8) if explicit else 0
    gathered = c * 2 * w * setup.local_seq_len * b * model.local_kv_heads(t) * model.head_dim
    scores = model.local_heads(t) * setup.seq_len // (2 * c) * setup.seq_len * b * (w + 8) if explicit else 0
    return max(2 * gathered, gathered + scores, 3 * gathered)


def embedding_bytes(model: ModelShape, setup: TrainingSetup) -> int:
    """What the embedding keeps for backward, per micro-batch: Llama's ``F.embedding`` keeps the
    (local) int64 ids, and at t > 1 the out-of-shard bool mask; GPT's embedding dropout its mask."""
    s, b, t = setup.local_seq_len, setup.micro_batch, setup.tp
    if model.kind == "gpt":
        return (s * b // t if setup.sequence_parallel else s * b) * model.hidden
    return s * b * _INT64 + (s * b * _BOOL if t > 1 else 0)


def _outside_items(model: ModelShape, setup: TrainingSetup) -> tuple[list[LineItem], list[LineItem], int]:
    """Activations outside the layers (per micro-batch): those kept before them and those kept
    after them (freed before the layers' backward), and the loss's transient bytes."""
    s, b, t, h, v, w = setup.local_seq_len, setup.micro_batch, setup.tp, model.hidden, model.vocab, setup.width
    sb = s * b
    sb_local = sb // t if setup.sequence_parallel else sb
    logits = sb * v // t  # elements of [s, b, v/t]
    if model.kind == "llama":
        rope = sum(term.nbytes for term in rotary_terms(model, setup))
        embed = embedding_bytes(model, setup)
        # Final RMSNorm (its input and the fp32 1/rms) and the LM head's input.
        final = sb_local * h * w + sb_local * _FP32 + sb_local * h * w
        before = [LineItem("act: embedding + rotary", embed + rope, "activations", "ids, shard mask, cos/sin tables")]
    else:
        # Paper section 4.3: embedding dropout mask; final LayerNorm input and stats; head input.
        before = [LineItem("act: embedding", embedding_bytes(model, setup), "activations", "dropout mask")]
        final = sb_local * h * w + 2 * sb_local * w + sb_local * h * w
    after = [LineItem("act: final norm + LM head", final, "activations", "norm input/stats, LM head input")]
    # Vocab-parallel cross entropy: the softmax [s, b, v/t] (bf16 with bf16 logits, plus each
    # target's fp32 probability; fp32 otherwise), target index, two bool masks; the mean's
    # division keeps its int64 token count.
    lean = setup.dtype == "bf16"
    softmax = logits * w + sb * _FP32 if lean else logits * _FP32
    # Under context parallelism the loss is the summed cross entropy times c / (the count over
    # CP): that multiplication keeps the fp32 scalar instead of the mean's int64 count.
    loss = softmax + sb * (_INT64 + 2 * _BOOL) + (_FP32 if setup.cp > 1 else _INT64)
    what = "bf16 softmax [s, b, v/t] + fp32 target p" if lean else "fp32 softmax [s, b, v/t]"
    after.append(LineItem("act: loss", loss, "activations", f"{what} + targets"))
    # While it runs: the logits (w), one fp32 [s, b, v/t] buffer (the cast, shifted and
    # exponentiated in place; for fp32 logits the shifted copy) and the bf16 softmax it keeps.
    transient = logits * (w + _FP32 + (w if lean else 0))
    return before, after, transient


def _layer_items(order: Sequence[LayerOption], m: int | Sequence[int]) -> list[LineItem]:
    """One line per option name: the presets in their order, then the others as they come.
    ``m``: micro-batches in flight, for every layer or one count per layer (a pipeline rank's
    virtual stages hold different numbers)."""
    counts = [m] * len(order) if isinstance(m, int) else list(m)
    names = [n for n in PRESETS if any(o.name == n for o in order)]
    names += list(dict.fromkeys(o.name for o in order if o.name not in names))
    items = []
    for name in names:
        same = [(o, c) for o, c in zip(order, counts) if o.name == name]
        total = sum(o.saved_bytes for o, _ in same)
        per = {o.saved_bytes for o, _ in same}
        note = (
            f"{per.pop() / 2**20:,.1f} MiB per layer"
            if len(per) == 1
            else f"{total / 2**20:,.1f} MiB in all (the group inputs)"
        )
        kept = sum(o.saved_bytes * c for o, c in same)
        items.append(LineItem(f"act: {len(same)} layers x {name}", kept, "activations", note))
    return items


def _with_reloads(runs: Sequence[tuple[LayerOption, int]]) -> list[tuple[int, int, int]]:
    """``(kept, backward peak, n)`` rows for :func:`~.analytic.stack_peak`, each layer's backward
    holding also the reload of the nearest earlier layer that offloads (the engine prefetches it
    there: :mod:`.offload`)."""
    rows, carry = [], 0
    for o, n in runs:
        if n:
            rows.append((o.saved_bytes, o.backward_peak_bytes + carry, 1))
            carry = o.reload_bytes or carry
            if n > 1:
                rows.append((o.saved_bytes, o.backward_peak_bytes + carry, n - 1))
    return rows


@dataclass(frozen=True)
class BudgetParts:
    """What a budget holds whatever its layers run: the static items, the optimizer step's bytes,
    what is kept before and after the layers, and the transients that do not depend on them.
    :func:`memory_budget` lays them out as line items; the planner prices thousands of layer
    assignments against one set of them (:meth:`used`)."""

    static: tuple[LineItem, ...]
    step: int
    before: tuple[LineItem, ...]
    after: tuple[LineItem, ...]
    loss_transient: int
    scores: int  # the attention's transient (:func:`attention_transient_bytes`)

    @staticmethod
    def of(model: Model, setup: TrainingSetup) -> BudgetParts:
        if not isinstance(model, ModelShape):  # a transformers model: its own parts
            return model.parts(setup)
        static, step = _static_items(model, setup)
        before, after, loss_transient = _outside_items(model, setup)
        scores = attention_transient_bytes(model, setup)
        parts = BudgetParts(tuple(static), step, tuple(before), tuple(after), loss_transient, scores)
        if setup.cp > 1:
            note = (
                "context parallel: the gathered K and V (forward: twice while reordered; backward: regathered, "
                "its gradient, the reduce-scatter's input)"
            )
            if setup.attention == "explicit":
                note += " or one copy + the largest chunk's scores"
            parts = replace(parts, attention_note=note)
        return parts

    @cached_property
    def sums(self) -> tuple[int, int, int]:
        """Bytes of (the static items, what is kept before the layers, after them): summed once,
        the planner prices thousands of layer assignments against them."""
        static, before, after = (sum(i.nbytes for i in items) for items in (self.static, self.before, self.after))
        return static, before, after

    def activations(self, runs: Sequence[tuple[LayerOption, int]], m: int) -> tuple[int, int]:
        """(activations kept after the forward, their peak over forward and backward) of the
        layers, given in layer order as runs of ``(option, number of layers)``, with ``m``
        micro-batches in flight (the others' activations stay alive meanwhile)."""
        _, before, after = self.sums
        one = sum(o.saved_bytes * n for o, n in runs) + before + after
        peak_one = stack_peak(_with_reloads(runs), before, after)
        return one * m, one * (m - 1) + peak_one

    attention_note: str = "attention: scores + fp32 copy + fp32 softmax, [b, a/t, s, s]"

    def workspace(self, saved: int, peak: int) -> tuple[int, str]:
        """The largest transient on top of what is kept, and what it is."""
        candidates = [
            (self.loss_transient, "loss: logits + the cross entropy's fp32 working copy"),
            (peak - saved, "recompute in backward: activations alive again on top of the layers before"),
            (self.step - saved, "optimizer step: fp32 gradient slices + one bucket buffer (activations freed)"),
        ]
        if self.scores:
            candidates.append((self.scores, self.attention_note))
        extra, why = max(candidates, key=lambda c: c[0])
        return (extra, why) if extra > 0 else (0, "none: nothing transient outweighs what is kept")

    def used(self, runs: Sequence[tuple[LayerOption, int]], m: int, limit_on: str) -> int:
        """``memory_budget(...).total_bytes`` (or ``.activation_bytes`` for ``limit_on="activations"``)
        of these layers (runs, as :meth:`activations` takes them), without laying out the items."""
        if any(o.reload_bytes for o, _ in runs):
            saved, peak = self.activations(runs, m)
            return saved if limit_on == "activations" else self.sums[0] + saved + self.workspace(saved, peak)[0]
        counts = np.array([[n for _, n in runs]], dtype=np.int64)
        return int(self.used_by_counts([o for o, _ in runs], counts, m, limit_on)[0])

    def used_by_counts(self, order: Sequence[LayerOption], counts: np.ndarray, m: int, limit_on: str) -> np.ndarray:
        """:meth:`used` of many assignments at once: ``counts[i, j]`` layers run ``order[j]``, in
        that order (the planner's splits; int64 arithmetic; each row equals ``memory_budget``'s
        total laid out item by item, tests/test_planner.py)."""
        if any(o.reload_bytes for o in order):  # offload: a layer's backward holds the next reload too
            rows = [[(o, int(n)) for o, n in zip(order, row)] for row in counts]
            return np.array([self.used(runs, m, limit_on) for runs in rows], dtype=np.int64)
        kept = np.array([o.saved_bytes for o in order], dtype=np.int64)
        backward = np.array([o.backward_peak_bytes for o in order], dtype=np.int64)
        static, before, after = self.sums
        one = counts @ kept + before + after
        # stack_peak, run by run: a run of n > 0 layers peaks at its last layer's backward.
        prefix = before + np.cumsum(counts * kept, axis=1) - counts * kept  # kept before each run
        runs = np.where(counts > 0, prefix + (counts - 1) * kept + backward, 0)
        peak_one = np.maximum(runs.max(axis=1, initial=0), one)  # one = prefix at the end + after
        saved, peak = one * m, one * (m - 1) + peak_one
        if limit_on == "activations":
            return saved
        extra = np.maximum.reduce([np.full_like(saved, self.loss_transient), peak - saved, self.step - saved])
        if self.scores:
            extra = np.maximum(extra, self.scores)
        return static + saved + np.maximum(extra, 0)


def memory_budget(
    model: Model,
    setup: TrainingSetup,
    layers: Layers = "none",
    options: dict[str, LayerOption] | None = None,
) -> MemoryBudget:
    """The per-device budget with ``layers`` recompute: one option name for every layer, or one
    per layer (in layer order: it decides the backward peak, see :func:`~.options.canonical_order`);
    or a :class:`RecomputeConfig` for the whole stack (any the analytic model prices: grouped and
    block full recompute too), or a per-layer list of ``RecomputeConfig | None`` (what
    ``apply_recompute`` takes; names may be mixed in). Names are the ``options`` offered
    (:func:`~.options.layer_options`); configs are priced as given."""
    options = options if options is not None else layer_options(model, setup)
    order = per_layer_options(model, setup, layers, options)
    parts = BudgetParts.of(model, setup)
    m = setup.microbatches_in_flight
    items = list(parts.static) + _layer_items(order, m)
    items += [LineItem(i.name, i.nbytes * m, i.category, i.note) for i in (*parts.before, *parts.after)]
    saved, peak = parts.activations([(o, 1) for o in order], m)
    extra, why = parts.workspace(saved, peak)
    items.append(LineItem("peak workspace", extra, "workspace", why))
    notes = [f"micro-batches in flight: {m} (1 without pipeline parallelism)"]
    names = tuple(o.name for o in order)
    return MemoryBudget(model, setup, names, tuple(items), tuple(notes), peak)


__all__ = [
    "GIB",
    "LineItem",
    "MemoryBudget",
    "embedding_bytes",
    "largest_collective_bytes",
    "memory_budget",
    "optimizer_step_bytes",
]
