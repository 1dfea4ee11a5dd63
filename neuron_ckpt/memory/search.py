"""The planner's search over layers that are not all alike: the cheapest option for each layer,
exact, by dynamic programming over the layers in order (:func:`cheapest_per_layer`).

:func:`~.planner.plan_recompute` weighs counts of identical layers (this library's Llama and the
paper's GPT); a transformers model may have layers of several kinds at fixed places (DeepSeek's
dense first layers, Gemma2's alternating windows), each kind with its own options. What a budget
needs of the layers (:meth:`~.budget.BudgetParts.used`) is, with one micro-batch in flight, the largest
of ``f(P)``, ``g(Q)`` and a constant, both non-decreasing: ``P`` the bytes the layers keep, ``Q``
the most held at a layer's backward (what the layers before it keep plus its own backward peak).
So a plan fits a limit when ``P <= P_max`` and ``Q <= Q_max`` (both found by bisection on the
budget's own arithmetic), and among the assignments of the layers so far that still can, only
those no other beats on ``(P, FLOPs)`` can lead to the cheapest plan: the search keeps those (a
Pareto front), dropping the ones that cannot fit and the ones that cannot beat a plan already
known to fit, however the remaining layers choose (a bound: the cheapest way for them to keep
what is left of ``P_max`` when each may mix its options, the lower convex hull of its
``(kept, FLOPs)`` points; the known plan: that mix rounded to whole options). The least memory is
read off a front on ``(P, Q)``. Both are exact: ``tests/test_planner_families.py`` checks them
against a brute force over every per-layer assignment.

Offload (this library's Llama, :mod:`.offload_time`): a layer's backward also holds the reload
of the nearest earlier offloading layer (``LayerOption.reload_bytes``), so each state carries that
reload into ``Q`` of the layers after it, and states with different carries are never compared;
FLOPs are ``LayerOption.cost`` (recompute plus exposed copies). Checked against a brute force in
``tests/test_planner_offload.py``.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import accumulate

from .options import LayerOption


@dataclass(frozen=True)
class _State:
    kept: int  # P: bytes kept by the layers so far
    held: int  # Q: the most held at one of their backwards, what the layers before it keep included
    flops: float  # the cost so far (LayerOption.cost: FLOPs rerun, and exposed copies as FLOPs)
    name: str
    parent: _State | None
    carry: int = 0  # the reload of the nearest offloading layer so far, held at the next layer's backward
    host: int = 0  # pinned host bytes of the offloading layers so far


def _grow(front: list[_State], options: dict[str, LayerOption]) -> list[_State]:
    return [
        _State(
            s.kept + o.saved_bytes,
            max(s.held, s.kept + o.backward_peak_bytes + s.carry),
            s.flops + o.cost,
            n,
            s,
            o.reload_bytes or s.carry,
            s.host + o.host_pinned_bytes,
        )
        for s in front
        for n, o in options.items()
    ]


def _by_carry(states: list[_State], front: Callable[[list[_State]], list[_State]]) -> list[_State]:
    """``front`` of the states with each carry apart (a larger carry costs the layers after it)."""
    groups: dict[int, list[_State]] = {}
    for s in states:
        groups.setdefault(s.carry, []).append(s)
    return [s for group in groups.values() for s in front(group)]


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


def _front3(states: list[_State], keys: tuple[str, str, str] = ("kept", "held", "flops")) -> list[_State]:
    """The states no other beats on the three ``keys``, one of each equal triple."""
    a, b, c = keys
    states.sort(key=lambda s: (getattr(s, a), getattr(s, b), getattr(s, c), s.flops))
    second: list = []  # a staircase over the states kept so far: b ascending, c descending
    third: list = []
    out = []
    for s in states:
        i = bisect_right(second, getattr(s, b))
        if i and third[i - 1] <= getattr(s, c):  # one with no more of all three came first
            continue
        out.append(s)
        j = i
        while j < len(second) and third[j] >= getattr(s, c):
            j += 1
        second[i:j], third[i:j] = [getattr(s, b)], [getattr(s, c)]
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


def _hull(options: dict[str, LayerOption]) -> list[tuple[str, int, float]]:
    """The lower convex hull of a layer's ``(kept, FLOPs)`` points, from the one that reruns least
    (keeps most) to the one that keeps least: ``(name, kept, FLOPs)``."""
    points = sorted((-o.saved_bytes, o.cost, n) for n, o in options.items())  # kept descending
    hull: list[tuple[int, float, str]] = []
    for p in points:
        if hull and p[0] == hull[-1][0]:  # keeps as much as the last and reruns no less
            continue
        while hull and p[1] <= hull[-1][1]:  # keeps less and reruns no more than the last: the last goes
            hull.pop()
        while len(hull) >= 2:  # the last is above the segment from the one before it to p
            (x0, y0, _), (x1, y1, _) = hull[-2], hull[-1]
            if (y1 - y0) * (p[0] - x0) >= (p[1] - y0) * (x1 - x0):
                hull.pop()
            else:
                break
        hull.append(p)
    return [(n, -x, y) for x, y, n in hull]


class _Bound:
    """For each suffix of the layers, the fewest FLOPs with which they keep at most ``R`` bytes
    when each may mix its options (a lower bound on any whole choice), and the whole choices that
    mix rounds to."""

    def __init__(self, layers: Sequence[dict[str, LayerOption]]):
        hulls = [_hull(options) for options in layers]
        self.hulls = hulls
        self.most = list(accumulate((h[0][1] for h in reversed(hulls)), initial=0))[::-1]  # kept, none recomputed
        self.suffix: list[tuple[list[int], list[float], list[float]]] = []
        for r in range(len(layers) + 1):
            steps = sorted(
                ((y1 - y0) / (x0 - x1), x0 - x1, y1 - y0)
                for hull in hulls[r:]
                for (_, x0, y0), (_, x1, y1) in zip(hull, hull[1:])
            )
            saved = list(accumulate((s[1] for s in steps), initial=0))
            cost = list(accumulate((s[2] for s in steps), initial=0.0))
            self.suffix.append((saved, cost, [s[0] for s in steps]))

    def least_flops(self, r: int, room: int) -> float:
        """The fewest FLOPs with which layers ``r``.. keep at most ``room`` bytes (inf: they cannot)."""
        need = self.most[r] - room
        if need <= 0:
            return 0.0
        saved, cost, rate = self.suffix[r]
        i = bisect_left(saved, need)
        if i == len(saved):
            return float("inf")
        return cost[i - 1] + (need - saved[i - 1]) * rate[i - 1]

    def rounded(self, room: int) -> tuple[str, ...] | None:
        """Whole options near the mix that keeps at most ``room``: each layer takes the hull steps
        the mix takes, all of a step it takes part of (None when even the least does not fit)."""
        need = self.most[0] - room
        if need > self.suffix[0][0][-1]:
            return None
        taken: dict[int, int] = {}  # per layer, how far along its hull
        steps = sorted(
            ((y1 - y0) / (x0 - x1), x0 - x1, i, k)
            for i, hull in enumerate(self.hulls)
            for k, ((_, x0, y0), (_, x1, y1)) in enumerate(zip(hull, hull[1:]))
        )
        for _, step, i, k in steps:
            if need <= 0:
                break
            taken[i] = max(taken.get(i, 0), k + 1)
            need -= step
        return tuple(hull[taken.get(i, 0)][0] for i, hull in enumerate(self.hulls))


def cheapest_per_layer(
    layers: Sequence[dict[str, LayerOption]],
    used: Callable[[int, int], int],
    limit: int,
    separable: bool = True,
    host_limit: int | None = None,
) -> tuple[tuple[str, ...] | None, tuple[str, ...]]:
    """``(cheapest, least)``: the option names, one per layer, with the least cost (recompute
    FLOPs, and exposed copies as FLOPs: ``LayerOption.cost``) whose bytes ``used(P, Q)`` are at
    most ``limit`` (ties: fewer bytes; None when none fits), and the one with the fewest bytes
    (ties: the least cost). ``layers``: each layer's options, in
    layer order. ``used``: the budget's bytes for the two sums (module docstring), non-decreasing
    in both; ``separable``: of the form ``max(f(P), g(Q), c)``, as with one micro-batch in flight.
    With several (a pipeline stage: the others' kept bytes add to the peak) the front is kept on
    ``(P, Q, FLOPs)`` and each state asked ``used`` (stages hold few layers). ``host_limit``: the
    most pinned host bytes the offloading layers may take together (``LayerOption.host_pinned_bytes``),
    a third count each front keeps (one micro-batch in flight only)."""
    if not layers:
        return (), ()
    if host_limit is not None and not separable:
        raise ValueError("host_limit: planned with one micro-batch in flight only (no pipeline)")

    def on_host(s: _State) -> bool:
        return host_limit is None or s.host <= host_limit

    def least_front(g: list[_State]) -> list[_State]:
        return _front(g, "kept", "held") if host_limit is None else _front3(g, ("kept", "held", "host"))

    def best_front(g: list[_State]) -> list[_State]:
        if not separable:
            return _front3(g)
        return _front(g, "kept", "flops") if host_limit is None else _front3(g, ("kept", "host", "flops"))

    root = _State(0, 0, 0.0, "", None)
    front = [root]
    for options in layers:  # the least bytes: what no other beats on (P, Q) can lead there
        front = _by_carry([s for s in _grow(front, options) if on_host(s)], least_front)
    least = min(front, key=lambda s: (used(s.kept, s.held), s.flops))
    if used(least.kept, least.held) > limit:
        return None, _names(least)
    most = len(layers) * max(o.backward_peak_bytes + o.reload_bytes for options in layers for o in options.values())
    kept_max = _largest(lambda p: used(p, p) <= limit, most)  # f(P) <= limit (and g(P), as P <= Q)
    held_max = _largest(lambda q: used(0, q) <= limit, most) if separable else most  # g(Q) <= limit
    bound = _Bound(layers)
    known = float("inf")  # FLOPs of a plan known to fit: the relaxation's, rounded
    rounded = bound.rounded(kept_max)
    if rounded is not None:
        kept = held = carry = host = 0
        for options, name in zip(layers, rounded):
            o = options[name]
            held, kept = max(held, kept + o.backward_peak_bytes + carry), kept + o.saved_bytes
            carry, host = o.reload_bytes or carry, host + o.host_pinned_bytes
        if used(kept, held) <= limit and (host_limit is None or host <= host_limit):
            known = sum(options[n].cost for options, n in zip(layers, rounded))
    front = [root]
    for r, options in enumerate(layers, start=1):  # what can still fit and still beat the known plan
        grown = [
            s
            for s in _grow(front, options)
            if s.kept <= kept_max
            and s.held <= held_max
            and s.flops + bound.least_flops(r, kept_max - s.kept) <= known * (1 + 1e-12)
            and (separable or used(s.kept, s.held) <= limit)
            and on_host(s)
        ]
        front = _by_carry(grown, best_front)
    fitting = [(s.flops, used(s.kept, s.held), s) for s in front]
    if not fitting:  # the bound is exact: the least fits, so something does
        raise AssertionError("cheapest_per_layer: no plan found, yet the least fits")
    best = min(fitting, key=lambda f: (f[0], f[1]))
    assert best[1] <= limit, "used(P, Q) is not max(f(P), g(Q), c)"
    return _names(best[2]), _names(least)


__all__ = ["cheapest_per_layer"]
