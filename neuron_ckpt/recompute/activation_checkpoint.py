"""The activation checkpoint function: ``checkpoint(function, *args, fence=(), **kwargs)`` runs
``function`` without keeping its activations and reruns it in backward.

(Here "activation checkpoint" is the autograd technique; the files a training run saves are
called checkpoints everywhere else in this library.)

What it adds to ``torch.utils.checkpoint``:

* **Exact RNG replay.** The forward snapshots the CPU generator, the device generator (CUDA or
  XLA) and every named stream of the :func:`~neuron_ckpt.get_rng_tracker` tracker (the
  model-parallel stream that dropout on tensor-parallel shards draws from); the recompute runs
  from that snapshot and the surrounding state is restored afterwards. Recomputed dropout masks
  are therefore bit-identical. ``torch.utils.checkpoint``'s ``preserve_rng_state`` covers only
  the CPU and CUDA generators, not tracker streams; neuronx-distributed's covers only the CPU.
* **Distributed saved input** (``distribute_saved_activations=True``, reentrant only): of the
  first positional tensor argument (the layer input, replicated over the TP group) each rank
  keeps a 1/t slice of the flattened tensor and all-gathers it before recomputing, as Megatron
  does. Saves ``(1 - 1/t)`` of that input per activation checkpoint for one all-gather in
  backward.
* **XLA-safe.** On XLA the saved inputs, incoming gradients and the parameters and buffers of
  the *fenced* modules pass through ``optimization_barrier_`` before the recompute (as
  ``torch_xla.utils.checkpoint`` does); without it the compiler sees the recompute as a copy of
  the forward, merges the two (common-subexpression elimination) and keeps every activation
  alive, so nothing is saved. The fenced modules are ``function`` itself when it is an
  ``nn.Module`` or a bound method of one, and every module in ``fence`` (pass the modules whose
  parameters a plain function or a ``functools.partial`` reads). Non-reentrant checkpointing is
  refused on XLA.

Two variants: ``use_reentrant=True`` (a custom autograd Function, Megatron-style, any backend:
the forward runs under no_grad, the backward reruns all of it and backpropagates through the
rerun) and ``use_reentrant=False`` (``torch.utils.checkpoint`` non-reentrant with our RNG replay
through ``context_fn``; works with ``torch.autograd.grad``). Both give identical gradients. The
non-reentrant rerun stops as soon as the last tensor backward needs is rebuilt: autograd saves a
matmul's input, not its output, so a layer that ends in a projection (a Llama layer's down
projection, an attention output projection) never reruns that matmul, about a fifth of a Llama
layer's forward FLOPs. The default (``use_reentrant=None``) is therefore the non-reentrant
variant, and the reentrant one where only it works: on XLA and with
``distribute_saved_activations``.

Arguments: positional and keyword arguments pass through unchanged; tensors among them (also
keyword ones) receive gradients. Outputs may be a tensor or a tuple (non-tensor items pass
through). With grad disabled (evaluation), ``function`` simply runs.
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import torch

from ..distributed import collectives as C
from ..distributed import runtime
from ..distributed.parallel_state import Group, get_parallel_state, model_parallel_is_initialized
from ..distributed.random import get_rng_state, get_rng_tracker, set_rng_state
from ..parallel.attention import CoreAttention


def checkpoint(
    function: Callable[..., Any],
    *args: Any,
    fence: Sequence[torch.nn.Module] | torch.nn.Module = (),
    use_reentrant: bool | None = None,
    distribute_saved_activations: bool = False,
    **kwargs: Any,
) -> Any:
    """``function(*args, **kwargs)``, keeping only its inputs for backward and recomputing the rest.

    ``fence``: the modules whose parameters and buffers pass the XLA optimization barrier with the
    saved inputs (a module or a sequence of them), besides ``function`` itself when it is an
    ``nn.Module`` or a bound method of one; ignored off XLA. ``use_reentrant``: ``None`` picks the
    reentrant variant on XLA or with ``distribute_saved_activations``, the non-reentrant one
    otherwise (see the module docstring). ``fence``, ``use_reentrant`` and
    ``distribute_saved_activations`` are this function's own options; every other keyword goes
    to ``function``.
    """
    if not torch.is_grad_enabled():
        return function(*args, **kwargs)
    options = (fence, use_reentrant, distribute_saved_activations)
    if torch.compiler.is_compiling():
        if _forks_rng_stream(_fenced_modules(function, fence)):
            return _outside_graph(function, args, *options, kwargs)
        return _compiled(function, args, kwargs)
    return _eager_checkpoint(function, args, *options, kwargs)


def _eager_checkpoint(
    function: Callable[..., Any],
    args: tuple,
    fence: Sequence[torch.nn.Module] | torch.nn.Module,
    use_reentrant: bool | None,
    distribute_saved_activations: bool,
    kwargs: dict,
) -> Any:
    if use_reentrant is None:
        use_reentrant = distribute_saved_activations or runtime.is_xla()
    if not use_reentrant:
        if runtime.is_xla():
            raise ValueError(
                "checkpoint(use_reentrant=False) is not supported on XLA (torch_xla's checkpoint is "
                "reentrant only); use use_reentrant=True"
            )
        if distribute_saved_activations:
            raise ValueError("distribute_saved_activations=True needs use_reentrant=True")
        return _non_reentrant(function, args, kwargs)
    modules = _fenced_modules(function, fence)
    spec = _Spec.of(args, kwargs, _distributed_group() if distribute_saved_activations else None)
    flat = list(args) + [kwargs[k] for k in spec.kwarg_names]
    if not any(torch.is_tensor(a) and a.requires_grad for a in flat):
        # A reentrant Function whose inputs need no grad produces outputs that need none, and the
        # parameters inside would silently get no gradient: anchor it to a dummy leaf.
        spec.anchor = True
        flat.append(torch.empty(0, requires_grad=True))
    return _CheckpointFunction.apply(function, modules, spec, *flat)


# --------------------------------------------------------------------------------------------
# State captured in forward and replayed in backward.


@dataclass
class _Spec:
    """How the flat ``apply`` arguments map back to ``(args, kwargs)``."""

    num_args: int
    kwarg_names: tuple[str, ...]
    group: Group | None  # set: distribute the first positional tensor over this group
    anchor: bool = False

    @staticmethod
    def of(args: tuple, kwargs: dict, group: Group | None) -> "_Spec":
        return _Spec(len(args), tuple(kwargs), group)

    def unflatten(self, flat: list) -> tuple[list, dict]:
        n = self.num_args
        return flat[:n], dict(zip(self.kwarg_names, flat[n : n + len(self.kwarg_names)]))


def _distributed_group() -> Group | None:
    if not model_parallel_is_initialized():
        return None
    tp = get_parallel_state().tp
    return tp if tp.size > 1 else None


@dataclass
class _RNGSnapshot:
    """Every generator the function may draw from: CPU, device and the tracker's named streams."""

    generators: Any
    streams: dict

    @staticmethod
    def take() -> "_RNGSnapshot":
        return _RNGSnapshot(get_rng_state(), get_rng_tracker().get_states())

    def restore(self) -> None:
        set_rng_state(self.generators)
        get_rng_tracker().set_states(self.streams)


