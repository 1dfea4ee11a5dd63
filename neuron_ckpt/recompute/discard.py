"""Output-discarding recompute: ``checkpoint_without_output(function, *args)`` inside a
``discard_outputs()`` block runs ``function`` keeping nothing, and the ops after it that would keep
its output keep nothing of it either; backward recomputes the output from ``function``'s inputs
at the moment one of them needs it.

Why: an ordinary activation checkpoint around a norm or an activation function saves almost
nothing, because the next op keeps the output anyway (a projection keeps its input for its weight
gradient). Megatron-Core's ``CheckpointWithoutOutput`` (``layernorm``, ``moe_act``, ``mla_up_proj``)
frees the output's storage after the next module has saved it and refills it in backward; this is
the same trade, on every backend::

    with discard_outputs():
        h = checkpoint_without_output(self.norm, x)   # keeps x, nothing of the norm
        q = self.q_proj(h)                            # keeps no copy of h: backward recomputes it

How: ``discard_outputs()`` installs saved-tensor hooks for its block. A tensor an op saves inside
the block that is an output of ``checkpoint_without_output`` (or a view of one) is packed as a
note instead of the tensor. When backward unpacks the note, ``function`` reruns on its kept
inputs (RNG replayed; on XLA its inputs pass an optimization barrier first, so the compiler cannot
merge the rerun with the forward) and the note is answered with the recomputed output, viewed as
it was saved. The rerun keeps its graph until ``function``'s own backward has used it, so each
backward recomputes once however many ops kept the output. Every other tensor saved in the block
goes to the hooks that were active outside it (a ``SavedTensorRecorder``, ``save_on_cpu``, ...),
as if the block had none of its own; ``function``'s inputs are kept through those hooks too.

Correct whatever else reads the output: an op that reads it in the forward (a residual add) reads
the real tensor; one that keeps it outside the block keeps the real tensor (then nothing is
saved, and nothing is wrong); one that keeps it after it was written in place keeps the real
tensor too (the rerun would give the value before the write). Gradients are bit-identical to
running ``function`` plainly: the rerun computes the same values (same ops, same RNG draws).

Where it turns itself off and ``function`` runs plainly: without grad; inside an activation
checkpoint's forward or rerun (the enclosing checkpoint keeps nothing of the block already);
under ``torch.compile``, where the call is torch's checkpoint, which the compiler's partitioner
recomputes wherever a later op needs the output (so the output is not kept there either).

``function``'s inputs are its autograd node's saved tensors (freed after its backward, as any).
``torch.autograd.grad`` and ``retain_graph`` backwards work (``function``'s parameters are inputs
of the recompute's autograd node, found on the fenced modules as :func:`~.checkpoint` finds them);
``backward(create_graph=True)`` through it is refused. torch's ``FlopCounterMode`` and
``MemTracker``, which hook every module's inputs, run through the rerun too (it reads views of
its inputs: :func:`_rerun_input`) with unchanged gradients.
"""

from __future__ import annotations

import contextlib
import contextvars
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils import _pytree as pytree

from ..distributed import runtime
from ..distributed.parallel_state import Group
from .activation_checkpoint import (
    _NO_DOUBLE_BACKWARD,
    DISCARD_SCOPE,
    _autocast,
    _autocast_state,
    _distributed_group,
    _fenced_modules,
    _gather_slices,
    _keep_slice,
    _replaying,
    _RNGSnapshot,
    _torch_checkpoint,
    _Tree,
    _xla_barrier,
    inside_checkpoint,
)

_OFF = "off"  # the scope of a block where discarding is turned off
_SCOPE = DISCARD_SCOPE


