"""Build a stack of real layers for a :class:`~.shape.ModelShape` and measure what it keeps.

:func:`measure_layers` runs on every rank of an initialised torch.distributed world (a
``LocalWorld`` / ``run_local`` worker, or a torchrun process): it sets up tensor parallelism of
``setup.tp``, builds ``num_layers`` GPT or Llama layers with the recompute applied (a preset name
or any ``RecomputeConfig`` the memory model prices: :func:`~.analytic.resolve`), runs
one forward under :class:`~.measure.SavedTensorRecorder` (one scope per layer) and returns this
rank's bytes. Left out: parameters, the explicit attention's shared causal masks and (Llama) the
rotary tables, which all layers share (:func:`~.analytic.rotary_terms` accounts for them).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

import torch

from ..distributed import initialize_model_parallel, model_parallel_manual_seed
from ..parallel import CoreAttention
from ..parallel import context_parallel as cp_split
from ..parallel.context_parallel import chunk_mask
from ..recompute import apply_recompute, run_layers
from ..recompute.module import unwrapped
from ..recompute.offload import offload_stats
from .analytic import Recompute, resolve
from .measure import SavedTensorRecorder
from .shape import ModelShape, TrainingSetup

LAYER_SCOPE = "layer{}"
MEASURED_LAYERS = 2  # per-layer figures do not depend on the count; two show they are equal
TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
Case = tuple[ModelShape, TrainingSetup, Recompute]


@dataclass(frozen=True)
class LayerMeasurement:
    """What one rank's layers kept for backward.

    per_layer_bytes: kept bytes attributed to each layer (distinct storages, first saver wins).
    unscoped_bytes: kept bytes saved outside any layer (0 for these stacks).
    storages: ``(scope, dtype, shape, nbytes)`` of every kept storage, largest first.
    offloaded_per_layer: bytes each layer copied to host (``offload_stats``), with ``offload_modules``;
    the recorder sees only what stays on the device (``per_layer_bytes``).
    """

    rank: int
    per_layer_bytes: list[int]
    unscoped_bytes: int
    storages: list[tuple[str, str, tuple[int, ...], int]]
    offloaded_per_layer: list[int] = field(default_factory=list)

    @property
    def bytes_per_layer(self) -> float:
        return sum(self.per_layer_bytes) / len(self.per_layer_bytes)

    def to_dict(self) -> dict:
        return asdict(self)


def build_layers(
    model: ModelShape, setup: TrainingSetup, recompute: Recompute, num_layers: int = MEASURED_LAYERS
) -> tuple[torch.nn.ModuleList, tuple[torch.Tensor, ...]]:
    """``num_layers`` layers with recompute applied, and the extra arguments each layer takes.
    Checked first as the analytic model checks them (a ``ValueError`` naming the field), for a
    model of ``num_layers`` layers (grouped full recompute needs enough of them)."""
    chosen = resolve(replace(model, layers=num_layers), setup, recompute).config
    state = initialize_model_parallel(setup.tp, context_parallel_size=setup.cp)
    dtype = TORCH_DTYPES[setup.dtype]
    if model.kind == "gpt":
        from ..models.gpt import GPTConfig, GPTLayer

        config = GPTConfig(model.hidden, model.heads, sequence_parallel=setup.sequence_parallel, dtype=dtype)
        layers = torch.nn.ModuleList(GPTLayer(config, state) for _ in range(num_layers))
        extra: tuple[torch.Tensor, ...] = ()
    else:
        from ..models.llama import LlamaDecoderLayer, LlamaOptions
        from ..models.llama_args import LlamaArgs
        from ..models.rotary import RotaryEmbedding

        args = LlamaArgs(
            vocab_size=model.vocab, hidden_size=model.hidden, intermediate_size=model.ffn,
            num_hidden_layers=num_layers, num_attention_heads=model.heads, num_key_value_heads=model.kv_heads,
            head_dim=model.head_dim, max_position_embeddings=setup.seq_len, attention_bias=model.attention_bias,
            mlp_bias=model.mlp_bias,
        )  # fmt: skip
        options = LlamaOptions(setup.sequence_parallel, setup.attention, dtype, state)
        layers = torch.nn.ModuleList(LlamaDecoderLayer(args, options) for _ in range(num_layers))
        positions = None
        if state.cp is not None:  # this CP rank's global positions (parallel.context_parallel)
            positions = cp_split.positions(setup.seq_len, state.cp_size, state.cp_rank)
        extra = RotaryEmbedding(args)(setup.seq_len, dtype, torch.device("cpu"), positions)
    if chosen.enabled or chosen.offload_modules:
        apply_recompute(layers, chosen, sequence_parallel=setup.sequence_parallel)
    return layers.train(), extra


def layer_input(model: ModelShape, setup: TrainingSetup, tp_rank: int, seed: int = 0, cp_rank: int = 0) -> torch.Tensor:
    """The ``[s, b, h]`` hidden states: this CP rank's ``s/c`` tokens (its two chunks), and of
    those this TP rank's ``1/t`` under sequence parallel."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(setup.seq_len, setup.micro_batch, model.hidden, generator=g).to(TORCH_DTYPES[setup.dtype])
    if setup.cp > 1:
        x = x.index_select(0, cp_split.positions(setup.seq_len, setup.cp, cp_rank))
    if setup.sequence_parallel:
        x = x.chunk(setup.tp, dim=0)[tp_rank].clone()  # its own storage, not a view of the whole
    return x.requires_grad_()


