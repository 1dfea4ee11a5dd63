"""What one transformers decoder layer keeps for backward, under each recompute choice.

A decoder layer (``*DecoderLayer.forward``) is ``x + attn(norm1(x))``, then ``r + mlp(norm2(r))``
with ``mlp`` a dense MLP or an MoE block (Gemma2 also normalises each region's output before its
residual add); the residual adds keep nothing. :func:`layer_tensors` writes it storage by storage
(:mod:`.norms`, :mod:`.attention`, :mod:`.mla`, :mod:`.routers`, :mod:`.experts`, :mod:`.mlp`)
with its recompute units, and :func:`layer_memory` applies the rule of :mod:`.rules` to a
recompute choice:

=================  ============================================================================
choice             what it is on a transformers model (``apply_recompute``)
=================  ============================================================================
``none``           nothing recomputed
``core_attn``      the attention function checkpointed: keeps q, k, v as it receives them
``norm``           the layer's RMSNorms (two; Gemma2's four) output-discarding: keep their inputs
``mlp``            the dense MLP checkpointed (dense layers only): keeps its input
``mlp_act``        the dense MLP's activation output-discarding (dense layers only)
``moe``            the whole MoE block checkpointed, routing replayed: keeps its input, and the
                   replay's recorded indices outside autograd
``moe_act``        the experts' SwiGLU (``_apply_gate``) output-discarding: frees ``act(gate)``
                   and the product (grouped_mm, the eager loop, GPT-OSS; Llama 4: ``act_fn``'s
                   output only, its own ``bmm`` forward writes the product inline)
``shared_experts`` the shared experts checkpointed: keep their input
``mla_up_proj``    DeepSeek-V3's MLA up projections, RoPE and concat output-discarding: keep the latents
                   and ``kv_a_proj``'s output (k_rot is a slice of it); q, k, v become notes
``full``           the whole layer checkpointed: keeps its input (and, on an MoE layer, the
                   replay's indices)
=================  ============================================================================

Under sequence parallel the layer's input, the norms and the residual hold s/t tokens and each
region's entry is one more output-discarding unit, on under every choice (:mod:`.sequence`).

A selective choice may name several modules (``("core_attn", "mla_up_proj", "norm")``); a
module a layer does not have changes nothing there, as ``apply_recompute`` skips it.

The storages' places are the layer's ops in forward order, with their FLOPs, so the same rule also
gives what each choice reruns in backward (:meth:`~.rules.LayerTensors.rerun`,
:attr:`LayerMemory.rerun`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from ...recompute import RecomputeConfig
from ..rerun import ADD, Flops
from ..terms import ActivationTerm
from . import experts as mlp
from .attention import gqa, mla
from .families import FAMILY
from .norms import rms_norm
from .rules import LayerTensors
from .sequence import always_on, enter_region
from .shape import MoESetup, MoEShape

MODULES = ("core_attn", "norm", "mlp", "mlp_act", "moe", "moe_act", "shared_experts", "mla_up_proj")
CHOICES = ("none", *MODULES, "full")
KINDS = ("dense", "moe")
Recompute = str | Iterable[str] | RecomputeConfig


def layer_tensors(shape: MoEShape, setup: MoESetup, kind: str) -> LayerTensors:
    """A ``kind`` layer's storages without recompute, and its units (``kind``: ``"dense"`` or
    ``"moe"``, with the attention variant after a ``/``: ``"dense/sliding"``)."""
    family = FAMILY[shape.family]
    mlp_kind, _, variant = kind.partition("/")
    h, w, norm = shape.hidden, setup.width, family.norm
    T, sp = setup.local_tokens, setup.sequence_parallel  # the token-wise parts' rows: T/t under sequence parallel
    layer = LayerTensors()
    x = layer.save("layer_input", w * T * h, sp)
    n1 = rms_norm(layer, "norm1", x, T * h, T, w, sp, norm)
    x1 = enter_region(layer, "attn", n1, h, setup)
    (mla if shape.mla is not None else gqa)(layer, shape, setup, x1, variant or "full")
    layer.unit("norm", ["norm1"], [x], discards=[n1])
    if family.sandwich:  # Gemma2's post_attention_layernorm, on the attention's output
        _sandwich_norm(layer, "norm_attn_out", "attn.out", setup, h, norm)
    layer.op("residual1", elementwise=ADD * T * h)
    r = layer.save("residual", w * T * h, sp)  # the next norm's input: x + attention
    n2 = rms_norm(layer, "norm2", r, T * h, T, w, sp, norm)
    x2 = enter_region(layer, "mlp", n2, h, setup)
    layer.unit("norm", ["norm2"], [r], discards=[n2])
    if mlp_kind == "dense":
        mlp.dense_mlp(layer, shape, setup, x2)
        outside: tuple[ActivationTerm, ...] = ()
    else:  # in forward order: Qwen2 runs its shared expert first and gates it after the routed experts
        gated = family.shared == "gated"
        if gated:
            mlp.shared_experts(layer, shape, setup, x2)
        mlp.router(layer, shape, setup, x2)
        mlp.experts(layer, shape, setup)
        if gated:
            mlp.shared_gate(layer, shape, setup, x2)
        elif shape.shared_ffn:
            mlp.shared_experts(layer, shape, setup, x2)
        outside = mlp.replay_indices(shape, setup)
        layer.unit("moe", ["mlp"], [x2], outside=outside)
    if family.sandwich:  # and its post_feedforward_layernorm, on the MLP's output
        _sandwich_norm(layer, "norm_mlp_out", "mlp.out", setup, h, norm)
    layer.op("residual2", elementwise=ADD * T * h)
    layer.unit("full", [""], [x], outside=outside)
    return layer


def _sandwich_norm(layer: LayerTensors, place: str, source: str, setup: MoESetup, h: int, norm: str) -> None:
    """A norm on a region's output (this rank's s/t tokens of it under sequence parallel); its
    output goes to the residual add, which keeps nothing."""
    T, sp, w = setup.local_tokens, setup.sequence_parallel, setup.width
    out = layer.save(source, w * T * h, sp)
    normed = rms_norm(layer, place, out, T * h, T, w, sp, norm)
    layer.unit("norm", [place], [out], discards=[normed])


def modules_of(recompute: Recompute) -> tuple[str, ...]:
    """The modules a recompute choice names (``("full",)`` for full recompute; ``()`` for none):
    a name of :data:`CHOICES`, several module names joined by ``+`` or in a list, or a
    :class:`RecomputeConfig` (selective, or full one layer per checkpoint)."""
    if isinstance(recompute, RecomputeConfig):
        if recompute.distribute_saved_activations:
            raise ValueError("distribute_saved_activations is not modelled for transformers MoE layers")
        if recompute.granularity == "full" and (recompute.method, recompute.num_layers) != ("uniform", 1):
            raise ValueError(
                "recompute: full recompute is priced one layer per checkpoint (uniform, num_layers=1) "
                f"for MoE layers, got {recompute.method} {recompute.num_layers}"
            )
        return {None: (), "full": ("full",)}.get(recompute.granularity, recompute.modules)
    names = recompute.split("+") if isinstance(recompute, str) else list(recompute)
    if names in (["none"], []):
        return ()
    for name in names:
        if name not in CHOICES or name == "none" or (name == "full" and len(names) > 1):
            raise ValueError(
                f"recompute: {name!r} is not one of {list(CHOICES)} (several modules: "
                "'core_attn+norm' or a list; 'none' and 'full' alone)"
            )
    return tuple(dict.fromkeys(names))


def check(shape: MoEShape, setup: MoESetup, kind: str) -> None:
    """A ``ValueError`` naming the field when the model, the job and ``kind`` do not fit together."""
    if kind not in shape.kinds:
        raise ValueError(f"kind: {shape.name or shape.family} has layers of kinds {list(shape.kinds)}, got {kind!r}")
    why = shape.valid_tp(setup.tp)
    if why is not None:
        raise ValueError(why)
    if setup.ep > 1:
        check_ep(shape, setup)


def check_ep(shape: MoEShape, setup: MoESetup) -> None:
    """Expert parallelism as ``apply_tensor_parallel`` allows it: a family with an ``ep_plan``,
    ``ep`` dividing the experts, and no more rows received than routing can send."""
    e, name = setup.ep, shape.name or shape.family
    if FAMILY[shape.family].experts in (None, "all"):
        raise ValueError(f"ep: {name} has no expert-parallel plan (no routed experts to dispatch), got ep={e}")
    if shape.experts % e:
        allowed = [d for d in range(1, shape.experts + 1) if shape.experts % d == 0]
        raise ValueError(f"ep ({e}) must divide experts ({shape.experts}); allowed: {allowed}")
    worst = e * setup.dispatched_tokens * min(shape.top_k, shape.experts // e)
    if not isinstance(setup.ep_rows, str) and setup.ep_rows > worst:
        raise ValueError(
            f"ep_rows ({setup.ep_rows}) is more than this rank's experts can receive: {worst} "
            f"(e T' min(k, E/e) = {e} x {setup.dispatched_tokens} x {min(shape.top_k, shape.experts // e)})"
        )


@dataclass(frozen=True)
class LayerMemory:
    """What one layer of ``kind`` keeps on one rank under ``modules``: ``terms`` (autograd's
    saved storages, forward order) and ``outside`` (held outside autograd: the routing replay);
    and ``rerun``, the forward FLOPs its backward reruns (matmul and elementwise, per micro-batch
    on one rank: :meth:`~.rules.LayerTensors.rerun`)."""

    kind: str
    modules: tuple[str, ...]
    terms: tuple[ActivationTerm, ...]
    outside: tuple[ActivationTerm, ...]
    rerun: Flops = Flops()

    @property
    def autograd_bytes(self) -> int:
        """What ``SavedTensorRecorder`` measures."""
        return sum(t.nbytes for t in self.terms)

    @property
    def nbytes(self) -> int:
        """Everything the layer holds for its backward."""
        return self.autograd_bytes + sum(t.nbytes for t in self.outside)

    @property
    def label(self) -> str:
        return "+".join(self.modules) or "none"


def layer_memory(
    shape: MoEShape, setup: MoESetup, recompute: Recompute = "none", kind: str | None = None
) -> LayerMemory:
    """One ``kind`` layer's memory on one rank under ``recompute`` (``kind`` None: the last layer's)."""
    kind = shape.kind_of(shape.layers - 1) if kind is None else kind
    check(shape, setup, kind)
    modules = modules_of(recompute)
    layer = layer_tensors(shape, setup, kind)
    terms, outside = layer.kept(modules + always_on(setup))
    return LayerMemory(kind, modules, tuple(terms), tuple(outside), layer.rerun(modules + always_on(setup)))


def applies(shape: MoEShape, kind: str, module: str) -> bool:
    """Whether ``module`` recomputes anything in a ``kind`` layer of ``shape`` (as
    ``apply_recompute`` finds it: ``mlp`` and ``mlp_act`` are the dense MLP's, ``moe`` and
    ``moe_act`` the MoE block's, ``shared_experts`` where there are some, ``mla_up_proj``
    DeepSeek-V3's MLA, the one latent attention it mirrors)."""
    dense = kind.partition("/")[0] == "dense"
    if module in ("none", "full", "core_attn", "norm"):
        return True
    if module in ("mlp", "mlp_act"):
        return dense
    if module == "mla_up_proj":
        return shape.family == "deepseek_v3"
    return not dense and (module != "shared_experts" or shape.shared_ffn > 0)


def module_table(shape: MoEShape, setup: MoESetup) -> dict[str, dict[str, LayerMemory | None]]:
    """Each layer kind the model has, under each of :data:`CHOICES` (None where the module does
    not apply to that kind)."""
    return {
        kind: {c: layer_memory(shape, setup, c, kind) if applies(shape, kind, c) else None for c in CHOICES}
        for kind in shape.kinds
    }


def model_bytes(shape: MoEShape, setup: MoESetup, recompute: Recompute = "none") -> int:
    """What the ``shape.layers`` layers hold for backward together (every layer under
    ``recompute``; the terms shared by the stack, the rotary tables, are left out)."""
    return sum(shape.count(kind) * layer_memory(shape, setup, recompute, kind).nbytes for kind in shape.kinds)


__all__ = [
    "CHOICES",
    "KINDS",
    "LayerMemory",
    "MODULES",
    "applies",
    "layer_memory",
    "layer_tensors",
    "model_bytes",
    "module_table",
    "modules_of",
]