def checkpoint_without_output(
    function: Callable[..., Any],
    *args: Any,
    fence: Sequence[torch.nn.Module] | torch.nn.Module = (),
    distribute_saved_activations: bool = False,
    **kwargs: Any,
) -> Any:
    """``function(*args, **kwargs)``, keeping only its inputs, whose outputs the ops of the
    enclosing :class:`discard_outputs` block keep as notes to recompute (see the module docstring).

    ``fence``: modules whose parameters ``function`` reads besides its own (when it is a module or
    a bound method of one): they receive gradients and pass the XLA barrier.
    ``distribute_saved_activations``: keep this rank's 1/t slice of the first positional tensor
    (replicated over the TP group) and all-gather it before recomputing.
    """
    if torch.compiler.is_compiling():
        return _torch_checkpoint(function, args, kwargs)
    if not torch.is_grad_enabled() or inside_checkpoint():
        return function(*args, **kwargs)
    scope = _SCOPE.get()
    if scope is None:
        raise RuntimeError(
            "checkpoint_without_output needs an enclosing `with discard_outputs():` block holding the ops "
            "that consume its output (apply_recompute installs one on each layer)"
        )
    if scope is _OFF:
        return function(*args, **kwargs)
    return scope.run(function, _fenced_modules(function, fence), distribute_saved_activations, args, kwargs)


class discard_outputs:
    """The block in which outputs of :func:`checkpoint_without_output` are not kept by the ops
    that consume them. Re-entrant and nestable; a no-op where discarding is off (see the module
    docstring)."""

    def __init__(self) -> None:
        self._entered: list[tuple[Any, contextvars.Token, Any]] = []

    def __enter__(self) -> discard_outputs:
        hooks = None
        if not torch.is_grad_enabled() or inside_checkpoint() or torch.compiler.is_compiling() or _SCOPE.get() is _OFF:
            scope: Any = _OFF
        else:
            # The hooks active outside the block, to pass everything else on to. torch has no
            # public way to read them; this private call (torch 2.8+, used by AOTAutograd) does.
            outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
            if outer is not None and getattr(outer[0], "__module__", "") == "torch.utils.checkpoint":
                scope = _OFF  # inside torch's own non-reentrant checkpoint
            else:
                scope = _Scope(outer)
                hooks = torch.autograd.graph.saved_tensors_hooks(scope.pack, scope.unpack)
                hooks.__enter__()
        self._entered.append((scope, _SCOPE.set(scope), hooks))
        return self

    def __exit__(self, *exc: Any) -> None:
        scope, token, hooks = self._entered.pop()
        _SCOPE.reset(token)
        if hooks is not None:
            hooks.__exit__(*exc)
        if scope is not _OFF:
            scope.close()


# --------------------------------------------------------------------------------------------
# One block: which tensors are discarded outputs, and the hooks that pack them as notes.


def _root(t: torch.Tensor) -> torch.Tensor:
    return t if t._base is None else t._base


@dataclass
class _Note:
    """What a consumer keeps instead of output ``index`` of ``call``: how it viewed it."""

    call: _Call
    index: int
    geometry: tuple[torch.Size, tuple[int, ...], int | torch.SymInt] | None  # None: the output root itself
    view: Callable[[torch.Tensor], torch.Tensor] | None = None  # on XLA: replays the view on a root

    def tensor(self) -> torch.Tensor:
        root = self.call.recomputed_root(self.index)
        if self.view is not None:
            return self.view(root)
        return root if self.geometry is None else root.as_strided(*self.geometry)


