"""Analytic activation memory: what each layer keeps for backward, and the peak of a stack.

Two layers, both built tensor by tensor rather than from closed forms (:mod:`.terms`), so a
report can print where the bytes go and a measurement can be compared term by term:

* the paper's GPT layer (Korthikanti et al. 2022, Table 2): LayerNorm -> QKV -> softmax(QK^T)
  -> dropout -> attention over V -> output projection -> dropout -> residual; LayerNorm -> fc1
  (h -> 4h) -> GeLU -> fc2 -> dropout -> residual. Activations are ``setup.width`` bytes wide,
  dropout masks 1 byte (what ``torch.native_dropout`` saves). The presets none, selective and
  full are exactly the rows of Table 2.
* the Llama layer (:mod:`neuron_ckpt.models.llama`): RMSNorm, GQA, rotary, fp32 softmax kept in
  16 bits, SwiGLU, no dropout; derived in docs/memory.md ("The Llama layer"), with either core
  attention (``setup.attention``): explicit (the ``s^2`` probabilities) or flash (torch's SDPA
  flash kernel: an fp32 logsumexp per query row instead).

Every function takes ``(model, setup, recompute)``: a :class:`~.shape.ModelShape`, a
:class:`~.shape.TrainingSetup` (its seq_len, micro_batch, tp, dtype and sequence_parallel) and a
recompute choice: a preset name (:data:`~neuron_ckpt.recompute.PRESETS`) or any
:class:`~neuron_ckpt.recompute.RecomputeConfig` (any selective module set, full ``uniform`` or
``block`` with any ``num_layers``, ``distribute_saved_activations`` without sequence parallel).
:func:`resolve` checks it against the model and the setup. Every count is an exact integer.

Per layer and per stack. Grouped (``uniform``, ``num_layers > 1``) and ``block`` full recompute
keep different bytes in different layers: the layer that starts a checkpoint keeps its input,
the other layers of a group nothing; block's first ``num_layers`` layers keep their input and
the rest run without recompute. The per-layer functions describe one layer as it is kept, so
for those configs they need the layer's index (``layer=i``) and refuse without one, rather than
answer for a layer that does not exist: "a layer's bytes times L" would be wrong.
:func:`model_activation_bytes` sums the stack exactly, and :func:`model_activation_peak_bytes`
adds the recompute buffers of the backward.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..recompute import MODULES, PRESETS, RecomputeConfig
from .shape import ModelShape, TrainingSetup
from .terms import ActivationTerm, LayerSpec, RecomputeEvent, layer_terms

Recompute = str | RecomputeConfig


def supported_presets(model: ModelShape) -> tuple[str, ...]:
    """The presets the model prices: every one, for both layers (GPT's ``mlp_act`` is its GeLU)."""
    return PRESETS


@dataclass(frozen=True)
class PricedRecompute:
    """A recompute choice as the memory model reads it (what :func:`resolve` returns).

    config: the :class:`RecomputeConfig` (a preset's, for a name). name: the preset it equals, or
    ``selective[mlp,norm]`` / ``full(uniform 2)`` / ``full(block 3)``. modules: the selective
    modules in effect (``mlp`` encloses ``mlp_act``: the outermost wins); empty otherwise.
    sliced: checkpoint inputs are kept as 1/t slices (``distribute_saved_activations`` at t > 1).
    """

    config: RecomputeConfig
    name: str
    modules: tuple[str, ...]
    sliced: bool

    @property
    def label(self) -> str:
        """``name``, with ``+distributed`` when the config distributes its saved inputs."""
        return self.name + ("+distributed" if self.config.distribute_saved_activations else "")

    def same_on_every_layer(self, num_layers: int) -> bool:
        """Whether every layer of a ``num_layers`` stack keeps the same bytes."""
        c = self.config
        if c.granularity != "full" or num_layers == 1:
            return True
        k = c.num_layers
        assert k is not None  # full recompute always names it (RecomputeConfig checks)
        return k == 1 if c.method == "uniform" else k >= num_layers

    def layer(self, index: int, num_layers: int) -> LayerSpec:
        """How layer ``index`` of a ``num_layers`` stack runs."""
        c = self.config
        if c.granularity != "full":
            return LayerSpec(self.modules, None, self.sliced)
        k = c.num_layers
        assert k is not None  # full recompute always names it (RecomputeConfig checks)
        if c.method == "block":
            return LayerSpec((), 1, self.sliced) if index < k else LayerSpec()
        return LayerSpec((), min(k, num_layers - index) if index % k == 0 else 0, self.sliced)

    def layer_label(self, index: int, num_layers: int) -> str:
        """What layer ``index`` runs, in a budget's words: block's layers are ``full`` or ``none``."""
        if self.config.method == "block":
            k = self.config.num_layers
            assert k is not None  # full recompute always names it (RecomputeConfig checks)
            return self.label.replace(self.name, "full") if index < k else "none"
        return self.label


def _name(config: RecomputeConfig, modules: tuple[str, ...]) -> str:
    effective = RecomputeConfig(config.granularity, config.method, config.num_layers, modules or ("core_attn",))
    if effective.preset_name is not None:
        return effective.preset_name
    if config.granularity == "full":
        return f"full({config.method} {config.num_layers})"
    return f"selective[{','.join(modules)}]"


def resolve(model: ModelShape, setup: TrainingSetup, recompute: Recompute) -> PricedRecompute:
    """``recompute`` checked against the model and the setup, as the memory model reads it; a
    ``ValueError`` naming the field otherwise."""
    if isinstance(recompute, str):
        config = RecomputeConfig.preset(recompute)
    elif isinstance(recompute, RecomputeConfig):
        config = recompute
    else:
        raise ValueError(f"recompute must be a preset name {list(PRESETS)} or a RecomputeConfig, got {recompute!r}")
    if setup.cp > 1 and model.kind == "gpt":
        raise ValueError(
            f"cp (context_parallel_size) {setup.cp}: context parallelism is built and modelled for llama "
            "only (the paper's GPT layer takes no context-parallel group); use cp=1 for gpt"
        )
    if setup.attention == "flash" and model.kind == "gpt":
        raise ValueError(
            "attention 'flash' is modelled for llama only: the paper's GPT layer has attention dropout, "
            "with which torch's CPU flash kernel falls back to its math path (fp32 [b, a, s, s] tensors "
            "kept, not modelled); use attention='explicit' for gpt"
        )
    modules: tuple[str, ...] = ()
    if config.granularity == "selective":
        chosen = set(config.modules) - ({"mlp_act"} if "mlp" in config.modules else set())
        modules = tuple(m for m in MODULES if m in chosen)
    if config.granularity == "full" and config.num_layers is not None and config.num_layers > model.layers:
        raise ValueError(
            f"recompute: num_layers={config.num_layers} is larger than the {model.layers} layers of the "
            f"model; choose 1..{model.layers}"
        )
    distribute = config.distribute_saved_activations
    # Megatron refuses distributing with sequence parallel: the saved input is already a shard.
    if distribute and setup.sequence_parallel:
        raise ValueError(
            "distribute_saved_activations must be False when sequence_parallel is True "
            "(the saved layer input is already a 1/t sequence shard)"
        )
    if distribute and config.granularity == "selective" and not {"mlp", "norm"} & set(modules):
        raise ValueError(
            f"distribute_saved_activations: the selective modules {list(modules)} keep no replicated "
            "input to distribute; only 'mlp' and 'norm' do (or use full recompute)"
        )
    why = model.valid_tp(setup.tp, setup.local_seq_len if setup.sequence_parallel else None, include_vocab=False)
    if why is not None:
        raise ValueError(why)
    if model.head_dim * model.heads != model.hidden:
        raise ValueError(
            f"head_dim ({model.head_dim}) * heads ({model.heads}) must equal hidden "
            f"({model.hidden}) for the memory model"
        )
    return PricedRecompute(config, _name(config, modules), modules, distribute and setup.tp > 1)


def _spec(model: ModelShape, setup: TrainingSetup, recompute: Recompute, layer: int | None) -> LayerSpec:
    priced = resolve(model, setup, recompute)
    if layer is None:
        if not priced.same_on_every_layer(model.layers):
            raise ValueError(
                f"layer: recompute {priced.name!r} keeps different bytes in different layers; pass "
                f"layer=0..{model.layers - 1}, or use model_activation_bytes for the whole stack"
            )
        layer = 0
    if not (isinstance(layer, int) and 0 <= layer < model.layers):
        raise ValueError(f"layer must be an int in 0..{model.layers - 1}, got {layer!r}")
    return priced.layer(layer, model.layers)


def layer_activation_terms(
    model: ModelShape, setup: TrainingSetup, recompute: Recompute, layer: int | None = None
) -> list[ActivationTerm]:
    """The tensors one layer keeps for backward on one rank, with their bytes, in forward order.

    ``layer``: the layer's index, needed only where layers differ (grouped and block full
    recompute; see the module docstring). Full recompute keeps one term, ``layer_input``: 2sbh,
    or 2sbh/t when it is a sequence shard (sequence parallel) or distributed across the TP group.
    """
    return layer_terms(model, setup, _spec(model, setup, recompute, layer))[0]


def layer_activation_bytes(
    model: ModelShape, setup: TrainingSetup, recompute: Recompute, layer: int | None = None
) -> int:
    """Activation bytes one layer keeps for backward on one rank (for GPT, a row of Table 2)."""
    return sum(term.nbytes for term in layer_activation_terms(model, setup, recompute, layer))


def layer_recompute_events(
    model: ModelShape, setup: TrainingSetup, recompute: Recompute, layer: int | None = None
) -> list[RecomputeEvent]:
    """When one layer's backward recomputes, and what comes back (:class:`~.terms.RecomputeEvent`)."""
    return layer_terms(model, setup, _spec(model, setup, recompute, layer))[1]


def layer_backward_peak(kept: int, events: Sequence[RecomputeEvent]) -> int:
    """The most one layer holds at once from the start of its backward: all it kept, or a
    recompute's ``held + again``."""
    return max([kept, *(e.held + e.again for e in events)])


def stack_peak(layers: Sequence[tuple[int, ...]], before: int = 0, after: int = 0) -> int:
    """The peak of live activations over one micro-batch's forward and backward.

    ``layers``: ``(kept, backward peak)`` of each layer in layer order (:func:`layer_backward_peak`),
    or ``(kept, backward peak, n)`` for a run of ``n`` such layers (the run's peak is its last
    layer's: the most is held before it); ``before``: what is kept before the layers (embedding,
    rotary tables) and held until their backward is done; ``after``: what is kept after them
    (final norm, LM head, loss), freed before the last layer's backward starts. The forward ends
    holding everything; backward runs from the last layer down, and layer i's backward holds what
    layers 0..i-1 still keep.
    """
    peak, prefix = 0, before
    for kept, backward, *run in layers:
        n = run[0] if run else 1
        if n:
            peak = max(peak, prefix + (n - 1) * kept + backward)
            prefix += n * kept
    return max(peak, prefix + after)


def outside_layer_terms(model: ModelShape, setup: TrainingSetup, recompute: Recompute) -> list[ActivationTerm]:
    """Terms one stack of layers shares: Llama's rotary tables (:func:`rotary_terms`; a full
    recompute checkpoint keeps them as inputs too); none for GPT."""
    resolve(model, setup, recompute)
    return rotary_terms(model, setup) if model.kind == "llama" else []


def model_activation_bytes(
    model: ModelShape, setup: TrainingSetup, recompute: Recompute, outside: Sequence[ActivationTerm] = ()
) -> int:
    """Activation bytes the ``model.layers`` layers keep for backward once the forward is done
    (what ``SavedTensorRecorder`` measures), plus the terms ``outside`` them.

    ``outside`` is the hook for what the layers do not cover: the embedding's dropout mask, the
    final norm's input, the LM head input and the loss's logits (the paper's section 4.3).
    Nothing is added by default; the whole-model budget (:mod:`.budget`) adds them. The peak,
    recompute buffers included, is :func:`model_activation_peak_bytes`.
    """
    kept = sum(layer_activation_bytes(model, setup, recompute, i) for i in range(model.layers))
    return kept + sum(t.nbytes for t in outside)


def model_activation_peak_bytes(
    model: ModelShape,
    setup: TrainingSetup,
    recompute: Recompute,
    before: Sequence[ActivationTerm] = (),
    after: Sequence[ActivationTerm] = (),
) -> int:
    """The most activation bytes alive at once over one micro-batch's forward and backward:
    what the layers keep, plus, while a layer (or a group of k layers) recomputes in backward,
    what its rerun brings back on top of what the earlier layers still hold (:func:`stack_peak`;
    ``before`` / ``after``: terms outside the layers, kept before / after them)."""
    layers = []
    for i in range(model.layers):
        kept, events = layer_terms(model, setup, _spec(model, setup, recompute, i))
        nbytes = sum(t.nbytes for t in kept)
        layers.append((nbytes, layer_backward_peak(nbytes, events)))
    return stack_peak(layers, sum(t.nbytes for t in before), sum(t.nbytes for t in after))


def rotary_terms(model: ModelShape, setup: TrainingSetup) -> list[ActivationTerm]:
    """Llama's rotary cos and sin tables ``[s, d]``, shared by every layer.

    Rotary multiplies q and k by them, which keeps the tables (not q, k: the tables need no
    gradient). The embedding, final norm, LM head input and loss terms are in the whole-model
    budget (:mod:`.budget`).
    """
    nbytes = setup.width * setup.local_seq_len * model.head_dim  # this rank's positions under CP
    return [ActivationTerm("rope_cos", nbytes, False), ActivationTerm("rope_sin", nbytes, False)]


__all__ = [
    "ActivationTerm", "PricedRecompute", "RecomputeEvent", "layer_activation_bytes", "layer_activation_terms",
    "layer_backward_peak", "layer_recompute_events", "model_activation_bytes", "model_activation_peak_bytes",
    "outside_layer_terms", "resolve", "rotary_terms", "stack_peak", "supported_presets",
]  # fmt: skip