@contextlib.contextmanager
def _replaying(snapshot: _RNGSnapshot):
    """Run a block from ``snapshot``; put the surrounding RNG state back afterwards."""
    outer = _RNGSnapshot.take()
    snapshot.restore()
    try:
        yield
    finally:
        outer.restore()


def _autocast_state(tensors: Iterable[Any]) -> list[tuple[str, bool, torch.dtype]]:
    kinds = {"cpu"} | {t.device.type for t in tensors if torch.is_tensor(t)}
    return [(k, torch.is_autocast_enabled(k), torch.get_autocast_dtype(k)) for k in sorted(kinds)]


def _autocast(state: list[tuple[str, bool, torch.dtype]], cache_enabled: bool) -> contextlib.ExitStack:
    stack = contextlib.ExitStack()
    for kind, enabled, dtype in state:
        stack.enter_context(torch.autocast(device_type=kind, enabled=enabled, dtype=dtype, cache_enabled=cache_enabled))
    return stack


# --------------------------------------------------------------------------------------------
# Distributed saved input: keep a 1/t slice of the flattened tensor, all-gather it back.


def _keep_slice(x: torch.Tensor, group: Group) -> torch.Tensor:
    flat = x.detach().reshape(-1)
    per_rank = -(-flat.numel() // group.size)
    pad = per_rank * group.size - flat.numel()
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    # A copy, so the full input's storage is freed once nothing else holds it.
    return flat[group.rank * per_rank : (group.rank + 1) * per_rank].clone()


def _gather_slices(piece: torch.Tensor, shape: torch.Size, group: Group) -> torch.Tensor:
    full = C.all_gather(piece, 0, group)
    return full[: shape.numel()].view(shape)


# --------------------------------------------------------------------------------------------
# XLA: an optimization barrier keeps the compiler from merging recompute and forward.


def _fenced_modules(function: Any, fence: Sequence[torch.nn.Module] | torch.nn.Module) -> list[torch.nn.Module]:
    """``function``'s own module (when it is a module or a bound method of one), then ``fence``."""
    owner = function.__self__ if inspect.ismethod(function) else function
    modules = [owner] if isinstance(owner, torch.nn.Module) else []
    for module in [fence] if isinstance(fence, torch.nn.Module) else fence:
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"checkpoint: fence must hold nn.Modules, got {type(module).__name__}")
        if all(module is not m for m in modules):
            modules.append(module)
    return modules


def _xla_barrier(tensors: list[Any], modules: list[torch.nn.Module]) -> None:
    import torch_xla.core.xla_model as xm

    params = [p for m in modules for p in (*m.parameters(), *m.buffers())]
    xm.optimization_barrier_([t for t in (*tensors, *params) if torch.is_tensor(t)])


