"""The all-gather dispatch form under expert parallelism (XLA's form:
:mod:`neuron_ckpt.parallel.experts.all_gather`), storage by storage on one rank, and what its
capacity drops.

Each rank dispatches ``T'`` tokens (``T/t`` at TP t); the EP group of ``e`` ranks gathers
``N = e T'`` of them; each of this rank's ``E/e`` experts has ``C`` slots (:func:`capacity`), so
its experts run ``R = E/e x C`` rows (:func:`slots`) whatever the routing: the memory is static,
as the form's shapes are. What autograd keeps, op by op of ``dispatch`` and ``combine``:

* the all-gathers of the tokens ``[N, h]`` and the routing weights ``[N, k]`` keep nothing (their
  backward reduce-scatters), nor the all-gather of the expert ids (no gradient); the gathered
  tokens and weights themselves are not kept either: the rows are indexed out of the tokens (a
  ``cat`` with the zero row, then ``[slot_token]``) and the weights scattered into the slots, ops
  whose backward needs only their indices;
* the scatter of the weights keeps its int64 slot index, one per gathered route, ``[N k]``;
* the indexing of the rows keeps ``slot_token``, an int64 view of ``[R + 1]`` (the last, the zero
  row's, cut off), which the combine's ``index_add`` keeps again (one storage);
* the experts are called on the ``R`` slots as a top-1 call whose weights need a gradient, so they
  keep what transformers' experts keep for ``R`` routes of one token each, whole
  (:func:`~.experts.routed_experts`: unlike the all-to-all form's, also the down projection's
  output, the weighting's weights and grouped_mm's sort permutation);
* the combine's ``index_add`` of the slots' outputs, in fp32, keeps its source: an fp32 ``[R, h]``
  (the experts' output cast up; in fp32 the output itself); the reduce-scatter keeps nothing.

At TP > 1 each TP rank's slice of its ``T/t`` tokens and the all-gather of the output over TP
keep nothing. Ops (:meth:`~.rules.LayerTensors.op`): the experts' over ``R`` rows, then
``mlp.experts.reduce``: the slots' outputs added at their tokens (``R h``).

**Dropped routes** (``ExpertDispatch(capacity_factor=cf)``; none when dropless): an expert
receives at most ``N`` routes (a token picks it once) and keeps ``C``, so one rank drops at most
``min(k, E/e) (N - C)`` (every token sends its routes to the same experts, as many of them here
as can be) and the EP group ``k (N - C)`` (:func:`dropped_worst`). A balanced routing (``N k / E``
routes per expert) drops none at ``cf >= 1``.
"""

from __future__ import annotations

from ...parallel.experts.dispatch import ExpertDispatch
from .norms import FP32
from .routers import INT64
from .rules import LayerTensors
from .shape import MoESetup, MoEShape


def gathered_tokens(setup: MoESetup) -> int:
    """``N = e T'``: the EP group's tokens every rank gathers."""
    return setup.ep * setup.dispatched_tokens


def capacity(shape: MoEShape, setup: MoESetup) -> int:
    """Slots per local expert: ``ceil(N k / E x cf)`` capped at ``N``; ``N`` when dropless
    (:meth:`ExpertDispatch.capacity`, what the form runs)."""
    dispatch = ExpertDispatch("all_gather", setup.capacity_factor)
    return dispatch.capacity(gathered_tokens(setup), shape.top_k, shape.experts)


def slots(shape: MoEShape, setup: MoESetup) -> int:
    """``R = E/e x C``: the rows this rank's experts run."""
    return shape.experts // setup.ep * capacity(shape, setup)


def dropped_worst(shape: MoEShape, setup: MoESetup) -> tuple[int, int]:
    """The most routes the capacity can drop in one forward of one MoE layer: on this rank, and
    over the EP group (module docstring); ``(0, 0)`` when dropless."""
    over = gathered_tokens(setup) - capacity(shape, setup)
    return min(shape.top_k, shape.experts // setup.ep) * over, shape.top_k * over


def dispatch(layer: LayerTensors, shape: MoEShape, setup: MoESetup) -> None:
    """What the dispatch keeps: the slot index of the weights' scatter, and ``slot_token``."""
    layer.save("ag.slot_index", INT64 * gathered_tokens(setup) * shape.top_k, False, "mlp.experts.dispatch")
    layer.save("ag.slot_token", INT64 * (slots(shape, setup) + 1), False, "mlp.experts.dispatch", "mlp.experts.reduce")


def combine(layer: LayerTensors, shape: MoEShape, setup: MoESetup) -> None:
    """The slots' outputs added at their tokens in fp32 (``index_add`` keeps its source)."""
    rows = slots(shape, setup)
    layer.op("mlp.experts.reduce", elementwise=rows * shape.hidden)
    layer.save("ag.combine_source", FP32 * rows * shape.hidden, False, "mlp.experts.reduce")


__all__ = ["capacity", "combine", "dispatch", "dropped_worst", "gathered_tokens", "slots"]
