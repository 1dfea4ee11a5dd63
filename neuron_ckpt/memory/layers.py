"""Build a stack of real layers from a :class:`~.spec.LayerSpec` and measure what it keeps.

:func:`measure_layers` runs on every rank of an initialised torch.distributed world (a
``LocalWorld`` / ``run_local`` worker, or a torchrun process): it sets up tensor parallelism of
``spec.tp``, builds ``spec.layers`` GPT or Llama layers with recompute applied, runs one forward
under :class:`~.measure.SavedTensorRecorder` (one scope per layer) and returns this rank's bytes.
Left out: parameters, the attention modules' shared causal masks and (Llama) the rotary tables,
which all layers share (:func:`~.analytic.llama_outside_layer_terms` accounts for them).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from ..distributed import initialize_model_parallel, model_parallel_manual_seed
from ..parallel import CoreAttention
from ..recompute import RecomputeConfig, apply_recompute, run_layers
from .measure import SavedTensorRecorder
from .spec import LayerSpec

LAYER_SCOPE = "layer{}"


@dataclass(frozen=True)
class LayerMeasurement:
    """What one rank's layers kept for backward.

    per_layer_bytes: kept bytes attributed to each layer (distinct storages, first saver wins).
    unscoped_bytes: kept bytes saved outside any layer (0 for these stacks).
    storages: ``(scope, dtype, shape, nbytes)`` of every kept storage, largest first.
    """

    rank: int
    per_layer_bytes: list[int]
    unscoped_bytes: int
    storages: list[tuple[str, str, tuple[int, ...], int]]

    @property
    def bytes_per_layer(self) -> float:
        return sum(self.per_layer_bytes) / len(self.per_layer_bytes)

    def to_dict(self) -> dict:
        return asdict(self)


def recompute_config(spec: LayerSpec) -> RecomputeConfig:
    """The :class:`RecomputeConfig` that realises ``spec.recompute`` (one layer per checkpoint)."""
    return RecomputeConfig.preset(spec.recompute, spec.distribute_saved_activations)


def llama_args(spec: LayerSpec):
    """The :class:`~neuron_ckpt.models.LlamaArgs` of the measured layers (no vocabulary: one layer
    does not read it)."""
    from ..models.llama_args import LlamaArgs

    return LlamaArgs(
        vocab_size=1, hidden_size=spec.hidden, intermediate_size=spec.resolved_ffn, num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads, num_key_value_heads=spec.resolved_kv_heads,
    )


def build_layers(spec: LayerSpec) -> tuple[torch.nn.ModuleList, tuple[torch.Tensor, ...]]:
    """``spec.layers`` layers with recompute applied, and the extra arguments each layer takes."""
    state = initialize_model_parallel(spec.tp)
    dtype = spec.torch_dtype
    if spec.model == "gpt":
        from ..models.gpt import GPTConfig, GPTLayer

        config = GPTConfig(spec.hidden, spec.heads, sequence_parallel=spec.sequence_parallel, dtype=dtype)
        layers = torch.nn.ModuleList(GPTLayer(config, state) for _ in range(spec.layers))
        extra: tuple[torch.Tensor, ...] = ()
    else:
        from ..models.llama import LlamaDecoderLayer, LlamaOptions
        from ..models.rotary import RotaryEmbedding

        args, options = llama_args(spec), LlamaOptions(spec.sequence_parallel, "explicit", dtype, state)
        layers = torch.nn.ModuleList(LlamaDecoderLayer(args, options) for _ in range(spec.layers))
        extra = RotaryEmbedding(args)(spec.seq_len, dtype, torch.device("cpu"))
    recompute = recompute_config(spec)
    if recompute.enabled:
        apply_recompute(layers, recompute, sequence_parallel=spec.sequence_parallel)
    return layers.train(), extra


def layer_input(spec: LayerSpec, tp_rank: int, seed: int = 0) -> torch.Tensor:
    """The ``[s, b, h]`` hidden states (this rank's ``[s/t, b, h]`` chunk under sequence parallel)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(spec.seq_len, spec.micro_batch, spec.hidden, generator=g).to(spec.torch_dtype)
    if spec.sequence_parallel:
        x = x.chunk(spec.tp, dim=0)[tp_rank].clone()  # its own storage, not a view of the whole
    return x.requires_grad_()


def measure_layers(spec: LayerSpec, seed: int = 0, backward: bool = True) -> LayerMeasurement:
    """Forward ``spec.layers`` layers once on this rank and count what they keep for backward.

    ``backward``: also run backward afterwards (proves the recomputed stack still trains; the
    counts are taken before it).
    """
    layers, extra = build_layers(spec)
    model_parallel_manual_seed(seed)
    state = initialize_model_parallel(spec.tp)
    x = layer_input(spec, state.tp_rank, seed)
    shared = [m.causal_mask(spec.seq_len, x.device) for m in layers.modules() if isinstance(m, CoreAttention)]
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
    if backward:
        out.float().square().mean().backward()
    return LayerMeasurement(state.tp_rank, per_layer, sum(by_scope.values()), storages)


def measure_on_ranks(specs: list[LayerSpec], seed: int = 0, backward: bool = False) -> list[LayerMeasurement]:
    """:func:`measure_layers` for several specs of one TP degree in one worker call."""
    return [measure_layers(spec, seed, backward) for spec in specs]