# --------------------------------------------------------------------------------------------
# The two variants.


class _CheckpointFunction(torch.autograd.Function):
    """Reentrant checkpoint: forward under no_grad, recompute and backpropagate inside backward."""

    @staticmethod
    def forward(ctx, function, modules: list[torch.nn.Module], spec: _Spec, *flat):
        ctx.function, ctx.modules, ctx.spec = function, modules, spec
        ctx.rng = _RNGSnapshot.take()
        ctx.autocast = _autocast_state(flat)
        ctx.autocast_cache = torch.is_autocast_cache_enabled()
        values = list(flat[:-1] if spec.anchor else flat)
        args, kwargs = spec.unflatten(values)
        with torch.no_grad():
            outputs = function(*args, **kwargs)

        # Save tensors through save_for_backward, keep the rest in ctx.
        ctx.slots = [None if torch.is_tensor(v) else v for v in values]
        tensors = [v for v in values if torch.is_tensor(v)]
        ctx.input_needs_grad = [t.requires_grad for t in tensors]
        ctx.distributed = None
        if spec.group is not None:
            first = next((i for i, v in enumerate(values[: spec.num_args]) if torch.is_tensor(v)), None)
            if first is not None:
                k = sum(torch.is_tensor(v) for v in values[:first])
                ctx.distributed = (k, tensors[k].shape)
                tensors[k] = _keep_slice(tensors[k], spec.group)
        ctx.save_for_backward(*tensors)
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        if not torch.autograd._is_checkpoint_valid():
            raise RuntimeError(
                "reentrant checkpoint works with .backward() only (not torch.autograd.grad or "
                "backward(inputs=...)); use RecomputeConfig(use_reentrant=False) for those"
            )
        tensors = list(ctx.saved_tensors)
        if ctx.distributed is not None:
            k, shape = ctx.distributed
            tensors[k] = _gather_slices(tensors[k], shape, ctx.spec.group)
        if runtime.is_xla():
            _xla_barrier(tensors + list(grads), ctx.modules)
        it = iter(t.detach().requires_grad_(r) for t, r in zip(tensors, ctx.input_needs_grad))
        values = [next(it) if slot is None else slot for slot in ctx.slots]
        args, kwargs = ctx.spec.unflatten(values)
        with _replaying(ctx.rng), torch.enable_grad(), _autocast(ctx.autocast, ctx.autocast_cache):
            outputs = ctx.function(*args, **kwargs)
        outputs = (outputs,) if torch.is_tensor(outputs) else tuple(outputs)
        pairs = [
            (o, g)
            for o, g in zip(outputs, grads)
            if torch.is_tensor(o) and o.requires_grad and g is not None
        ]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        input_grads = [v.grad if torch.is_tensor(v) and v.requires_grad else None for v in values]
        if ctx.spec.anchor:
            input_grads.append(None)
        return (None, None, None, *input_grads)


def _forks_rng_stream(modules: list[torch.nn.Module]) -> bool:
    """Whether ``modules`` draw dropout from a tracker stream: a :class:`CoreAttention` with
    ``attention_dropout > 0`` in training (the one layer of ours that forks the model-parallel
    stream inside a recomputed region).

    The tracker's fork reads and writes generator states, which dynamo cannot trace: such a
    region is a graph break under ``torch.compile``, and torch's checkpoint would then run it
    eagerly without replaying the tracker streams (a different mask in recompute). It runs
    through our own checkpoint instead, outside the graph, with exact replay.
    """
    return any(
        isinstance(m, CoreAttention) and m.training and m.attention_dropout > 0
        for module in modules
        for m in module.modules()
    )


@torch.compiler.disable
def _outside_graph(*args: Any) -> Any:
    """:func:`_eager_checkpoint` run eagerly from compiled code (one graph break)."""
    return _eager_checkpoint(*args)


def _compiled(function: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    # Under torch.compile the RNG snapshot is a graph break (dynamo does not trace
    # torch.get_rng_state) and a reentrant Function cannot run its forward's graph again in
    # backward. torch's non-reentrant checkpoint is what dynamo traces instead: a higher-order op
    # whose region AOT autograd's partitioner recomputes in the backward graph, so the whole
    # function stays one graph. Random ops are never recomputed there (the partitioner keeps
    # their outputs), so a recomputed dropout mask is the forward's by construction.
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, **kwargs)


def _non_reentrant(function: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    snapshot = _RNGSnapshot.take()
    # torch's own preserve_rng_state is off: our snapshot covers CPU, device and tracker streams.
    return torch.utils.checkpoint.checkpoint(
        function,
        *args,
        use_reentrant=False,
        preserve_rng_state=False,
        context_fn=lambda: (contextlib.nullcontext(), _replaying(snapshot)),
        **kwargs,
    )