class _Scope:
    def __init__(self, outer: tuple[Callable, Callable] | None):
        self.outer = outer
        # id(root) -> (root, call, index, root's version when the function returned)
        self.roots: dict[int, tuple[torch.Tensor, _Call, int, int]] = {}

    def run(self, function, modules, distribute: bool, args: tuple, kwargs: dict) -> Any:
        tensors, inputs = _Tree.split((args, kwargs))
        params = [p for m in modules for p in m.parameters() if p.requires_grad]
        group = _distributed_group() if distribute else None
        positional = any(torch.is_tensor(v) for v in pytree.tree_leaves(args))
        call = _Call(function, modules, inputs, group, positional)
        outputs = _DiscardFunction.apply(call, len(tensors), *tensors, *params)
        for index, out in enumerate(outputs):
            root = _root(out)
            self.roots[id(root)] = (root, call, index, root._version)
        assert call.outputs is not None  # the forward set them
        return call.outputs.fill(outputs)

    def pack(self, t: torch.Tensor) -> Any:
        if self.holds(t):
            root, call, index, _ = self.roots[id(_root(t))]
            if t is not root and t.device.type == "xla":
                # torch-xla reports every tensor's strides as contiguous for its own shape (a
                # transposed view's too) and lets view() follow a transpose, so no (size, stride,
                # offset) describes the view: its view chain is replayed on the recomputed root
                # (Tensor._view_func, private: torch's only replay of a view chain onto another
                # base). Keeping ``t`` costs nothing there: the graph reads the rerun, not t.
                return _Note(call, index, None, t._view_func)  # type: ignore[attr-defined]  # private: see above
            same = t is root or (
                t.size() == root.size() and t.stride() == root.stride() and t.storage_offset() == root.storage_offset()
            )
            return _Note(call, index, None if same else (t.size(), t.stride(), t.storage_offset()))
        return self.outer[0](t) if self.outer is not None else t

    def unpack(self, packed: Any) -> Any:
        if isinstance(packed, _Note):
            return packed.tensor()
        return self.outer[1](packed) if self.outer is not None else packed

    def holds(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is (a view of) a discarded output as the function returned it. One written
        in place since (Mixtral's MoE block multiplies the norm's output by jitter noise) is
        kept as it is: the rerun would give the value before the write."""
        hit = self.roots.get(id(_root(t)))
        return hit is not None and hit[0] is _root(t) and hit[3] == hit[0]._version

    def close(self) -> None:
        self.roots.clear()


# --------------------------------------------------------------------------------------------
# One call: its kept inputs, its RNG snapshot, and the rerun.


@dataclass
class _Call:
    function: Callable[..., Any]
    modules: list[torch.nn.Module]
    inputs: _Tree  # (args, kwargs) without their tensors
    group: Group | None  # distribute the first positional tensor over it
    positional: bool  # a positional argument is a tensor (the one to distribute)
    outputs: _Tree | None = None
    node: Callable[[], Any] | None = None  # a weak reference to the autograd node keeping the inputs
    needs_grad: list[bool] = field(default_factory=list)
    distributed: tuple[int, torch.Size] | None = None  # (tensor index, full shape)
    roots: list[tuple[torch.Size, tuple[int, ...], torch.dtype]] = field(default_factory=list)
    rng: _RNGSnapshot | None = None
    autocast: list = field(default_factory=list)
    autocast_cache: bool = True
    recomputed: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None  # (inputs, outputs)
    backward_pending: bool = False  # a backward will use (and drop) the recomputed graph

    def keep_inputs(self, ctx: Any, tensors: Sequence[torch.Tensor]) -> None:
        """Keep the inputs as the node's saved tensors (through the hooks active here; autograd
        frees them after the node's backward, as any saved tensor)."""
        self.needs_grad = [t.requires_grad for t in tensors]
        kept = list(tensors)
        if self.group is not None and self.positional:
            self.distributed = (0, kept[0].shape)
            kept[0] = _keep_slice(kept[0], self.group)
        ctx.save_for_backward(*kept)
        self.node = weakref.ref(ctx)

    def rerun(self, grads: Sequence[torch.Tensor] = ()) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        # Set by keep_inputs and forward, which run before any rerun.
        assert self.node is not None and self.rng is not None
        inputs = list(self.node().saved_tensors)
        if self.distributed is not None:
            k, shape = self.distributed
            assert self.group is not None  # distributed only over a group
            inputs[k] = _gather_slices(inputs[k], shape, self.group)
        if runtime.is_xla():
            _xla_barrier([*inputs, *grads], self.modules)
        with _replaying(self.rng), torch.enable_grad(), _autocast(self.autocast, self.autocast_cache):
            inputs = [_rerun_input(t, r) for t, r in zip(inputs, self.needs_grad)]
            args, kwargs = self.inputs.fill(inputs)
            with _no_discarding():
                outputs, _ = _Tree.split(self.function(*args, **kwargs))
        for i, (out, (shape, stride, dtype)) in enumerate(zip(outputs, self.roots)):
            root = _root(out)
            if root.shape != shape or root.stride() != stride or root.dtype != dtype:
                raise RuntimeError(
                    f"output-discarding recompute: output {i} of the rerun is {root.dtype} {tuple(root.shape)} "
                    f"stride {root.stride()}, the forward's was {dtype} {tuple(shape)} stride {stride}"
                )
        return inputs, outputs

    def recomputed_root(self, index: int) -> torch.Tensor:
        """The root of recomputed output ``index``, detached (for a consumer's backward)."""
        if self.recomputed is None:
            result = self.rerun()
            if not self.backward_pending:  # no backward of ours will run: keep nothing
                return _root(result[1][index]).detach()
            self.recomputed = result
        return _root(self.recomputed[1][index]).detach()


def _rerun_input(t: torch.Tensor, needs_grad: bool) -> torch.Tensor:
    """What the rerun reads for a kept input: detached from the forward's graph and, when it needs
    a gradient, a view of a fresh leaf rather than the leaf itself. The backward asks
    ``torch.autograd.grad`` for the gradients of these tensors; torch's module trackers
    (``FlopCounterMode``, ``MemTracker``) hook every module's inputs, and a hook on a leaf raises
    inside ``autograd.grad`` ("A leaf node was passed to _will_engine_execute_node ..."), while a
    hook on a view does not. Same values, same storage, no copy."""
    t = t.detach()
    return t.requires_grad_().view_as(t) if needs_grad else t


class _no_discarding:
    """Turn discarding off for a rerun (its graph is backpropagated at once)."""

    def __enter__(self) -> None:
        self.token = _SCOPE.set(_OFF)

    def __exit__(self, *exc: Any) -> None:
        _SCOPE.reset(self.token)


@contextlib.contextmanager
def _hooks_held(params: list[torch.Tensor]):
    """The parameters' gradient hooks held back while the rerun's graph gives their gradients:
    those gradients leave through this Function's backward and meet the hooks there, once. (A hook
    that completes a gradient, such as a sum over the tensor-parallel group for a weight that saw
    only this rank's tokens, would otherwise run twice.) torch keeps a tensor's hooks in the dict
    ``_backward_hooks``, which its C++ pre-hook reads at each call; there is no public way to
    pause them, so the dict is emptied and refilled in place."""
    held = [(p._backward_hooks, dict(p._backward_hooks)) for p in params if p._backward_hooks]
    for hooks, _ in held:
        hooks.clear()
    try:
        yield
    finally:
        for hooks, saved in held:
            hooks.update(saved)


class _DiscardFunction(torch.autograd.Function):
    """Forward: ``function`` without grad, keeping nothing (the inputs are kept by ``_Call``).
    Backward: the recomputed graph (the one a consumer's note made, or a fresh rerun) gives the
    gradients of the inputs and of the fenced modules' parameters."""

    @staticmethod
    def forward(ctx, call: _Call, n_tensors: int, *tensors_and_params):
        tensors = tensors_and_params[:n_tensors]
        ctx.call, ctx.n_tensors = call, n_tensors
        ctx.set_materialize_grads(False)
        call.rng = _RNGSnapshot.take()
        call.autocast = _autocast_state(tensors)
        call.autocast_cache = torch.is_autocast_cache_enabled()
        call.keep_inputs(ctx, tensors)
        # Detached: a view the function takes of an input here (grad is off) would otherwise still
        # say requires_grad with no grad_fn, which module trackers' input hooks cannot place.
        args, kwargs = call.inputs.fill(t.detach() for t in tensors)
        outputs, call.outputs = _Tree.split(call.function(*args, **kwargs))
        if not outputs:
            raise TypeError("checkpoint_without_output: the function returned no tensor")
        call.roots = [(_root(o).shape, _root(o).stride(), o.dtype) for o in outputs]
        call.backward_pending = any(t.requires_grad for t in tensors_and_params)
        return tuple(outputs)

    @staticmethod
    def backward(ctx, *grads):
        if torch.is_grad_enabled():  # the engine enables grad in backward only for create_graph=True
            raise RuntimeError(_NO_DOUBLE_BACKWARD)
        call = ctx.call
        inputs, outputs = (
            call.recomputed if call.recomputed is not None else call.rerun([g for g in grads if g is not None])
        )
        call.recomputed = None  # a retain_graph backward recomputes again
        params = [p for m in call.modules for p in m.parameters() if p.requires_grad]
        wanted = [t for t in inputs if t.requires_grad] + params
        pairs = [(o, g) for o, g in zip(outputs, grads) if g is not None and o.requires_grad]
        with _hooks_held(params):
            got = iter(
                torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True)
                if pairs and wanted
                else [None] * len(wanted)
            )
        input_grads = [next(got) if t.requires_grad else None for t in inputs]
        param_grads = [next(got) for _ in params]
        return (None, None, *input_grads, *param_grads)


__all__ = ["checkpoint_without_output", "discard_outputs"]
