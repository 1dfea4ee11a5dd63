"""Real transformers layers for a :class:`~.shape.MoEShape`, and what autograd keeps of each.

:func:`~.hf_config.hf_config` writes the shape as the family's transformers config (no download);
:func:`build_model` builds the ``*ForCausalLM`` with ``AutoModelForCausalLM.from_config`` in the
setup's dtype (DeepSeek's router weight and bias stay fp32, as ``from_pretrained`` keeps them),
the setup's attention and experts implementations, split over the tensor-parallel group when
``setup.tp > 1`` or it runs sequence parallel (``apply_tensor_parallel``: call it on every rank of
an initialised world) and with a recompute choice applied (``apply_recompute``).
:func:`measure_layers` runs the base model's own forward from the embedding's output on (so
sequence parallel splits the first layer's input and gathers the final norm's output where
training does) under :class:`~neuron_ckpt.memory.SavedTensorRecorder`, one scope per decoder
layer and one for the final norm. Left out, as shared by every layer (a per-model term):
parameters, the rotary tables, the position ids, the masks the forward hands the layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...recompute import RecomputeConfig, apply_recompute
from ..measure import SavedTensorRecorder
from .families import FAMILY
from .hf_config import hf_config
from .layer import Recompute, modules_of
from .shape import MoESetup, MoEShape

TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
LAYER_SCOPE = "layer{}"


def recompute_config(recompute: Recompute) -> RecomputeConfig | None:
    """The :class:`RecomputeConfig` ``apply_recompute`` takes for a choice (None: none)."""
    if isinstance(recompute, RecomputeConfig):
        return recompute
    modules = modules_of(recompute)
    if not modules:
        return None
    if modules == ("full",):
        return RecomputeConfig.preset("full")
    return RecomputeConfig(granularity="selective", modules=list(modules))  # type: ignore[arg-type]  # a list is fine: stored as a tuple


def build_model(
    shape: MoEShape,
    setup: MoESetup,
    recompute: Recompute = "none",
    layers: int | None = None,
    vocab: int | None = None,
    seed: int = 0,
):
    """The ``*ForCausalLM`` of ``shape`` (``layers`` of them), split over TP and recomputing as told."""
    import transformers

    torch.manual_seed(seed)
    config = hf_config(shape, setup, layers, vocab)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=TORCH_DTYPES[setup.dtype])
    if FAMILY[shape.family].experts not in (None, "all"):  # Llama 4's experts have their own forward
        model.set_experts_implementation(setup.experts)
    model.train()
    if setup.tp > 1 or setup.sequence_parallel or setup.ep > 1:
        from ...parallel.experts import ExpertDispatch
        from ...parallel.hf import apply_tensor_parallel

        dispatch = ExpertDispatch(setup.ep_dispatch, setup.capacity_factor) if setup.ep > 1 else None
        model = apply_tensor_parallel(model, sequence_parallel=setup.sequence_parallel, expert_dispatch=dispatch)
    config = recompute_config(recompute)
    if config is not None:
        apply_recompute(model, config)
    return model


@dataclass(frozen=True)
class Measured:
    """What one rank's layers kept: bytes per layer, and each kept storage
    ``(scope, dtype, shape, nbytes)``, largest first."""

    per_layer_bytes: list[int]
    unscoped_bytes: int
    storages: list[tuple[str, str, tuple[int, ...], int]]


FINAL_NORM_SCOPE = "final_norm"


def _hooks(layer) -> list:
    return [m.__dict__["_expert_parallel"] for m in layer.modules() if "_expert_parallel" in m.__dict__]


def received_rows(model) -> list[int | None]:
    """Per decoder layer, the rows this rank's experts received in the model's last forward under
    expert parallelism (the all-gather form: its slots; None: a layer with no dispatched experts)."""
    return [hooks[0].received if hooks else None for hooks in map(_hooks, model.model.layers)]


def dropped_routes(model) -> list[int | None]:
    """Per decoder layer, the routes this rank's experts dropped in the model's last forward (the
    all-gather form at a capacity; None: a layer with no dispatched experts)."""
    return [int(hooks[0].dropped) if hooks else None for hooks in map(_hooks, model.model.layers)]


def layer_inputs(model, setup: MoESetup, seed: int = 0):
    """``(x, position ids)``: the embedding's output the base model is run from, and its positions."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(setup.micro_batch, setup.seq_len, model.model.config.hidden_size, generator=g)
    return x.to(TORCH_DTYPES[setup.dtype]).requires_grad_(), torch.arange(setup.seq_len).unsqueeze(0)


def _tensors(value) -> list[torch.Tensor]:
    if torch.is_tensor(value):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    return []


def measure_layers(model, setup: MoESetup, seed: int = 0, backward: bool = True) -> Measured:
    """Run ``model``'s decoder layers once on this rank and count what each keeps for backward.

    Through the base model's forward, not layer by layer: it makes each layer's mask (full,
    sliding, chunked) and rotary tables as training does, sequence parallel learns the whole
    length from that forward's call (a fully recomputed first layer would split its input twice
    without it) and gathers after the final norm (counted apart, in its own scope)."""
    x, position_ids = layer_inputs(model, setup, seed)
    inner = model.model
    layers = list(inner.layers)
    scopes = {LAYER_SCOPE.format(i): layer for i, layer in enumerate(layers)} | {FINAL_NORM_SCOPE: inner.norm}
    rec = SavedTensorRecorder(exclude_modules=[model], exclude_tensors=[position_ids])

    # What the forward hands every layer (its masks, the rotary tables, the positions) is shared
    # by the stack, not a layer's: left out, also where a checkpoint keeps it as an input.
    def shared(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        rec.exclude(t for value in kwargs.values() for t in _tensors(value))

    handles = [layer.register_forward_pre_hook(shared, with_kwargs=True) for layer in layers]
    try:
        with rec:
            handles += rec.attach(scopes)
            hidden = inner(inputs_embeds=x, position_ids=position_ids).last_hidden_state
    finally:
        for handle in handles:
            handle.remove()
    by_scope = rec.bytes_by_scope()
    per_layer = [by_scope.pop(LAYER_SCOPE.format(i), 0) for i in range(len(layers))]
    by_scope.pop(FINAL_NORM_SCOPE, None)
    storages = sorted(
        ((s.scope, str(s.dtype).removeprefix("torch."), s.shape, s.nbytes) for s in rec.storages),
        key=lambda row: -row[3],
    )
    if backward:
        hidden.float().square().mean().backward()
    return Measured(per_layer, sum(by_scope.values()), storages)


__all__ = [
    "Measured", "build_model", "dropped_routes", "hf_config", "layer_inputs", "measure_layers", "received_rows",
    "recompute_config",
]  # fmt: skip
