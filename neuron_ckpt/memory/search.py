"""The planner's search over layers that are not all alike: the cheapest option for each layer,
exact, by dynamic programming over the layers in order (:func:`cheapest_per_layer`).

:func:`~.planner.plan_recompute` weighs counts of identical layers (this library's Llama and the
paper's GPT); a transformers model may have layers of several kinds at fixed places (DeepSeek's
dense first layers, Gemma2's alternating windows), each kind with its own options. What a budget
needs of the layers (:meth:`~.budget._Parts.used`) is, for ``m`` micro-batches in flight, a
non-decreasing function of two sums over the layers in order: ``P``, the bytes they keep, and
``Q``, the most held at a layer's backward (the bytes the layers before it keep plus its own
backward peak). So after each layer only the assignments no other beats on ``(P, Q, FLOPs)`` can
lead to the best plan or to the least memory; the search keeps those (a Pareto front, a few
hundred to a few thousand states for 61 DeepSeek-V3 layers) and reads both answers off the last
front. ``tests/test_planner_families.py`` checks it against a brute force over every per-layer
assignment, and against :func:`~.planner.plan_recompute`'s counts on identical layers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .options import LayerOption


@dataclass(frozen=True)
class _State:
    kept: int  # P: bytes kept by the layers so far
    held: int  # Q: the most held at one of their backwards, what the layers before it keep included
    flops: float
    name: str
    parent: _State | None


def _grow(front: list[_State], options: dict[str, LayerOption]) -> list[_State]:
    return [
        _State(s.kept + o.saved_bytes, max(s.held, s.kept + o.backward_peak_bytes), s.flops + o.recompute_flops, n, s)
        for s in front
        for n, o in options.items()
    ]


def _front(states: list[_State], first: str, second: str) -> list[_State]:
    """The states no other beats on ``first`` and ``second`` (``first`` ascending; among equals
    the one first in (first, second, the third) order)."""
    third = ({"kept", "held", "flops"} - {first, second}).pop()
    states.sort(key=lambda s: (getattr(s, first), getattr(s, second), getattr(s, third)))
    out: list[_State] = []
    for s in states:
        if not out or getattr(s, second) < getattr(out[-1], second):
            out.append(s)
    return out


def _names(state: _State) -> tuple[str, ...]:
    names = []
    node: _State | None = state
    while node is not None and node.name:
        names.append(node.name)
        node = node.parent
    return tuple(reversed(names))


def _largest(fits: Callable[[int], bool], hi: int) -> int:
    """The largest ``n`` in ``[0, hi]`` with ``fits(n)`` (``fits`` true at 0, monotone)."""
    lo = 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def cheapest_per_layer(
    layers: Sequence[dict[str, LayerOption]], used: Callable[[int, int], int], limit: int
) -> tuple[tuple[str, ...] | None, tuple[str, ...]]:
    """``(cheapest, least)``: the option names, one per layer, with the fewest recompute FLOPs
    whose bytes ``used(P, Q)`` are at most ``limit`` (ties: fewer bytes, among those the search
    keeps; None when none fits), and the one with the fewest bytes. ``layers``: each layer's
    options, in layer order. ``used``: the budget's bytes for the two sums (module docstring),
    non-decreasing in both and of the form ``max(f(P), g(Q), c)``, which it is with one
    micro-batch in flight (no pipeline)."""
    root = _State(0, 0, 0.0, "", None)
    front = [root]
    for options in layers:  # the least bytes: what no other beats on (P, Q) can lead there
        front = _front(_grow(front, options), "kept", "held")
    least = min(front, key=lambda s: (used(s.kept, s.held), s.flops))
    if used(0, 0) > limit:
        return None, _names(least)
    most = max(max(o.backward_peak_bytes for o in options.values()) for options in layers) * len(layers)
    held_max = _largest(lambda q: used(0, q) <= limit, most)  # g(Q) <= limit
    kept_max = _largest(lambda p: used(p, p) <= limit, most)  # f(P) <= limit (and g(P), as P <= Q)
    front = [root]
    for options in layers:  # fitting so far, and what no other beats on (P, FLOPs) among them
        grown = [s for s in _grow(front, options) if s.kept <= kept_max and s.held <= held_max]
        front = _front(grown, "kept", "flops")
    fitting = [(s.flops, used(s.kept, s.held), s) for s in front]
    if not fitting:
        return None, _names(least)
    best = min(fitting, key=lambda f: (f[0], f[1]))
    assert best[1] <= limit, "used(P, Q) is not max(f(P), g(Q), c)"
    return _names(best[2]), _names(least)


__all__ = ["cheapest_per_layer"]
