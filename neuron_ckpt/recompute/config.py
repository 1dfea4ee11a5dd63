"""``RecomputeConfig``: which activations to recompute, in the words Megatron Bridge / NeMo users know.

=============================  ==========================================================
Megatron Bridge / NeMo         here
=============================  ==========================================================
``recompute_granularity``      ``granularity``: ``None``, ``"selective"`` or ``"full"``
``recompute_method``           ``method``: ``"uniform"`` or ``"block"`` (full only)
``recompute_num_layers``       ``num_layers`` (full only)
``recompute_modules``          ``modules`` (selective only; default ``["core_attn"]``)
``distribute_saved_activations``  ``distribute_saved_activations``
``offload_modules``            ``offload_modules`` (what those modules keep goes to host memory)
=============================  ==========================================================

Everything that can be checked from the config alone is checked at construction. The number of
layers in the model and whether it runs sequence parallel are only known when the config is
applied: :meth:`RecomputeConfig.validate` checks those, and :func:`~.apply.apply_recompute`
calls it before touching the model.

A model may also take one entry per layer (``list[RecomputeConfig | None]``, checked by
:func:`validate_per_layer`), so that different layers recompute differently.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

GRANULARITIES = (None, "selective", "full")
METHODS = ("uniform", "block")
DENSE_MODULES = ("core_attn", "mlp", "mlp_act", "norm")
# Megatron's names for mixture-of-experts layers and multi-latent attention (see .moe and .mla).
MOE_MODULES = ("moe", "moe_act", "shared_experts", "mla_up_proj")
MODULES = DENSE_MODULES + MOE_MODULES
# Megatron Bridge spells the norm "layernorm"; accept it and store the canonical name.
MODULE_ALIASES = {"layernorm": "norm"}
# What offload_modules takes: the selective names that are modules in every model, and "layer",
# everything a layer keeps (DeepSpeed's cpu_checkpointing under full recompute: its input).
# moe_act and mla_up_proj are a function inside a module (see .moe, .mla), not offloadable yet.
OFFLOAD_MODULES = ("layer", "core_attn", "mlp", "mlp_act", "norm", "moe", "shared_experts")


@dataclass(frozen=True)
class RecomputeConfig:
    """How much of each transformer layer's forward to recompute in backward instead of storing."""

    granularity: str | None = None
    """``None``: store every activation. ``"selective"``: recompute the submodules named in
    ``modules`` of every layer (core attention by default: the ``5as^2b`` term of Korthikanti et
    al. for a few percent of extra compute). ``"full"``: store only the input of each recomputed
    layer (or group of layers) and recompute all of it (about one extra forward pass)."""

    method: str | None = None
    """Full recompute only. ``"uniform"``: split the stack into consecutive groups of
    ``num_layers`` layers and run each group as one activation checkpoint (only the group's
    input is stored). ``"block"``: recompute the first ``num_layers`` layers one by one and run the
    rest normally (to recompute just enough layers to fit)."""

    num_layers: int | None = None
    """Full recompute only: the group size (``uniform``) or how many layers to recompute
    (``block``); at least 1 and at most the number of layers in the stack."""

    modules: tuple[str, ...] = ("core_attn",)
    """Selective recompute only: which submodules of each layer to recompute, out of
    ``"core_attn"`` (scores, softmax, dropout, weighted sum), ``"mlp"`` (the whole dense MLP),
    ``"mlp_act"`` (the dense MLP's activation function), ``"norm"`` (``"layernorm"`` is accepted
    too), and on mixture-of-experts and latent-attention layers ``"moe"`` (the whole MoE block,
    routing replayed), ``"moe_act"`` (the experts' activation), ``"shared_experts"`` and
    ``"mla_up_proj"`` (MLA's q/k/v up projections and RoPE). Which submodule each name means in
    a given model is set by ``module_map`` in :func:`~.apply.apply_recompute`; a name that some
    layers lack (``moe`` on a dense layer) skips them, one that no layer has is an error."""

    distribute_saved_activations: bool = False
    """Keep only this rank's 1/t slice of each activation checkpoint's (replicated) input and
    all-gather it over the tensor-parallel group before recomputing (Megatron's option). Not with
    sequence parallel (the input is already split) nor with ``use_reentrant=False``."""

    use_reentrant: bool | None = None
    """``None`` (default): the reentrant variant on XLA and with ``distribute_saved_activations``,
    the non-reentrant one everywhere else. ``True``: Megatron-style activation checkpoint (a custom
    autograd Function that reruns the whole forward in backward); works on every backend,
    including XLA. ``False``: ``torch.utils.checkpoint``'s non-reentrant variant, which stops the
    rerun once the last tensor backward needs is rebuilt (a Llama layer's down projection is never
    rerun) and supports ``torch.autograd.grad``; refused on XLA."""

    offload_modules: tuple[str, ...] = ()
    """Modules whose kept activations go to host memory in forward and come back in backward, copied
    beside the compute (docs/offload.md): each name of :data:`OFFLOAD_MODULES` offloads what that
    module keeps for backward (a recomputed module: its checkpoint's inputs), ``"layer"`` what the
    whole layer keeps (under full recompute: its input). One config for every layer leaves the
    last layer alone (backward needs it first); a per-layer list offloads what each entry says.
    A module inside a recomputed one (``mlp_act`` in a recomputed ``mlp``, anything but
    ``"layer"`` under full recompute) keeps nothing to offload and is refused."""

    def __post_init__(self) -> None:
        # Normalise ``modules`` (a list is fine as input; the frozen config stores a tuple).
        modules = self.modules
        if isinstance(modules, str):
            raise ValueError(f"modules must be a list of names from {list(MODULES)}, got the string {modules!r}")
        canonical = []
        for name in modules:
            name = MODULE_ALIASES.get(name, name)
            if name not in MODULES:
                raise ValueError(f"modules: unknown module {name!r}; known modules: {list(MODULES)}")
            if name not in canonical:
                canonical.append(name)
        object.__setattr__(self, "modules", tuple(canonical))
        object.__setattr__(self, "offload_modules", _offload_names(self.offload_modules))

        if self.granularity not in GRANULARITIES:
            raise ValueError(f"granularity must be one of {list(GRANULARITIES)}, got {self.granularity!r}")
        if self.method is not None and self.method not in METHODS:
            raise ValueError(f"method must be one of {list(METHODS)} (or None), got {self.method!r}")
        if self.num_layers is not None and (
            not isinstance(self.num_layers, int) or isinstance(self.num_layers, bool) or self.num_layers < 1
        ):
            raise ValueError(f"num_layers must be a positive int, got {self.num_layers!r}")
        if not isinstance(self.distribute_saved_activations, bool):
            raise ValueError(f"distribute_saved_activations must be a bool, got {self.distribute_saved_activations!r}")
        if self.use_reentrant is not None and not isinstance(self.use_reentrant, bool):
            raise ValueError(f"use_reentrant must be None, True or False, got {self.use_reentrant!r}")

        if self.granularity == "full":
            if self.method is None:
                raise ValueError(f"granularity='full' needs method, one of {list(METHODS)}")
            if self.num_layers is None:
                raise ValueError("granularity='full' needs num_layers, a positive int (layers per group or recomputed)")
        elif self.granularity == "selective":
            if self.num_layers is not None:
                raise ValueError(
                    f"num_layers={self.num_layers} is only used with granularity='full'; "
                    "selective recompute applies to every layer: leave num_layers=None"
                )
            if self.method is not None:
                raise ValueError(
                    f"method={self.method!r} is only used with granularity='full'; leave method=None for selective"
                )
            if not self.modules:
                raise ValueError(f"granularity='selective' needs at least one module in modules, from {list(MODULES)}")
        else:
            for name in ("method", "num_layers"):
                if getattr(self, name) is not None:
                    raise ValueError(
                        f"{name}={getattr(self, name)!r} is set but granularity is None (no recompute); "
                        "set granularity='full' or leave it unset"
                    )
            if self.distribute_saved_activations:
                raise ValueError(
                    "distribute_saved_activations=True needs recompute: set granularity to 'selective' or 'full'"
                )
        if self.granularity == "full" and set(self.offload_modules) - {"layer"}:
            raise ValueError(
                f"offload_modules={list(self.offload_modules)} with granularity='full': a recomputed layer keeps "
                "only its input, so only 'layer' (that input) can be offloaded"
            )
        if self.offload_modules and self.granularity == "full" and self.method == "uniform" and self.num_layers != 1:
            raise ValueError(
                f"offload_modules with method='uniform' and num_layers={self.num_layers}: offload needs one layer "
                "per activation checkpoint (num_layers=1, or method='block')"
            )
        if self.distribute_saved_activations and self.use_reentrant is False:
            raise ValueError(
                "distribute_saved_activations=True needs use_reentrant=True (the non-reentrant "
                "torch.utils.checkpoint keeps the full input alive)"
            )

    @classmethod
    def preset(cls, name: str, distribute_saved_activations: bool = False) -> RecomputeConfig:
        """The config of a layer that recomputes as ``name`` (one of :data:`PRESETS`).

        ``"none"``: nothing (``RecomputeConfig()``). ``"selective"``: core attention.
        ``"selective+mlp_act"``: core attention, and SwiGLU's output discarded.
        ``"selective+mlp_act+norm"``: the leanest selective layer: also both norms' outputs
        discarded (output-discarding recompute, :mod:`.discard`). ``"full"``: the whole
        layer, one layer per activation checkpoint (``method="uniform", num_layers=1``), so it
        fits any stack and any per-layer list. ``distribute_saved_activations`` applies to the
        recomputing presets only.
        """
        if name not in PRESETS:
            raise ValueError(f"recompute must be one of {list(PRESETS)}, got {name!r}")
        if name == "none":
            return cls()
        distribute = distribute_saved_activations
        if name == "full":
            return cls(granularity="full", method="uniform", num_layers=1, distribute_saved_activations=distribute)
        return cls(granularity="selective", modules=_PRESET_MODULES[name], distribute_saved_activations=distribute)

    @property
    def preset_name(self) -> str | None:
        """The :data:`PRESETS` name this config equals (ignoring ``distribute_saved_activations``
        and ``use_reentrant``), or None for a config no preset describes (grouped or block full
        recompute, other module sets)."""
        plain = RecomputeConfig(self.granularity, self.method, self.num_layers, self.modules)
        return next((name for name in PRESETS if RecomputeConfig.preset(name) == plain), None)

    @property
    def enabled(self) -> bool:
        """Whether anything is recomputed (offload alone is not recompute)."""
        return self.granularity is not None

    def validate(self, num_layers_in_model: int, sequence_parallel: bool = False) -> None:
        """The checks that need the model: call before any training work (apply does)."""
        if not isinstance(num_layers_in_model, int) or num_layers_in_model < 1:
            raise ValueError(f"num_layers_in_model must be a positive int, got {num_layers_in_model!r}")
        if self.granularity == "full" and self.num_layers is not None and self.num_layers > num_layers_in_model:
            raise ValueError(
                f"num_layers={self.num_layers} is larger than the {num_layers_in_model} layers of the "
                f"stack; choose 1..{num_layers_in_model}"
            )
        if self.distribute_saved_activations and sequence_parallel:
            raise ValueError(
                "distribute_saved_activations=True cannot be used with sequence_parallel=True: the "
                "saved input is already split over the tensor-parallel group"
            )
        from ..distributed.runtime import is_xla

        if self.offload_modules and is_xla():
            raise ValueError(
                "offload_modules is not supported on XLA (trn1): XLA has no streams to copy beside the compute, "
                "and Neuron does not support host placement of activations; leave offload_modules empty"
            )
        if self.use_reentrant is False and self.enabled:
            if is_xla():
                raise ValueError(
                    "use_reentrant=False is not supported on XLA (torch_xla's checkpoint is reentrant "
                    "only); use use_reentrant=True or leave it None"
                )


