"""Will each pipeline stage fit? One rank's memory, line by line, over its schedule.

A pipeline rank holds the parameters, gradients and optimizer state of its own layers (ZeRO-1
over dp as in :mod:`..budget`): stage 0 also the embedding table, the last stage the final
norm and the LM head (with tied embeddings its own copy of the table). Its activations are
those of every micro-batch in flight on each of its virtual stages: a stage keeps, per
micro-batch, the saved bytes of its layers (:mod:`..options`, under each layer's recompute),
Llama's rotary tables (each stage makes its own), the embedding's ids on stage 0 and the final
norm, the LM head's input and the vocab-parallel cross entropy's softmax on the last stage.
How many are in flight, and when, is the schedule's order (:mod:`.schedule`): the rank's live
bytes are followed action by action, the largest after a forward gives the activation lines,
and a recompute in a backward (:func:`~..analytic.stack_peak` of one micro-batch of that stage,
the others still held) goes into the peak workspace as in :mod:`..budget`, with the loss's
transient on the last rank only, the attention's scores where the rank has layers, and the
optimizer step over the rank's own parameters.

What torch 2.13's ``PipelineStage`` adds beyond autograd's saved tensors (``buffers="torch"``):

* one receive buffer per micro-batch for the stage input (``_setup_forward_recv_info``), and
  one for the gradient of its output (``_setup_backward_recv_info``), allocated for all ``m``
  micro-batches when the schedule first runs and kept: ``m`` x the boundary tensor each. The
  boundary is the hidden state, ``[s/t, b, h]`` under sequence parallel (the residual stream is
  the sequence shard), ``[s, b, h]`` without. An in-flight micro-batch's input buffer is the
  storage its first layer keeps (counted once, with the activations);
* each in-flight micro-batch's stage output, held in ``fwd_cache`` until its backward (nothing
  else keeps a layer's output): the hidden state, and on the last stage the logits
  ``[s, b, v/t]``, since the loss is the schedule's ``loss_fn`` (as :mod:`neuron_ckpt.pipeline`
  runs it); the loss's transient then counts the logits once, there.

Not counted: the last stage's outputs kept for ``step(return_outputs=True)`` (``m`` logits;
:mod:`neuron_ckpt.pipeline` passes False), and the buffers of sends in flight.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from ...recompute import RecomputeConfig
from ..analytic import rotary_terms, stack_peak
from ..budget import BudgetParts, LineItem, MemoryBudget, _layer_items, _outside_items, _static_items, embedding_bytes
from ..options import LayerOption, Layers, layer_options, per_layer_options, stack_options
from ..shape import ModelShape, TrainingSetup
from .cut import PipelineSetup
from .schedule import rank_order


@dataclass(frozen=True)
class Chunk:
    """One virtual stage as its rank runs it: global index ``stage``, decoder layers
    ``first_layer .. first_layer + layers - 1``; ``first`` holds the embedding, ``last`` the final
    norm, the LM head and the loss."""

    stage: int
    first_layer: int
    layers: int
    first: bool
    last: bool


def rank_chunks(model: ModelShape, pipeline: PipelineSetup, rank: int) -> list[Chunk]:
    """Rank ``rank``'s virtual stages, in its local order."""
    counts, starts = pipeline.cut(model.layers), pipeline.first_layers(model.layers)
    return [Chunk(k, starts[k], counts[k], k == 0, k == pipeline.stages - 1) for k in pipeline.rank_stages(rank)]


def rank_parameters(model: ModelShape, setup: TrainingSetup, chunks: Sequence[Chunk]) -> int:
    """Local parameters of a rank holding ``chunks``: its layers' shards, the embedding table on
    stage 0, the final norm and LM head on the last (tied: the last stage's own copy of the table)."""
    one = replace(model, layers=1).local_parameters(setup.tp)
    per_layer = replace(model, layers=2).local_parameters(setup.tp) - one
    outside = one - per_layer  # embedding, head (when untied) and the final norm
    table = model.vocab // setup.tp * model.hidden
    tied = model.kind == "gpt" or model.tie_word_embeddings
    n = sum(c.layers for c in chunks) * per_layer
    n += sum(table for c in chunks if c.first)
    # The last stage's head; tied, its own copy of the table unless the rank holds stage 0 too.
    own_copy = tied and not any(c.first for c in chunks)
    n += sum(outside - table + (table if own_copy else 0) for c in chunks if c.last)
    return n


