"""A transformers model as the budget and the recompute planner take it: :class:`TransformersModel`.

:func:`~neuron_ckpt.memory.budget.memory_budget` and :func:`~neuron_ckpt.memory.planner.plan_recompute`
take a model and a :class:`~neuron_ckpt.memory.shape.TrainingSetup` (``tp``, ``dp``, ``seq_len``,
``micro_batch``, ``dtype``, ``sequence_parallel``, ``zero1``, ``bucket_cap_mb``...). With this
library's Llama (:class:`~neuron_ckpt.memory.shape.ModelShape`) every layer is alike; with a
transformers model of any family ``apply_tensor_parallel`` splits, this class answers what the
budget and the search ask, each from its own module:

* **static items** (here): the parameters one rank holds (:mod:`.params`: the dense ones split as
  the family's ``tp_plan`` says, the routed experts over EP at e > 1), their gradients, ZeRO-1's
  fp32 masters and AdamW moments: the dense ones over DP, the experts' over the expert
  data-parallel group, ``world / (EP x expert TP x PP) = tp dp / ep`` (expert TP is 1 with EP, as
  ``distributed/layout.py`` lays it out, and TP without: then every parameter is dense), and the
  masks the forward builds (:mod:`.outside`);
* **outside the layers** (:mod:`.outside`): the embedding, rotary tables, final norm, LM head and
  loss, and the loss's transient;
* **the layers** (:mod:`.choices`): each kind's recompute options, priced by :mod:`.layer`;
* **FLOPs of a step**: three times the forward matmuls one rank runs (its layers' ops as
  :mod:`.layer` lists them, at the rows its experts receive, and the LM head), the convention of
  :meth:`~neuron_ckpt.memory.shape.ModelShape.flops_per_token`.

Option names carry the layer's kind when a model has several (``"moe:norm+moe_act"``,
``"dense:full"``), so a plan is a count of layers per option per kind. ``tests/test_planner_families.py``
checks the budget against real split models.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from ...recompute import RecomputeConfig
from ..budget import BudgetParts, LineItem
from ..options import LayerOption
from ..shape import ModelShape, TrainingSetup
from .choices import kind_options, label, price
from .experts import received_rows
from .families import FAMILY
from .layer import check_ep, layer_tensors, modules_of
from .outside import (
    embedding_bytes,
    final_norm_bytes,
    loss_bytes,
    loss_transient_bytes,
    mask_bytes,
    rotary_bytes,
)
from .params import parameter_split
from .shape import MoESetup, MoEShape

KIND = "transformers"
_FP32 = 4


@dataclass(frozen=True)
class Stage:
    """What one pipeline rank holds of the model: layers ``first`` to ``stop`` (excluded), the
    embedding (the first stage) and the final norm, LM head and loss (the last; with tied
    embeddings it keeps a copy of the embedding for the head, as Megatron's last stage does)."""

    first: int
    stop: int
    embedding: bool
    head: bool


@dataclass(frozen=True)
class TransformersModel:
    """A transformers model (``shape``) and how its layers run: ``attention`` and ``experts``,
    transformers' implementations (as :class:`~.shape.MoESetup` takes them), ``ep`` the
    expert-parallel degree (``expert_model_parallel_size``) and ``ep_rows`` the rows each rank's
    experts receive at ``ep`` > 1 (``"balanced"``, ``"worst"`` or a count), under the dispatch form
    ``ep_dispatch`` (``"all_to_all"``, or ``"all_gather"`` with its ``capacity_factor``, None for
    dropless: XLA's static form). ``stage``: the part a pipeline rank holds (None: all of it)."""

    shape: MoEShape
    attention: str = "sdpa"
    experts: str = "grouped_mm"
    ep: int = 1
    ep_rows: str | int = "balanced"
    ep_dispatch: str = "all_to_all"
    capacity_factor: float | None = None
    stage: Stage | None = None
    kind: str = field(default=KIND, init=False)

    def __post_init__(self) -> None:
        self.layer_setup(TrainingSetup(seq_len=1))  # MoESetup's checks
        if FAMILY[self.shape.family].eager_only and self.attention != "eager":
            raise ValueError(
                f"attention: transformers runs {self.shape.family}'s attention eager only, got {self.attention!r}"
            )

    @property
    def name(self) -> str:
        return self.shape.name or self.shape.family

    @property
    def indices(self) -> range:
        """The model's layers this rank runs."""
        return range(self.shape.layers) if self.stage is None else range(self.stage.first, self.stage.stop)

    @property
    def layers(self) -> int:
        return len(self.indices)

    @property
    def holds(self) -> tuple[bool, bool]:
        """Whether this rank holds the embedding, and the LM head and loss."""
        return (True, True) if self.stage is None else (self.stage.embedding, self.stage.head)

    # --- the job ---------------------------------------------------------------------------
    def layer_setup(self, setup: TrainingSetup) -> MoESetup:
        """How one rank runs a layer of this model in ``setup``."""
        return MoESetup(setup.seq_len, setup.micro_batch, setup.tp, setup.dtype, self.attention, self.experts,
                        setup.sequence_parallel, self.ep, self.ep_rows, self.ep_dispatch,
                        self.capacity_factor)  # fmt: skip

    def expert_data_parallel(self, setup: TrainingSetup) -> int:
        """The ranks ZeRO-1 shards the experts' state over: ``world / (EP x expert TP x PP)``,
        ``tp dp / ep`` on one pipeline stage with expert TP 1; 1 without ZeRO-1."""
        return setup.tp * setup.dp // self.ep if setup.zero1 else 1

    def problems(self, setup: TrainingSetup) -> list[str]:
        """Every reason ``setup`` cannot run this model (empty when it can)."""
        s, t = self.shape, setup.tp
        out = []
        if setup.cp > 1:
            out.append(f"cp ({setup.cp}): context parallelism runs this library's Llama only, not transformers models")
        why = s.valid_tp(t)
        if why is not None:
            out.append(why)
        if s.vocab % t:
            out.append(f"tp ({t}) must divide vocab ({s.vocab}): the embedding and LM head split by vocabulary rows")
        if (setup.sequence_parallel or self.ep > 1) and setup.seq_len % t:
            why = "sequence_parallel is True" if setup.sequence_parallel else f"ep is {self.ep} (each rank sends s/t)"
            out.append(f"seq_len ({setup.seq_len}) must be a multiple of tp ({t}) when {why}")
        if self.ep > 1:
            ms = self.layer_setup(replace(setup, tp=1, sequence_parallel=False)) if out else self.layer_setup(setup)
            try:
                check_ep(s, ms)
            except ValueError as exc:
                out.append(str(exc))
            if (t * setup.dp) % self.ep:
                out.append(
                    f"ep ({self.ep}) must divide tp x dp = {t * setup.dp} (the ranks of a pipeline stage EP is carved "
                    "from, distributed/layout.py)"
                )
        return out

    def check(self, setup: TrainingSetup) -> None:
        """One ``ValueError`` naming every problem :meth:`problems` finds."""
        problems = self.problems(setup)
        if problems:
            raise ValueError(f"{self.name}: " + "; ".join(problems))

    def valid_tp_degrees(self, setup: TrainingSetup) -> list[int]:
        """Tensor-parallel degrees that can split this model in ``setup`` (its dp, ep, sequence)."""
        return [t for t in range(1, self.shape.heads + 1) if not self.problems(replace(setup, tp=t))]

    # --- what the budget holds ---------------------------------------------------------------
    def parameters(self, setup: TrainingSetup) -> tuple[int, int]:
        """``(dense, experts)`` parameters one rank holds (:meth:`~.params.ParameterSplit.local`)."""
        embedding, head = self.holds
        parts = [f"layer{i}" for i in self.indices] + ["embedding"] * embedding + ["head"] * head
        if head and not embedding and self.shape.tied_embeddings:
            parts.append("embedding")  # the tied LM head's copy
        return parameter_split(self.shape, tuple(parts)).local(setup.tp, self.ep)

    def static_items(self, setup: TrainingSetup) -> tuple[list[LineItem], int]:
        """Parameters, gradients, ZeRO-1 state and masks; and the optimizer step's bytes."""
        dense, experts = self.parameters(setup)
        n, dp, edp = dense + experts, setup.optimizer_shards, self.expert_data_parallel(setup)
        shards = -(-dense // dp) + (-(-experts // edp) if experts else 0)  # ZeRO-1 pads each flat
        where = f"dense /dp={dp}" + (f", experts /edp={edp}" if experts else "") if setup.zero1 else "(not sharded)"
        split = f" ({dense / 1e6:,.1f} M dense + {experts / 1e6:,.1f} M experts, E/{self.ep})" if experts else ""
        grads = "fp32 accumulation buffers" if setup.grad_width != setup.width else f"{setup.dtype}, full local size"
        items = [
            LineItem("parameters", n * setup.width, "static", f"{n / 1e6:,.1f} M local{split}, {setup.dtype}"),
            LineItem("gradients", n * setup.grad_width, "static", grads),
        ]
        if setup.keeps_master_weights:
            items.append(LineItem("master weights", shards * _FP32, "static", f"fp32 {where}"))
        items.append(LineItem("optimizer moments", 2 * shards * _FP32, "static", f"AdamW, fp32 {where}"))
        masks, what = mask_bytes(self.shape, self.layer_setup(setup))
        if masks:
            items.append(LineItem("attention mask", masks, "static", f"transformers' {what}, shared by the layers"))
        whole = n * setup.grad_width
        if not setup.zero1:
            step = n * _FP32
        elif setup.bucket_cap_mb is None:
            step = whole + shards * (setup.grad_width + _FP32)
        else:
            step = shards * _FP32 + min(whole, int(setup.bucket_cap_mb * 2**20))
        return items, step

    def parts(self, setup: TrainingSetup) -> BudgetParts:
        """What the budget holds whatever the layers run (:class:`~neuron_ckpt.memory.budget.BudgetParts`)."""
        self.check(setup)
        s, ms = self.shape, self.layer_setup(setup)
        static, step = self.static_items(setup)
        embedding, head = self.holds
        w, T, h = ms.width, ms.local_tokens, s.hidden
        if embedding:
            before = [LineItem("act: embedding + rotary", embedding_bytes(s, ms) + rotary_bytes(s, ms), "activations",
                               "ids (and shard mask), rotary tables")]  # fmt: skip
        else:
            before = [LineItem("act: stage input + rotary", w * T * h + rotary_bytes(s, ms), "activations",
                               "the received [b, s/t, h] held for its gradient, rotary tables")]  # fmt: skip
        if head:
            kept = "fp32 log-softmax [b s, v] + targets" if setup.tp == 1 else "fp32 softmax [b s, v/t] + targets"
            after = [
                LineItem("act: final norm + LM head", final_norm_bytes(s, ms), "activations", "norm, head input"),
                LineItem("act: loss", loss_bytes(s, ms), "activations", kept),
            ]
        else:
            after = [LineItem("act: stage output", w * T * h, "activations", "the sent [b, s/t, h] until its gradient")]
        scores = self._scores_transient(ms)
        loss = loss_transient_bytes(s, ms) if head else 0
        parts = BudgetParts(tuple(static), step, tuple(before), tuple(after), loss, scores)
        return replace(parts, attention_note="unfused attention: two [b, a/t, s, s] score copies at once")

    def _scores_transient(self, ms: MoESetup) -> int:
        """An unfused core attention's scores beyond what it keeps: at worst two ``[b, a/t, s, s]``
        copies in the model's dtype while they are scaled, masked and soft-maxed; a fused kernel none."""
        s = self.shape
        kinds = {s.kind_of(i) for i in self.indices}
        unfused = any(place == "attn.core.scores" for kind in kinds for place, _ in layer_tensors(s, ms, kind).ops)
        heads = s.heads // s.split("attention", ms.tp)
        return 2 * ms.width * ms.micro_batch * heads * ms.seq_len**2 if unfused else 0

    def step_flops(self, setup: TrainingSetup) -> float:
        """Model FLOPs of one micro-batch's forward and backward on one rank: three times its
        forward matmuls (every layer's, and the LM head's ``2 T h v/t``)."""
        ms = self.layer_setup(setup)
        per_kind = {k: sum(f.matmul for _, f in layer_tensors(self.shape, ms, k).ops) for k in self.shape.kinds}
        layers = sum(per_kind[self.shape.kind_of(i)] for i in self.indices)
        head = 2 * ms.tokens * self.shape.hidden * self.shape.vocab / setup.tp if self.holds[1] else 0.0
        return 3 * (layers + head)

    # --- the layers ------------------------------------------------------------------------
    def _prefix(self, kind: str) -> str:
        return f"{kind}:" if len(self.shape.kinds) > 1 else ""

    def layer_options(self, setup: TrainingSetup) -> dict[str, LayerOption]:
        """Every kind's options (:func:`~.choices.kind_options`), by name."""
        self.check(setup)
        ms = self.layer_setup(setup)
        return {o.name: o for k in self.shape.kinds for o in kind_options(self.shape, ms, k, self._prefix(k))}

    def options_by_layer(
        self, options: dict[str, LayerOption], allowed: tuple[str, ...] | None = None
    ) -> list[dict[str, LayerOption]]:
        """Each layer's options among ``options`` (one dict per kind, shared by its layers), only
        those whose modules ``allowed`` names (``"none"``, ``"full"``, ``"norm+moe_act"``...)."""
        by_kind = {}
        for kind in self.shape.kinds:
            prefix = self._prefix(kind)
            mine = {n: o for n, o in options.items() if n.startswith(prefix) and ":" not in n[len(prefix) :]}
            if allowed is not None:
                mine = {n: o for n, o in mine.items() if n[len(prefix) :] in allowed}
            if not mine:
                raise ValueError(f"allowed: no option of {kind} layers among {allowed}; choose from {list(options)}")
            by_kind[kind] = mine
        return [by_kind[self.shape.kind_of(i)] for i in self.indices]

    def per_layer_options(
        self, setup: TrainingSetup, layers: str | RecomputeConfig | Sequence, options: dict[str, LayerOption]
    ) -> list[LayerOption]:
        """Each layer's option for what a budget is given: an option name (a kind's, or one every
        kind has without its ``kind:``), a config priced on every layer, or one entry per layer
        (a name, a config, None for no recompute)."""
        kinds = [self.shape.kind_of(i) for i in self.indices]
        if isinstance(layers, (str, RecomputeConfig)):
            entries: list = [layers] * self.layers
        elif isinstance(layers, (list, tuple)):
            entries = list(layers)
        else:
            raise ValueError(f"layers must be an option name, a RecomputeConfig or one entry per layer, got {layers!r}")
        if len(entries) != self.layers:
            raise ValueError(f"layers: need one option per layer ({self.layers}), got {len(entries)}")
        ms, out = self.layer_setup(setup), []
        for i, (kind, entry) in enumerate(zip(kinds, entries)):
            if isinstance(entry, str):
                name = entry if entry in options else self._prefix(kind) + entry
                if name not in options or not name.startswith(self._prefix(kind)):
                    raise ValueError(
                        f"layers[{i}]: option {entry!r} is not offered for a {kind} layer of {self.name}; "
                        f"choose from {[n for n in options if n.startswith(self._prefix(kind))]}"
                    )
                out.append(options[name])
            elif entry is None or isinstance(entry, RecomputeConfig):
                modules = modules_of(entry or RecomputeConfig())
                out.append(price(layer_tensors(self.shape, ms, kind), modules, ms, self._prefix(kind) + label(modules)))
            else:
                raise ValueError(f"layers[{i}] must be an option name, a RecomputeConfig or None, got {entry!r}")
        return out

    # --- when nothing fits -----------------------------------------------------------------
    def nothing_fits_hints(
        self, setup: TrainingSetup, fits: Callable[[TransformersModel, TrainingSetup], bool]
    ) -> list[str]:
        """The smallest expert-parallel degree above this one that fits (same tp, dp, micro-batch)."""
        s = self.shape
        if FAMILY[s.family].experts in (None, "all"):
            return []
        more = [e for e in range(self.ep + 1, s.experts + 1)
                if s.experts % e == 0 and (setup.tp * setup.dp) % e == 0]  # fmt: skip
        for e in more:
            other = replace(self, ep=e)
            if not other.problems(setup) and fits(other, setup):
                rows = received_rows(s, other.layer_setup(setup))
                return [
                    (
                        f"fits with --ep {e} (the smallest expert-parallel degree that fits at tp={setup.tp}, "
                        f"dp={setup.dp}, micro-batch {setup.micro_batch}: E/{e} = {s.experts // e} experts per rank, "
                        f"{rows:,} rows received per MoE layer, {other.ep_rows})"
                    )
                ]
        if not more:
            return [f"no expert-parallel degree above {self.ep} divides both E ({s.experts}) and tp x dp"]
        return [f"no expert-parallel degree above {self.ep} fits (tried {more})"]


Model = ModelShape | TransformersModel
"""What the budget and the planner take."""

__all__ = ["KIND", "Model", "TransformersModel"]
