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
rerun; ``.backward()`` only, once-differentiable) and ``use_reentrant=False``
(``torch.utils.checkpoint`` non-reentrant running the function through our RNG replay; works with
``torch.autograd.grad``, double backward, repeated backward and nesting). Both give identical
gradients. What each variant supports is tabled in docs/recompute.md and tested pattern by
pattern in tests/test_checkpoint_patterns.py. The
non-reentrant rerun stops as soon as the last tensor backward needs is rebuilt: autograd saves a
matmul's input, not its output, so a layer that ends in a projection (a Llama layer's down
projection, an attention output projection) never reruns that matmul, about a fifth of a Llama
layer's forward FLOPs. The default (``use_reentrant=None``) is therefore the non-reentrant
variant, and the reentrant one where only it works: on XLA and with
``distribute_saved_activations``.

Arguments: positional and keyword arguments pass through unchanged, in any structure torch's
pytree knows (tuples, lists, dicts; ``None`` and Python scalars anywhere); tensors among them
receive gradients. Outputs may be a tensor or any such structure (non-tensor items pass through).
With grad disabled (evaluation), ``function`` simply runs. Under ``torch.compile`` the call is
torch's non-reentrant checkpoint, which dynamo traces into the graph (see :func:`_torch_checkpoint`).
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch._dynamo  # imported here on purpose: see the comment below the imports
from torch.utils import _pytree as pytree

from ..distributed import collectives as C
from ..distributed import runtime
from ..distributed.parallel_state import Group, get_parallel_state, model_parallel_is_initialized
from ..distributed.random import RNGState, TrackerSnapshot, get_rng_state, get_rng_tracker, set_rng_state

# Dynamo is imported with this module, which users import before they create process groups.
# torch's checkpoint imports it lazily, at the first recompute; with torch 2.13, when that first
# import comes after the process groups exist, the WORLD group outlives destroy_process_group()
# and gloo can abort the interpreter at exit (tests/test_teardown.py launches that script 8 times).


# True while a checkpointed function runs (its forward or its rerun): output-discarding recompute
# (.discard) is off there, since the enclosing checkpoint keeps nothing of it already.
_INSIDE: contextvars.ContextVar[bool] = contextvars.ContextVar("neuron_ckpt_inside_checkpoint", default=False)


# The open output-discarding block (.discard builds on this module, so the variable lives here):
# None outside one, "off" where discarding is off, else the block, whose holds(t) says whether t
# is an output it discards.
DISCARD_SCOPE: contextvars.ContextVar[Any] = contextvars.ContextVar("neuron_ckpt_discard_scope", default=None)


def inside_checkpoint() -> bool:
    """Whether a function run by :func:`checkpoint` is running (its forward or its recompute)."""
    return _INSIDE.get()


@contextlib.contextmanager
def _inside():
    token = _INSIDE.set(True)
    try:
        yield
    finally:
        _INSIDE.reset(token)


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
    if torch.compiler.is_compiling():
        return _torch_checkpoint(function, args, kwargs)
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
        return _torch_checkpoint(function, args, kwargs)
    group = _distributed_group() if distribute_saved_activations else None
    return _reentrant(function, _fenced_modules(function, fence), group, args, kwargs)


# --------------------------------------------------------------------------------------------
# State captured in forward and replayed in backward.


@dataclass
class _RNGSnapshot:
    """Every generator the function may draw from: CPU, device and the tracker's named streams
    (with the forks open at that moment)."""

    generators: RNGState
    streams: TrackerSnapshot

    @staticmethod
    def take() -> _RNGSnapshot:
        return _RNGSnapshot(get_rng_state(), get_rng_tracker().snapshot())

    def restore(self) -> None:
        set_rng_state(self.generators)
        get_rng_tracker().restore(self.streams)


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


def _distributed_group() -> Group | None:
    if not model_parallel_is_initialized():
        return None
    tp = get_parallel_state().tp
    return tp if tp.size > 1 else None