def measure_layers(
    model: ModelShape,
    setup: TrainingSetup,
    recompute: Recompute,
    num_layers: int = MEASURED_LAYERS,
    seed: int = 0,
    backward: bool = True,
) -> LayerMeasurement:
    """Forward ``num_layers`` layers once on this rank and count what they keep for backward.

    ``backward``: also run backward afterwards (proves the recomputed stack still trains; the
    counts are taken before it).
    """
    layers, extra = build_layers(model, setup, recompute, num_layers)
    model_parallel_manual_seed(seed)
    state = initialize_model_parallel(setup.tp, context_parallel_size=setup.cp)
    x = layer_input(model, setup, state.tp_rank, seed, state.cp_rank)
    offloading = bool(resolve(replace(model, layers=num_layers), setup, recompute).config.offload_modules)
    if offloading:  # a model's first layer takes the embedding's output, which offload copies; it leaves leaves alone
        x = x.clone()
    shared = [
        m.causal_mask(setup.seq_len, x.device)
        for m in map(unwrapped, layers.modules())
        if isinstance(m, CoreAttention) and m.implementation == "explicit" and setup.cp == 1
    ]
    if setup.cp > 1:  # the [L, s] chunk mask every chunk and layer shares (a per-model term)
        n = setup.seq_len // (2 * setup.cp)
        mask_dtype = torch.bool if setup.attention == "explicit" else TORCH_DTYPES[setup.dtype]
        shared.append(chunk_mask(n, setup.seq_len, setup.seq_len, mask_dtype, x.device))
    with SavedTensorRecorder(exclude_modules=[layers], exclude_tensors=[*shared, *extra]) as rec:
        handles = rec.attach({LAYER_SCOPE.format(i): layer for i, layer in enumerate(layers)})
        try:
            out = run_layers(layers, x, *extra)
        finally:
            for handle in handles:
                handle.remove()
    by_scope = rec.bytes_by_scope()
    per_layer = [by_scope.pop(LAYER_SCOPE.format(i), 0) for i in range(len(layers))]
    storages = sorted(
        ((s.scope, str(s.dtype).removeprefix("torch."), s.shape, s.nbytes) for s in rec.storages),
        key=lambda row: -row[3],
    )
    offloaded = [0] * len(layers)
    if offloading:
        for unit, nbytes in offload_stats(layers).bytes.items():  # "3.mlp", "3": by layer index
            offloaded[int(unit.split(".")[0])] += nbytes
    if backward:
        out.float().square().mean().backward()
    return LayerMeasurement(state.tp_rank, per_layer, sum(by_scope.values()), storages, offloaded)


def measure_on_ranks(
    cases: list[Case], num_layers: int = MEASURED_LAYERS, seed: int = 0, backward: bool = False
) -> list[LayerMeasurement]:
    """:func:`measure_layers` for several ``(model, setup, recompute)`` cases of one TP degree in
    one worker call."""
    return [measure_layers(*case, num_layers=num_layers, seed=seed, backward=backward) for case in cases]
