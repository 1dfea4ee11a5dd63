"""One rule for what a layer keeps under any recompute choice, from who keeps each storage.

A layer is written once, without recompute, as the storages autograd keeps (:class:`Saved`),
each with its *keepers*: the places in the layer whose backward reads it, named by where they
sit (``"attn.core"``, ``"mlp.experts.down"``...). One storage may have several keepers (the
norm's output is read by the q, k and v projections; the sdpa output by the kernel and by
``o_proj``), and a storage no op keeps may still be listed, for a checkpoint to keep (the
layer's input in bf16, which only the norm's fp32 copy of it reaches).

A recompute choice is a set of :class:`Unit`\\ s, each covering a region of places:

* an ordinary checkpoint (``core_attn``, ``mlp``, ``moe``, ``shared_experts``, full) runs its
  region without keeping anything and keeps its inputs;
* an output-discarding one (``norm``, ``mlp_act``, ``moe_act``, ``mla_up_proj``) also runs its
  region without keeping anything and keeps its inputs, and every op after it keeps a note
  instead of its outputs (:mod:`neuron_ckpt.recompute.discard`), a checkpoint's saved input
  included.

So a storage is kept when it is not a discarded output and some keeper sits outside every
active region, or an active unit keeps it as an input. A unit inside another active unit is off
(the outermost wins, as ``apply_recompute`` installs them). Some units also hold memory outside
autograd (the routing replay's recorded expert indices): :attr:`Unit.outside`.

The places are also the layer's ops, in forward order, each with its FLOPs (:meth:`LayerTensors.op`),
and a keeper ending in ``+`` keeps an output of its op (saved after the op ran; otherwise an input,
saved before). What a unit reruns (:meth:`LayerTensors.rerun`) follows from that, as for our own
layers (:mod:`neuron_ckpt.memory.rerun`): an ordinary checkpoint reruns its region up to the last
save inside it (torch's early stop; on XLA the compiler drops the rest), an output-discarding unit
its whole region.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from ..rerun import Flops
from ..terms import ActivationTerm


@dataclass
class Saved:
    """One storage kept for backward: bytes on one rank, whether TP split it, who keeps it."""

    name: str
    nbytes: int
    split_by_tp: bool
    keepers: set[str] = field(default_factory=set)


def _covers(prefix: str, place: str) -> bool:
    place = place.removesuffix("+")  # a keeper of its op's output: the same place
    return prefix == "" or place == prefix or place.startswith(prefix + ".")


@dataclass(frozen=True)
class Unit:
    """What one recompute unit covers: ``region`` (place prefixes; ``""``: the whole layer),
    the storages its checkpoint keeps (``inputs``), the outputs whose consumers keep notes
    instead (``discards``: non-empty for an output-discarding unit) and what it holds outside
    autograd (``outside``)."""

    module: str
    region: tuple[str, ...]
    inputs: tuple[str, ...]
    discards: tuple[str, ...] = ()
    outside: tuple[ActivationTerm, ...] = ()

    def covers(self, place: str) -> bool:
        return any(_covers(p, place) for p in self.region)

    def inside(self, other: Unit) -> bool:
        """Whether ``other`` encloses this unit (and is not this unit)."""
        return other is not self and all(other.covers(p) for p in self.region)


class LayerTensors:
    """A layer's storages in forward order, and its recompute units by module name."""

    def __init__(self) -> None:
        self.saved: dict[str, Saved] = {}
        self.units: dict[str, list[Unit]] = {}
        self.ops: list[tuple[str, Flops]] = []  # (place, FLOPs on one rank), in forward order

    def op(self, place: str, matmul: float = 0.0, elementwise: float = 0.0) -> None:
        """The op at ``place`` runs next in the forward, with these FLOPs."""
        if any(p == place for p, _ in self.ops):
            raise AssertionError(f"op {place!r} listed twice")
        self.ops.append((place, Flops(float(matmul), float(elementwise))))

    def save(self, name: str, nbytes: int, split_by_tp: bool, *keepers: str) -> str:
        """A new storage (``keepers`` may be none: a storage only a checkpoint keeps); its name."""
        if name in self.saved:
            raise AssertionError(f"storage {name!r} listed twice")
        self.saved[name] = Saved(name, nbytes, split_by_tp, set(keepers))
        return name

    def keep(self, name: str, *keepers: str) -> str:
        """More ops keep the existing storage ``name``; its name."""
        self.saved[name].keepers.update(keepers)
        return name

    def unit(
        self,
        module: str,
        region: Iterable[str],
        inputs: Iterable[str],
        discards: Iterable[str] = (),
        outside: Iterable[ActivationTerm] = (),
    ) -> None:
        for name in (*inputs, *discards):
            if name not in self.saved:
                raise AssertionError(f"unit {module!r} names an unknown storage {name!r}")
        self.units.setdefault(module, []).append(
            Unit(module, tuple(region), tuple(inputs), tuple(discards), tuple(outside))
        )

    def active(self, modules: Iterable[str]) -> list[Unit]:
        """The units of ``modules`` the layer has, less those inside another (the outermost wins)."""
        chosen = [u for m in modules for u in self.units.get(m, ())]
        return [u for u in chosen if not any(u.inside(o) for o in chosen)]

    def kept(self, modules: Iterable[str]) -> tuple[list[ActivationTerm], list[ActivationTerm]]:
        """What the layer keeps with ``modules`` recomputed (those it has; the others skipped):
        the storages autograd keeps, in forward order, and what is held outside autograd."""
        active = self.active(modules)
        discarded = {name for u in active for name in u.discards}
        as_input = {name for u in active for name in u.inputs}
        terms = [
            ActivationTerm(s.name, s.nbytes, s.split_by_tp)
            for s in self.saved.values()
            if s.name not in discarded
            and (s.name in as_input or any(not any(u.covers(k) for u in active) for k in s.keepers))
        ]
        return terms, [t for u in active for t in u.outside]

    def rerun(self, modules: Iterable[str]) -> Flops:
        """The forward FLOPs the layer's backward reruns with ``modules`` recomputed (see the
        module docstring); the units add up."""
        places = [p for p, _ in self.ops]
        saves = [(places.index(k.removesuffix("+")), k.endswith("+")) for s in self.saved.values() for k in s.keepers]
        out = Flops()
        for unit in self.active(modules):
            inside = [i for i, p in enumerate(places) if unit.covers(p)]
            if not inside:
                continue
            first, last = inside[0], inside[-1]
            if unit.discards:  # called again, all of it
                stop = last + 1
            else:  # up to the last save inside the region
                stop = max([first, *(i + after for i, after in saves if first <= i <= last)])
            out += sum((flops for _, flops in self.ops[first:stop]), Flops())
        return out


__all__ = ["LayerTensors", "Saved", "Unit"]