def _keep_slice(x: torch.Tensor, group: Group) -> torch.Tensor:
    flat = x.detach().reshape(-1)
    per_rank = -(-flat.numel() // group.size)
    pad = per_rank * group.size - flat.numel()
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    # A copy, so the full input's storage is freed once nothing else holds it.
    return flat[group.rank * per_rank : (group.rank + 1) * per_rank].clone()


def _discarded(t: torch.Tensor) -> bool:
    """An output the open output-discarding block drops (:mod:`.discard`): the ops that keep it
    keep a note, so a slice of it would be kept for nothing."""
    scope = DISCARD_SCOPE.get()
    return hasattr(scope, "holds") and scope.holds(t)


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
# The non-reentrant variant: torch's checkpoint, running the function through our RNG replay.


class _Rerun:
    """``function`` as torch's non-reentrant checkpoint calls it: the first call (the forward)
    snapshots every generator and tracker stream, each later call (a recompute, once per backward
    that needs it: ``retain_graph`` backwards, double backward, an enclosing checkpoint's rerun)
    replays from that snapshot and restores the surrounding state after.

    A callable object rather than torch's ``context_fn``: ``context_fn`` is called once per
    checkpoint but its recompute context is entered once per recompute, and under
    ``torch.compile`` it must be a dispatch mode. While dynamo traces the call this is plain
    ``function`` (the compiled graph keeps random ops' outputs, so there is nothing to replay).
    When the function cannot be traced (it forks a tracker stream: dynamo does not trace
    generator states), dynamo runs torch's checkpoint eagerly instead, and the replay here keeps
    the recomputed dropout masks those of the forward.
    """

    def __init__(self, function: Callable[..., Any]):
        self.function = function
        self.rng: _RNGSnapshot | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            return self.function(*args, **kwargs)
        if self.rng is None:
            self.rng = _RNGSnapshot.take()
            with _inside():
                return self.function(*args, **kwargs)
        with _replaying(self.rng), _inside():
            return self.function(*args, **kwargs)


def _torch_checkpoint(function: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    # torch's preserve_rng_state is off: the snapshot in _Rerun covers CPU, device and streams.
    return torch.utils.checkpoint.checkpoint(
        _Rerun(function), *args, use_reentrant=False, preserve_rng_state=False, **kwargs
    )


# --------------------------------------------------------------------------------------------
# The reentrant variant: a custom autograd Function (Megatron's and torch_xla's kind).

_NO_GRAD_API = (
    "the reentrant checkpoint supports .backward() only, not torch.autograd.grad or "
    "backward(inputs=...); use use_reentrant=False (RecomputeConfig(use_reentrant=False)), which is "
    "the default off XLA"
)
_NO_DOUBLE_BACKWARD = (
    "the reentrant checkpoint is once-differentiable: backward(create_graph=True) through it would "
    "give wrong second derivatives; use use_reentrant=False (the default off XLA; XLA has no "
    "variant that supports double backward)"
)


@dataclass
class _Tree:
    """A pytree with its tensors taken out: ``fill`` puts tensors back in their places."""

    leaves: list[Any]  # the leaves, None where a tensor was
    is_tensor: list[bool]
    spec: pytree.TreeSpec

    @staticmethod
    def split(tree: Any) -> tuple[list[torch.Tensor], _Tree]:
        leaves, spec = pytree.tree_flatten(tree)
        is_tensor = [torch.is_tensor(v) for v in leaves]
        tensors = [v for v, t in zip(leaves, is_tensor) if t]
        return tensors, _Tree([None if t else v for v, t in zip(leaves, is_tensor)], is_tensor, spec)

    def fill(self, tensors: Iterable[torch.Tensor]) -> Any:
        it = iter(tensors)
        return pytree.tree_unflatten([next(it) if t else v for v, t in zip(self.leaves, self.is_tensor)], self.spec)


@dataclass
class _Call:
    """One reentrant call: the function, its ``(args, kwargs)`` and outputs without their tensors,
    and the options."""

    function: Callable[..., Any]
    modules: list[torch.nn.Module]
    inputs: _Tree  # (args, kwargs)
    distributed: tuple[int, Group] | None  # (index among the tensors, TP group)
    anchor: bool
    outputs: _Tree | None = None  # set by the forward


def _reentrant(function, modules, group, args: tuple, kwargs: dict) -> Any:
    tensors, inputs = _Tree.split((args, kwargs))
    # Distribute the first positional tensor (the layer input) over the TP group.
    positional = any(torch.is_tensor(v) for v in pytree.tree_leaves(args))
    distributed = (0, group) if group is not None and positional else None
    anchor = not any(t.requires_grad for t in tensors)
    if anchor:
        # A Function whose inputs need no grad produces outputs that need none, and the
        # parameters inside would silently get no gradient: anchor it to a dummy leaf.
        tensors.append(torch.empty(0, requires_grad=True))
    call = _Call(function, modules, inputs, distributed, anchor)
    outputs = _CheckpointFunction.apply(call, *tensors)
    assert call.outputs is not None  # the forward set them
    return call.outputs.fill(outputs)


class _CheckpointFunction(torch.autograd.Function):
    """Reentrant checkpoint: forward under no_grad, recompute and backpropagate inside backward."""

    @staticmethod
    def forward(ctx, call: _Call, *tensors):
        ctx.call = call
        ctx.rng = _RNGSnapshot.take()
        ctx.autocast = _autocast_state(tensors)
        ctx.autocast_cache = torch.is_autocast_cache_enabled()
        inputs = list(tensors[:-1] if call.anchor else tensors)
        args, kwargs = call.inputs.fill(inputs)
        with torch.no_grad(), _inside():
            outputs, call.outputs = _Tree.split(call.function(*args, **kwargs))
        if not outputs:
            raise TypeError("checkpoint: the function returned no tensor; there is nothing to backpropagate")
        ctx.input_needs_grad = [t.requires_grad for t in inputs]
        ctx.shape = None
        if call.distributed is not None and not _discarded(inputs[call.distributed[0]]):
            k, group = call.distributed
            ctx.shape = inputs[k].shape
            inputs[k] = _keep_slice(inputs[k], group)
        ctx.save_for_backward(*inputs)
        return tuple(outputs)

    @staticmethod
    def backward(ctx, *grads):
        if not torch.autograd._is_checkpoint_valid():
            raise RuntimeError(_NO_GRAD_API)
        if torch.is_grad_enabled():  # the engine enables grad in backward only for create_graph=True
            raise RuntimeError(_NO_DOUBLE_BACKWARD)
        call = ctx.call
        inputs = list(ctx.saved_tensors)
        if ctx.shape is not None:
            k, group = call.distributed
            inputs[k] = _gather_slices(inputs[k], ctx.shape, group)
        if runtime.is_xla():
            _xla_barrier(inputs + list(grads), call.modules)
        inputs = [t.detach().requires_grad_(r) for t, r in zip(inputs, ctx.input_needs_grad)]
        args, kwargs = call.inputs.fill(inputs)
        with _replaying(ctx.rng), torch.enable_grad(), _autocast(ctx.autocast, ctx.autocast_cache), _inside():
            outputs = [v for v in pytree.tree_leaves(call.function(*args, **kwargs)) if torch.is_tensor(v)]
        pairs = [(o, g) for o, g in zip(outputs, grads) if o.requires_grad and g is not None]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        input_grads = [t.grad if r else None for t, r in zip(inputs, ctx.input_needs_grad)]
        return (None, *input_grads, *([None] if call.anchor else []))