@dataclass(frozen=True)
class Moments:
    """The states of a rank's schedule that can hold its most: after each forward, the
    micro-batches in flight per local chunk; just before each backward, the same and the chunk
    that runs it. A state held no more than another (count by count) is left out."""

    forward: tuple[tuple[int, ...], ...]
    backward: tuple[tuple[tuple[int, ...], int], ...]

    @staticmethod
    def of(pipeline: PipelineSetup, rank: int) -> Moments:
        index = {k: j for j, k in enumerate(pipeline.rank_stages(rank))}
        order = rank_order(pipeline.schedule, pipeline.pp, pipeline.microbatches, rank, pipeline.virtual_stages)
        held = [0] * pipeline.virtual_stages
        forward, backward = [], []
        for action in order:
            j = index[action.stage]
            if action.kind == "F":
                held[j] += 1
                forward.append(tuple(held))
            else:
                backward.append((tuple(held), j))
                held[j] -= 1
        backward_by_chunk = [[s for s, k in backward if k == j] for j in range(pipeline.virtual_stages)]
        return Moments(
            tuple(_undominated(forward)),
            tuple((s, j) for j, states in enumerate(backward_by_chunk) for s in _undominated(states)),
        )


def _undominated(states: list[tuple[int, ...]]) -> list[tuple[int, ...]]:
    """``states`` in their first order, without repeats and without any another holds at least as much of."""
    unique = list(dict.fromkeys(states))
    return [s for s in unique if not any(o != s and all(a >= b for a, b in zip(o, s)) for o in unique)]


@dataclass(frozen=True)
class ChunkBytes:
    """One micro-batch of one chunk: ``kept`` saved bytes after its forward, ``peak`` the most
    saved during its backward, ``held`` runtime bytes beside them (its output in ``fwd_cache``),
    ``shared`` kept bytes that are a runtime receive buffer's storage (its first layer's input)."""

    kept: int
    peak: int
    held: int = 0
    shared: int = 0


@dataclass(frozen=True)
class Held:
    """What a rank holds at its most (after the forward that leaves it holding the most):
    ``counts`` micro-batches in flight per local chunk, ``saved`` bytes of saved tensors, ``runtime``
    per-micro-batch runtime bytes (outputs held, less the inputs shared with a buffer); ``peak``:
    the most of both over the whole order (recompute in backward included); ``saved_peak``: the
    most saved bytes over the order (what ``LiveSavedTensors`` peaks at)."""

    counts: tuple[int, ...]
    saved: int
    runtime: int
    peak: int
    saved_peak: int


def hold(chunks: Sequence[ChunkBytes], moments: Moments, constant: int = 0) -> Held:
    """Follow a rank's live bytes over its schedule (:class:`Moments`) given each chunk's bytes;
    ``constant``: saved bytes held from the first forward to the last backward."""

    def live(counts: tuple[int, ...], with_runtime: bool = True) -> int:
        return constant + sum(n * (c.kept + (c.held - c.shared if with_runtime else 0)) for n, c in zip(counts, chunks))

    at = max(moments.forward, key=live)
    peak = max(
        [live(s) for s in moments.forward] + [live(s) - chunks[j].kept + chunks[j].peak for s, j in moments.backward]
    )
    saved_peak = max(
        [live(s, False) for s in moments.forward]
        + [live(s, False) - chunks[j].kept + chunks[j].peak for s, j in moments.backward]
    )
    saved = live(at, False)
    return Held(at, saved, live(at) - saved, peak, saved_peak)