def _offload_names(names) -> tuple[str, ...]:
    if isinstance(names, str):
        raise ValueError(
            f"offload_modules must be a list of names from {list(OFFLOAD_MODULES)}, got the string {names!r}"
        )
    canonical: list[str] = []
    for name in names:
        name = MODULE_ALIASES.get(name, name)
        if name in MODULES and name not in OFFLOAD_MODULES:
            raise ValueError(
                f"offload_modules: {name!r} is a function inside a module, not offloadable; offload the module "
                f"that holds it ('moe' for moe_act) or 'layer'; offloadable: {list(OFFLOAD_MODULES)}"
            )
        if name not in OFFLOAD_MODULES:
            raise ValueError(f"offload_modules: unknown module {name!r}; offloadable modules: {list(OFFLOAD_MODULES)}")
        if name not in canonical:
            canonical.append(name)
    if "layer" in canonical and len(canonical) > 1:
        raise ValueError(
            f"offload_modules={canonical}: 'layer' offloads everything the layer keeps already; list it alone"
        )
    return tuple(canonical)


def validate_per_layer(
    configs: Sequence[RecomputeConfig | None], num_layers_in_model: int, sequence_parallel: bool = False
) -> None:
    """Check a per-layer recompute list: one entry per layer, each ``None`` (no recompute), a
    selective config, or a full config that covers exactly its own layer (``num_layers=1``).

    This is the form :mod:`neuron_ckpt.memory.planner` produces when the best plan mixes
    options (say 20 layers with no recompute and 12 selective); grouped ``uniform`` recompute
    spans several layers and so cannot be an entry.
    """
    if len(configs) != num_layers_in_model:
        raise ValueError(
            f"recompute: a per-layer list needs one entry per layer: got {len(configs)} entries for a "
            f"stack of {num_layers_in_model} layers"
        )
    for i, config in enumerate(configs):
        if config is None:
            continue
        if not isinstance(config, RecomputeConfig):
            raise TypeError(f"recompute[{i}] must be a RecomputeConfig or None, got {type(config).__name__}")
        if config.granularity == "full" and config.num_layers != 1:
            raise ValueError(
                f"recompute[{i}]: in a per-layer list a full-recompute entry covers its own layer only: "
                f"use num_layers=1, got num_layers={config.num_layers}"
            )
        config.validate(1, sequence_parallel)


PRESETS = ("none", "selective", "selective+mlp_act", "selective+mlp_act+norm", "full")
"""The recompute choices by name, in order of increasing recompute: the words of the memory
model, the budget and planner, ``neuron-ckpt memory`` / ``plan``, the plots and the tutorial's
``--recompute``. :meth:`RecomputeConfig.preset` turns a name into the config of one layer."""

_PRESET_MODULES = {
    "selective": ("core_attn",),
    "selective+mlp_act": ("core_attn", "mlp_act"),
    "selective+mlp_act+norm": ("core_attn", "mlp_act", "norm"),
}
