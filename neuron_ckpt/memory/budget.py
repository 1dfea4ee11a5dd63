"""Will it fit? The per-device memory of a whole training job, line by line.

One device (a NeuronCore, a GPU) holds one tensor-parallel rank of one data-parallel replica:

* **parameters** and **gradients**: its 1/t shard of every split weight plus the replicated
  norm weights, in the model dtype (gradients as wide as the parameters);
* **optimizer state**: fp32 master weights and AdamW's two fp32 moments, divided by dp under
  ZeRO-1 (:class:`~neuron_ckpt.optim.Zero1Optimizer`, which always keeps an fp32 master slice);
* **the attention mask**: explicit ``CoreAttention`` keeps one ``[s, s]`` bool mask per process,
  shared by every layer (it lives as long as the process);
* **activations kept for backward**: per layer from the analytic model
  (:mod:`.analytic`) under the layer's recompute option, plus what sits outside the layers:
  rotary tables, embedding indices, the final norm, the LM head input and what the
  vocab-parallel cross entropy saves (its fp32 softmax ``[s, b, v/t]`` and the targets), times
  the micro-batches in flight (1 without pipeline parallelism: a micro-batch's backward ends
  before the next forward starts);
* **peak workspace**: the largest transient on top, whichever is worst of (a) the loss: the
  ``[s, b, v/t]`` logits plus the cross entropy's fp32 copy and shifted logits, (b) a recomputed
  layer's activations alive again during its backward, on top of the layers before it, (c) the
  optimizer step (after the activations are freed): the flattened gradients and fp32 slices.

Not modelled: gradient temporaries inside one op's backward, collective buffers, the device
runtime's own reservation and allocator fragmentation; keep some headroom (``reserve`` in the
planner). The Llama activation terms are the ones ``tests/test_memory_llama.py`` measures to
the byte, and ``tests/test_planner.py`` checks the whole-model activations against a
measured ``LlamaForCausalLM``. The GPT terms outside the layers are analytic only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Sequence

from ..models.flops import flops_per_token
from ..recompute import PRESETS, RecomputeConfig
from .analytic import (
    ActivationConfig,
    LayerShape,
    LlamaLayerShape,
    layer_activation_terms,
    llama_layer_activation_terms,
    llama_outside_layer_terms,
)

GIB = 1 << 30
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
_FP32, _INT64, _BOOL = 4, 8, 1
# Elementwise FLOPs per element, for the recompute cost: softmax (scale, mask, max, exp, sum,
# divide, roughly 5), SiLU times up (x * sigmoid(x) * up, 5), GeLU (tanh form, 8).
SOFTMAX_FLOPS, SWIGLU_FLOPS, GELU_FLOPS = 5, 5, 8

# Llama-2 7B (Touvron et al. 2023), used when the tutorial's config file is not there.
_LLAMA2_7B = dict(
    hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096, rms_norm_eps=1e-5,
    tie_word_embeddings=False, hidden_act="silu",
)
_REPO = Path(__file__).resolve().parents[2]
KNOWN_MODELS: dict[str, tuple[Path, dict[str, Any]]] = {
    "llama2-7b": (_REPO / "tutorials/llama2_7b_tp_zero1/configs/llama2_7b.json", _LLAMA2_7B),
}


# --------------------------------------------------------------------------------------------
# The model and the job.


@dataclass(frozen=True)
class ModelShape:
    """The sizes the budget needs: one decoder stack, the embedding and the LM head.

    kind: "llama" (:mod:`neuron_ckpt.models.llama`: RMSNorm, GQA, SwiGLU, untied head) or "gpt"
        (the paper's layer, :mod:`neuron_ckpt.models.gpt`, with a tied vocab-parallel head).
    hidden, heads, kv_heads, ffn, layers, vocab: h, a, g (= a without GQA), f, L, v.
    """

    kind: str
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    layers: int
    vocab: int
    name: str = ""

    def __post_init__(self) -> None:
        if self.kind not in ("llama", "gpt"):
            raise ValueError(f"kind must be 'llama' or 'gpt', got {self.kind!r}")
        for name in ("hidden", "heads", "kv_heads", "ffn", "layers", "vocab"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.hidden % self.heads:
            raise ValueError(f"hidden ({self.hidden}) must be a multiple of heads ({self.heads})")

    @classmethod
    def from_llama_config(cls, config: Any, name: str = "") -> "ModelShape":
        """From a ``transformers.LlamaConfig`` (or any object with its fields)."""
        h, a = config.hidden_size, config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or h // a
        if head_dim * a != h:
            raise ValueError(f"head_dim ({head_dim}) * heads ({a}) must equal hidden ({h}) for the budget")
        if getattr(config, "tie_word_embeddings", False):
            raise ValueError("tie_word_embeddings=True is not supported by LlamaForCausalLM; set it False")
        g = getattr(config, "num_key_value_heads", None) or a
        return cls("llama", h, a, g, config.intermediate_size, config.num_hidden_layers, config.vocab_size, name)

    @classmethod
    def gpt(cls, hidden: int, heads: int, layers: int, vocab: int = 51200, name: str = "") -> "ModelShape":
        """The paper's GPT: MLP width 4h, no GQA, vocab 51200 by default."""
        return cls("gpt", hidden, heads, heads, 4 * hidden, layers, vocab, name)

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def valid_tp(self, tp: int, seq_len: int | None = None) -> str | None:
        """Why ``tp`` cannot shard this model (None when it can); ``seq_len`` for sequence parallel."""
        checks = [
            (self.heads % tp == 0, f"tp ({tp}) must divide heads ({self.heads})"),
            (self.kv_heads % tp == 0 or tp % self.kv_heads == 0,
             f"kv_heads ({self.kv_heads}) must be a multiple of tp ({tp}) or divide it"),
            (self.ffn % tp == 0, f"tp ({tp}) must divide the MLP width ({self.ffn})"),
            (self.vocab % tp == 0, f"tp ({tp}) must divide vocab ({self.vocab})"),
            (seq_len is None or seq_len % tp == 0,
             f"seq_len ({seq_len}) must be a multiple of tp ({tp}) with sequence parallel"),
        ]
        return next((why for ok, why in checks if not ok), None)


def resolve_llama_config(path_or_name: str) -> Any:
    """A ``transformers.LlamaConfig`` from a JSON file, a directory holding ``config.json``, or a
    known name (``llama2-7b``: the tutorial's config file if present, else built-in numbers).
    Files are read strictly (:func:`~neuron_ckpt.models.config_file.load_llama_config`): an
    unknown or missing key, a wrong type or invalid JSON is a ``ValueError`` naming file and key."""
    import transformers  # lazily: heavy, and only Llama needs it

    from ..models.config_file import load_llama_config

    key = str(path_or_name).lower()
    if key in KNOWN_MODELS:
        path, builtin = KNOWN_MODELS[key]
        if path.is_file():
            return load_llama_config(path)
        return transformers.LlamaConfig(**builtin)
    path = Path(path_or_name)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(
            f"config: {path_or_name!r} is neither a JSON file, a directory with config.json, nor a known "
            f"name ({', '.join(KNOWN_MODELS)})"
        )
    return load_llama_config(path)


@dataclass(frozen=True)
class TrainingSetup:
    """How the job runs, per device.

    seq_len, micro_batch: s and b of one micro-batch. tp, dp: tensor- and data-parallel degrees.
    dtype: parameters, gradients and activations ("bf16" | "fp16" | "fp32").
    sequence_parallel: Megatron sequence parallelism (the tutorial's default).
    zero1: shard master weights and AdamW moments over dp (``Zero1Optimizer``).
    master_weights: keep fp32 master weights; None means yes unless the model is fp32 without
        ZeRO-1 (``Zero1Optimizer`` always keeps an fp32 slice, even of fp32 parameters).
    microbatches_in_flight: activations of how many micro-batches are alive at once: 1 without
        pipeline parallelism (gradient accumulation runs them one after another).
    bucket_cap_mb: ZeRO-1's bucket cap (``Zero1Optimizer(bucket_cap_mb=...)``): the largest
        collective of the optimizer step; None: one bucket for everything (no cap).
    accumulate_fp32: ZeRO-1 accumulates 16-bit gradients in fp32 buffers (4 bytes per
        parameter) and reduces them in fp32; None: on for bf16/fp16 with ZeRO-1, as the optimizer.
    """

    seq_len: int
    micro_batch: int = 1
    tp: int = 1
    dp: int = 1
    dtype: str = "bf16"
    sequence_parallel: bool = True
    zero1: bool = True
    master_weights: bool | None = None
    microbatches_in_flight: int = 1
    bucket_cap_mb: float | None = 128.0
    accumulate_fp32: bool | None = None

    def __post_init__(self) -> None:
        for name in ("seq_len", "micro_batch", "tp", "dp", "microbatches_in_flight"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype must be one of {tuple(DTYPE_BYTES)}, got {self.dtype!r}")
        if self.bucket_cap_mb is not None and not self.bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be None or > 0, got {self.bucket_cap_mb!r}")
        if self.zero1 and self.master_weights is False:
            raise ValueError("master_weights=False with zero1=True: Zero1Optimizer always keeps an fp32 master slice")

    @property
    def width(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def keeps_master_weights(self) -> bool:
        if self.master_weights is not None:
            return self.master_weights
        return self.zero1 or self.dtype != "fp32"

    @property
    def optimizer_shards(self) -> int:
        return self.dp if self.zero1 else 1

    @property
    def grad_width(self) -> int:
        """Bytes per gradient element: fp32 buffers when ZeRO-1 accumulates 16-bit gradients."""
        on = self.accumulate_fp32 if self.accumulate_fp32 is not None else self.width < _FP32
        return _FP32 if self.zero1 and on else self.width


# --------------------------------------------------------------------------------------------
# Per-layer recompute options: bytes kept, bytes alive again in backward, FLOPs rerun.


@dataclass(frozen=True)
class LayerOption:
    """One way to run one layer.

    name: "none", "selective" (core attention), "selective+mlp_act" (also SwiGLU's activation;
        Llama only) or "full".
    recompute: the per-layer :class:`RecomputeConfig` (``RecomputeConfig.preset(name)``).
    saved_bytes: activations the layer keeps for backward, per micro-batch, on one device.
    rematerialized_bytes: recomputed activations alive again while the layer's backward runs.
    recompute_flops: forward FLOPs rerun in backward, per micro-batch, on one device.
    """

    name: str
    recompute: RecomputeConfig
    saved_bytes: int
    rematerialized_bytes: int
    recompute_flops: float


OPTION_NAMES = PRESETS  # the per-layer options, in order of increasing recompute


def _local_heads(model: ModelShape, tp: int) -> tuple[int, int]:
    """(query heads, kv heads) on one rank; kv heads are replicated when fewer than tp."""
    return model.heads // tp, max(model.kv_heads // tp, 1)


def _layer_bytes(model: ModelShape, setup: TrainingSetup, mode: str) -> dict[str, int]:
    """Analytic terms of one layer, by name, for recompute ``mode`` ("none" | "selective" | "full")."""
    s, b, t = setup.seq_len, setup.micro_batch, setup.tp
    config = ActivationConfig(sequence_parallel=setup.sequence_parallel, recompute=mode)
    if model.kind == "llama":
        shape = LlamaLayerShape(s, b, model.hidden, model.heads, model.kv_heads, model.ffn, t, setup.width)
        terms = llama_layer_activation_terms(shape, config)
    else:
        shape = LayerShape(s, b, model.hidden, model.heads, t, setup.width)
        terms = layer_activation_terms(shape, config)
    return {term.name: term.nbytes for term in terms}


def _flops(model: ModelShape, setup: TrainingSetup) -> dict[str, float]:
    """Forward FLOPs of one layer's parts on one rank, per micro-batch."""
    s, b, t, h = setup.seq_len, setup.micro_batch, setup.tp, model.hidden
    a_loc, g_loc = _local_heads(model, t)
    d = model.head_dim
    scores = a_loc * s * s * b
    # QK^T and probs @ V over the whole s x s square (explicit attention computes all of it).
    core = 4.0 * scores * d + SOFTMAX_FLOPS * scores
    if model.kind == "llama":
        act = SWIGLU_FLOPS * s * b * model.ffn / t
        matmuls = 2.0 * s * b * h * ((2 * a_loc + 2 * g_loc) * d + 3 * model.ffn / t)
    else:
        act = GELU_FLOPS * s * b * model.ffn / t
        matmuls = 2.0 * s * b * 12 * h * h / t
    return {"core": core, "act": act, "layer": matmuls + core + act}


def layer_options(model: ModelShape, setup: TrainingSetup) -> dict[str, LayerOption]:
    """The recompute options for one layer of ``model`` run as ``setup`` says, by name."""
    if (why := model.valid_tp(setup.tp, setup.seq_len if setup.sequence_parallel else None)) is not None:
        raise ValueError(why)
    none = _layer_bytes(model, setup, "none")
    selective = _layer_bytes(model, setup, "selective")
    full = _layer_bytes(model, setup, "full")
    flops = _flops(model, setup)
    kept = {"none": sum(none.values()), "selective": sum(selective.values()), "full": sum(full.values())}
    costs = {"none": 0.0, "selective": flops["core"], "full": flops["layer"]}
    if model.kind == "llama":
        # The checkpointed SwiGLU keeps its inputs (gate, up: kept anyway) and not silu(gate).
        kept["selective+mlp_act"] = kept["selective"] - selective["silu_out"]
        costs["selective+mlp_act"] = flops["core"] + flops["act"]
    total_none = kept["none"]
    return {
        name: LayerOption(
            name, RecomputeConfig.preset(name), kept[name], total_none if name == "full" else total_none - kept[name], costs[name]
        )
        for name in OPTION_NAMES
        if name in kept
    }


# --------------------------------------------------------------------------------------------
# The budget.


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
    """Per-device memory of one training job, by line item; ``total_bytes`` is the peak estimate."""

    model: ModelShape
    setup: TrainingSetup
    layers: tuple[str, ...]  # the recompute option of each layer, in layer order
    items: tuple[LineItem, ...]
    notes: tuple[str, ...] = field(default=())

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
            "notes": list(self.notes),
        }


def local_parameters(model: ModelShape, tp: int) -> int:
    """Parameters held by one tensor-parallel rank (split weights' shard + replicated norms)."""
    h, d, v, f = model.hidden, model.head_dim, model.vocab, model.ffn
    a_loc, g_loc = _local_heads(model, tp)
    if model.kind == "llama":
        per_layer = h * (2 * a_loc + 2 * g_loc) * d + 3 * h * f // tp + 2 * h
        return model.layers * per_layer + 2 * v // tp * h + h  # embedding, LM head, final norm
    # GPT: QKV, projection, fc1, fc2 with biases (row biases replicated), two LayerNorms; tied head.
    per_layer = 4 * h * h // tp + 2 * h * f // tp + (3 * h + f) // tp + 2 * h + 4 * h
    return model.layers * per_layer + v // tp * h + 2 * h


def largest_collective_bytes(model: ModelShape, setup: TrainingSetup) -> int:
    """The optimizer step's largest collective operand on one rank: ZeRO-1 reduce-scatters the
    gradients (in ``grad_width``) and all-gathers the parameters bucket by bucket, so at most the
    bucket cap; without a cap (or without ZeRO-1: a DP all-reduce of every gradient) all of them."""
    n = local_parameters(model, setup.tp)
    whole = n * setup.grad_width
    if not setup.zero1 or setup.bucket_cap_mb is None:
        return whole
    return min(whole, int(setup.bucket_cap_mb * 2**20))


def optimizer_step_bytes(model: ModelShape, setup: TrainingSetup) -> int:
    """Device bytes the optimizer step allocates on top of the static ones (activations freed).

    ZeRO-1 keeps every bucket's reduce-scattered fp32 slice (``n/dp`` values) until the update,
    plus one bucket-sized collective buffer at a time (the flattened gradients going out, or the
    all-gathered parameters coming back; with fp32 accumulation the reduce-scatter reads the
    gradient buffer itself). Eager backends keep up to 4 buckets in flight: add 3 caps when
    planning for those. Unbucketed: the whole flattened gradient and its slice in the gradient
    dtype. Plain AdamW: about one fp32 temporary per parameter (foreach kernels).
    """
    n = local_parameters(model, setup.tp)
    if not setup.zero1:
        return n * _FP32
    per_shard = -(-n // setup.optimizer_shards)
    if setup.bucket_cap_mb is None:
        return n * setup.grad_width + per_shard * (setup.grad_width + _FP32)
    return per_shard * _FP32 + largest_collective_bytes(model, setup)


def _static_items(model: ModelShape, setup: TrainingSetup) -> tuple[list[LineItem], int]:
    n = local_parameters(model, setup.tp)
    shards = setup.optimizer_shards
    per_shard = -(-n // shards)  # ZeRO-1 pads the flat buffer to a multiple of dp
    where = f"/dp={shards} (ZeRO-1)" if setup.zero1 else "(not sharded)"
    fp32_grads = setup.grad_width != setup.width
    items = [
        LineItem("parameters", n * setup.width, "static", f"{n / 1e6:,.1f} M local parameters, {setup.dtype}"),
        LineItem("gradients", n * setup.grad_width, "static",
                 "fp32 accumulation buffers, full local size (ZeRO-1)" if fp32_grads
                 else f"{setup.dtype}, full local size (ZeRO-1 keeps them whole)"),
    ]
    if setup.keeps_master_weights:
        items.append(LineItem("master weights", per_shard * _FP32, "static", f"fp32 {where}"))
    items.append(LineItem("optimizer moments", 2 * per_shard * _FP32, "static",
                          f"AdamW exp_avg + exp_avg_sq, fp32 {where}"))
    s = setup.seq_len
    items.append(LineItem("attention mask", s * s * _BOOL, "static",
                          "explicit CoreAttention: one [s, s] bool mask shared by every layer"))
    return items, optimizer_step_bytes(model, setup)


def _outside_items(model: ModelShape, setup: TrainingSetup) -> tuple[list[LineItem], int]:
    """Activations outside the layers (per micro-batch), and the loss's transient bytes."""
    s, b, t, h, v, w = setup.seq_len, setup.micro_batch, setup.tp, model.hidden, model.vocab, setup.width
    sb = s * b
    sb_local = sb // t if setup.sequence_parallel else sb
    logits = sb * v // t  # elements of [s, b, v/t]
    if model.kind == "llama":
        shape = LlamaLayerShape(s, b, h, model.heads, model.kv_heads, model.ffn, t, w)
        rope = sum(term.nbytes for term in llama_outside_layer_terms(shape))
        # F.embedding keeps the (local) ids; at t > 1 the out-of-shard mask too.
        embed = sb * _INT64 + (sb * _BOOL if t > 1 else 0)
        # Final RMSNorm (fp32 input copy, fp32 rstd, normalised) and the LM head's input.
        final = sb_local * h * (_FP32 + w) + sb_local * _FP32 + sb_local * h * w
        items = [LineItem("act: embedding + rotary", embed + rope, "activations", "ids, shard mask, cos/sin tables")]
    else:
        # Paper section 4.3: embedding dropout mask; final LayerNorm input and stats; head input.
        items = [LineItem("act: embedding", sb_local * h, "activations", "dropout mask")]
        final = sb_local * h * w + 2 * sb_local * w + sb_local * h * w
    items.append(LineItem("act: final norm + LM head", final, "activations", "norm input/stats, LM head input"))
    # Vocab-parallel cross entropy: fp32 softmax [s, b, v/t], target index, two bool masks; the
    # mean's division keeps its int64 token count.
    loss = logits * _FP32 + sb * (_INT64 + 2 * _BOOL) + _INT64
    items.append(LineItem("act: loss", loss, "activations", "fp32 softmax [s, b, v/t] + targets"))
    # While it runs: the logits (w) and two fp32 temporaries (the cast, the shifted logits).
    transient = logits * (w + (_FP32 if w != _FP32 else 0) + _FP32)
    return items, transient


def _recompute_peak(order: Sequence[LayerOption]) -> int:
    """Largest ``(saved by layers 0..i) + rematerialized_i`` over the layers: backward runs from
    the last layer down, so layer i recomputes while the layers before it still hold theirs."""
    prefix, peak = 0, 0
    for option in order:
        prefix += option.saved_bytes
        if option.rematerialized_bytes:
            peak = max(peak, prefix + option.rematerialized_bytes)
    return peak


def canonical_order(counts: dict[str, int]) -> tuple[str, ...]:
    """Layer order that keeps the backward peak lowest for these counts: the layers with the most
    to rematerialize first (full, selective+mlp_act, selective), no recompute last."""
    return tuple(name for name in reversed(OPTION_NAMES) for _ in range(counts.get(name, 0)))


def memory_budget(
    model: ModelShape,
    setup: TrainingSetup,
    layers: str | Sequence[str] = "none",
    options: dict[str, LayerOption] | None = None,
) -> MemoryBudget:
    """The per-device budget with ``layers`` recompute: one option name for every layer, or one
    per layer (in layer order: it decides the backward peak, see :func:`canonical_order`)."""
    options = options if options is not None else layer_options(model, setup)
    names = (layers,) * model.layers if isinstance(layers, str) else tuple(layers)
    if len(names) != model.layers:
        raise ValueError(f"layers: need one option per layer ({model.layers}), got {len(names)}")
    for name in set(names):
        if name not in options:
            raise ValueError(f"layers: unknown option {name!r} for {model.kind}; choose from {list(options)}")
    static, step = _static_items(model, setup)
    outside, loss_transient = _outside_items(model, setup)
    m = setup.microbatches_in_flight
    items = list(static)
    for name in OPTION_NAMES:
        count = names.count(name)
        if count:
            per = options[name].saved_bytes
            items.append(LineItem(f"act: {count} layers x {name}", count * per * m, "activations",
                                  f"{per / 2**20:,.1f} MiB per layer"))
    items += [LineItem(i.name, i.nbytes * m, i.category, i.note) for i in outside]
    saved = sum(i.nbytes for i in items if i.category == "activations")
    order = [options[name] for name in names]
    # Recompute peak of the last micro-batch in flight; the others' activations stay alive.
    layer_saved = sum(o.saved_bytes for o in order)
    recompute = _recompute_peak(order) - layer_saved
    candidates = [
        (loss_transient, "loss: logits + fp32 temporaries of the cross entropy"),
        (recompute, "a recomputed layer's activations during its backward"),
        (step - saved, "optimizer step: fp32 gradient slices + one bucket buffer (activations freed)"),
    ]
    extra, why = max(candidates, key=lambda c: c[0])
    items.append(LineItem("peak workspace", max(extra, 0), "workspace", why))
    notes = [f"micro-batches in flight: {m} (1 without pipeline parallelism)"]
    return MemoryBudget(model, setup, names, tuple(items), tuple(notes))


# --------------------------------------------------------------------------------------------
# Compute.


def step_flops(model: ModelShape, setup: TrainingSetup) -> float:
    """Model FLOPs of one micro-batch's forward + backward on one device (``6N + 12LHQT`` per
    token, :func:`neuron_ckpt.models.flops_per_token`, over the ``s*b/t`` tokens per rank)."""
    s, b, t = setup.seq_len, setup.micro_batch, setup.tp
    if model.kind == "llama":
        config = SimpleNamespace(
            hidden_size=model.hidden, intermediate_size=model.ffn, vocab_size=model.vocab,
            num_attention_heads=model.heads, num_key_value_heads=model.kv_heads, num_hidden_layers=model.layers,
        )
        per_token = flops_per_token(config, s)
    else:
        n = model.layers * 12 * model.hidden**2 + model.vocab * model.hidden
        per_token = 6.0 * n + 12.0 * model.layers * model.hidden * s
    return per_token * s * b / t


__all__ = [
    "GIB", "KNOWN_MODELS", "LayerOption", "LineItem", "MemoryBudget", "ModelShape", "OPTION_NAMES",
    "TrainingSetup", "canonical_order", "largest_collective_bytes", "layer_options", "local_parameters",
    "memory_budget", "optimizer_step_bytes",
    "resolve_llama_config", "step_flops",
]