class RankModel:
    """What one rank's memory depends on besides its layers' recompute: its chunks, parameters,
    schedule moments, what it keeps outside the layers and the runtime's buffers. :meth:`total`
    prices an assignment of layer options fast (the planner's loop); :meth:`budget` lays it out."""

    def __init__(self, model: ModelShape, setup: TrainingSetup, pipeline: PipelineSetup, rank: int):
        self.model, self.setup, self.pipeline, self.rank = model, setup, pipeline, rank
        self.chunks = rank_chunks(model, pipeline, rank)
        self.moments = Moments.of(pipeline, rank)
        self.parameters = rank_parameters(model, setup, self.chunks)
        has_layers = any(c.layers for c in self.chunks)
        holds_last = any(c.last for c in self.chunks)
        static, step = _static_items(model, setup, self.parameters)
        self.static = [i for i in static if has_layers or i.name != "attention mask"]
        _, self.after_items, loss_transient = _outside_items(model, setup)
        torch_buffers = pipeline.buffers == "torch"
        self.embed = embedding_bytes(model, setup)
        # torch cuts the batch into micro-batches as views (tensor_split); at t = 1 the embedding
        # keeps its ids as they come, so every micro-batch keeps the one [m b, s] storage.
        first = any(c.first for c in self.chunks)
        self.batch_ids = (
            pipeline.microbatches * self.embed
            if first and torch_buffers and (model.kind == "llama" and setup.tp == 1)
            else 0
        )
        self.rope = sum(t.nbytes for t in rotary_terms(model, setup)) if model.kind == "llama" else 0
        self.after = sum(i.nbytes for i in self.after_items)
        s, b, t = setup.seq_len, setup.micro_batch, setup.tp
        self.boundary = setup.width * (s // t if setup.sequence_parallel else s) * b * model.hidden
        per_buffer = pipeline.microbatches * self.boundary if torch_buffers else 0
        self.buffers = per_buffer * sum((not c.first) + (not c.last) for c in self.chunks)
        # The logits [s, b, v/t]: in fwd_cache until the backward with torch's buffers, so the
        # loss's transient (which counts them) counts them there and not again.
        self.logits = setup.width * s * b * (model.vocab // t)
        if torch_buffers:
            loss_transient -= self.logits
        scores = BudgetParts.of(model, setup).scores if has_layers else 0
        self.parts = BudgetParts(tuple(self.static), step, (), (), loss_transient if holds_last else 0, scores)

    @property
    def layers(self) -> int:
        return sum(c.layers for c in self.chunks)

    def chunk_bytes(self, chunk: Chunk, runs: Sequence[tuple[LayerOption, int]]) -> ChunkBytes:
        """One micro-batch of ``chunk`` with its layers given in layer order as runs of
        ``(option, number of layers)``."""
        before = (self.embed if chunk.first and not self.batch_ids else 0) + (self.rope if chunk.layers else 0)
        after = self.after if chunk.last else 0
        kept = sum(o.saved_bytes * n for o, n in runs) + before + after
        peak = stack_peak([(o.saved_bytes, o.backward_peak_bytes, n) for o, n in runs], before, after)
        if self.pipeline.buffers != "torch":
            return ChunkBytes(kept, peak)
        held = self.logits if chunk.last else self.boundary
        head = next((o for o, n in runs if n), None)
        shared = 0 if chunk.first or (head and _slices_input(head, self.setup)) else self.boundary
        return ChunkBytes(kept, peak, held, shared)

    def total(self, per_chunk: Sequence[Sequence[tuple[LayerOption, int]]]) -> int:
        """The rank's peak bytes with each local chunk's layers given as runs (:meth:`chunk_bytes`)."""
        held = hold([self.chunk_bytes(c, r) for c, r in zip(self.chunks, per_chunk)], self.moments, self.batch_ids)
        kept = held.saved + held.runtime
        return self.parts.sums[0] + self.buffers + kept + self.parts.workspace(kept, held.peak)[0]

    def budget(self, per_chunk: Sequence[Sequence[LayerOption]]) -> StageBudget:
        """The rank's :class:`StageBudget` with ``per_chunk`` options (one per layer, per local chunk)."""
        bytes_ = [self.chunk_bytes(c, [(o, 1) for o in options]) for c, options in zip(self.chunks, per_chunk)]
        held = hold(bytes_, self.moments, self.batch_ids)
        n = dict(zip((c.stage for c in self.chunks), held.counts))
        flat = [o for options in per_chunk for o in options]
        counts = [n[c.stage] for c, options in zip(self.chunks, per_chunk) for _ in options]
        items = list(self.static) + _layer_items(flat, counts)
        first = [n[c.stage] for c in self.chunks if c.first]
        if self.batch_ids:
            items.append(
                LineItem(
                    "act: embedding",
                    self.batch_ids,
                    "activations",
                    "ids of the whole batch: torch's micro-batches are views of it",
                )
            )
        elif first:
            what = "dropout mask" if self.model.kind == "gpt" else "ids, shard mask"
            items.append(LineItem("act: embedding", self.embed * first[0], "activations", what))
        if self.rope:
            with_layers = sum(n[c.stage] for c in self.chunks if c.layers)
            items.append(
                LineItem(
                    "act: rotary",
                    self.rope * with_layers,
                    "activations",
                    "cos/sin tables, made by each stage per micro-batch",
                )
            )
        last = [n[c.stage] for c in self.chunks if c.last]
        if last:
            items += [LineItem(i.name, i.nbytes * last[0], i.category, i.note) for i in self.after_items]
        if self.pipeline.buffers == "torch":
            shared = sum(k * b.shared for k, b in zip(held.counts, bytes_))
            items.append(
                LineItem(
                    "pipeline: receive buffers",
                    self.buffers - shared,
                    "pipeline",
                    f"torch PipelineStage: {self.pipeline.microbatches} per micro-batch for the input "
                    "and the output's gradient, kept; in-flight inputs counted with the layers",
                )
            )
            items.append(
                LineItem(
                    "pipeline: outputs in flight",
                    sum(k * b.held for k, b in zip(held.counts, bytes_)),
                    "pipeline",
                    "each in-flight micro-batch's stage output (the last stage's: its logits), held until its backward",
                )
            )
        kept = held.saved + held.runtime
        extra, why = self.parts.workspace(kept, held.peak)
        items.append(LineItem("peak workspace", extra, "workspace", why if extra else "nothing on top of what is kept"))
        ins = ", ".join(f"stage {c.stage}: {n[c.stage]}" for c in self.chunks)
        notes = (
            (
                "micro-batches in flight at the rank's most "
                f"({self.pipeline.schedule}, m={self.pipeline.microbatches}): {ins}"
            ),
        )
        budget = MemoryBudget(self.model, self.setup, tuple(o.name for o in flat), tuple(items), notes, held.saved_peak)
        return StageBudget(self.rank, tuple(self.chunks), held.counts, budget, tuple(flat))


def _slices_input(option: LayerOption, setup: TrainingSetup) -> bool:
    """Whether a layer keeps a 1/t slice of its input rather than the input itself (distributed
    saved activations: full recompute's input, or the first norm's under the ``norm`` module)."""
    config = option.recompute
    if not (config.distribute_saved_activations and setup.tp > 1):
        return False
    return config.granularity == "full" or "norm" in config.modules


@dataclass(frozen=True)
class StageBudget:
    """One pipeline rank's memory: ``chunks`` its virtual stages, ``in_flight`` the micro-batches
    each holds when the rank holds the most, ``budget`` the line items (``budget.total_bytes`` the
    peak; ``budget.activation_peak_bytes`` the most saved-tensor bytes alive over the step),
    ``options`` each of its layers' recompute, in layer order."""

    rank: int
    chunks: tuple[Chunk, ...]
    in_flight: tuple[int, ...]
    budget: MemoryBudget
    options: tuple[LayerOption, ...]

    @property
    def layers(self) -> int:
        return sum(c.layers for c in self.chunks)

    @property
    def microbatches_in_flight(self) -> int:
        """Micro-batch forwards held at the rank's most, over its virtual stages."""
        return sum(self.in_flight)

    @property
    def total_bytes(self) -> int:
        return self.budget.total_bytes

    @property
    def activation_bytes(self) -> int:
        return self.budget.activation_bytes

    def to_dict(self) -> dict[str, Any]:
        return {
            "stage": self.rank,
            "layers": self.layers,
            "virtual_stages": [
                {"stage": c.stage, "layers": c.layers, "first_layer": c.first_layer, "microbatches_in_flight": k}
                for c, k in zip(self.chunks, self.in_flight)
            ],
            "microbatches_in_flight": self.microbatches_in_flight,
            "activation_bytes": self.activation_bytes,
            "activation_peak_bytes": self.budget.activation_peak_bytes,
            "total_bytes": self.total_bytes,
            "total_gib": round(self.budget.total_gib, 4),
            "budget": self.budget.to_dict(),
        }


def split_options(
    model: ModelShape,
    setup: TrainingSetup,
    pipeline: PipelineSetup,
    layers: Layers,
    options: dict[str, LayerOption] | None = None,
) -> list[list[list[LayerOption]]]:
    """Each rank's layer options, one list per local chunk, for ``layers`` as
    :func:`~..budget.memory_budget` takes it: a name or one entry per layer of the whole model; a
    :class:`RecomputeConfig` applies within each virtual stage (grouped and block full recompute
    count their layers from the stage's first, as ``apply_recompute`` on a stage's layers does)."""
    options = options if options is not None else layer_options(model, setup)
    counts = pipeline.cut(model.layers)
    if isinstance(layers, RecomputeConfig):
        per_stage = [stack_options(replace(model, layers=n), setup, layers) if n else [] for n in counts]
    else:
        flat = per_layer_options(model, setup, layers, options)
        starts = pipeline.first_layers(model.layers)
        per_stage = [flat[a : a + n] for a, n in zip(starts, counts)]
    return [[per_stage[k] for k in pipeline.rank_stages(rank)] for rank in range(pipeline.pp)]


def stage_budgets(
    model: ModelShape,
    setup: TrainingSetup,
    pipeline: PipelineSetup,
    layers: Layers = "none",
    options: dict[str, LayerOption] | None = None,
) -> list[StageBudget]:
    """Every pipeline rank's :class:`StageBudget` with ``layers`` recompute (:func:`split_options`).
    ``setup.microbatches_in_flight`` is not used: the schedule decides."""
    per_rank = split_options(model, setup, pipeline, layers, options)
    return [RankModel(model, setup, pipeline, rank).budget(per_rank[rank]) for rank in range(pipeline.pp)]


__all__ = [
    "Chunk",
    "ChunkBytes",
    "Held",
    "Moments",
    "RankModel",
    "StageBudget",
    "hold",
    "rank_chunks",
    "rank_parameters",
    "split_options",
    "stage_budgets",
]
