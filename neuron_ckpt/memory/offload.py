"""Activation offload priced: per layer, what stays on the device and what goes to host.

``RecomputeConfig(offload_modules=[...])`` (docs/offload.md) copies what the named modules keep
for backward to host memory in forward and brings it back in backward. In the words of
:mod:`.terms` (each kept term has a role: whose input or output it is), a name offloads the
terms of its roles that the recompute leaves kept:

* ``norm``: ``norm1.in``, ``norm1.own``, ``norm2.in``, ``norm2.own`` (each norm's input and its
  fp32 1/rms; only the input when the norms are recomputed);
* ``core_attn``: ``core.in`` and ``core.own`` (q, k, v and what the attention keeps; q, k, v
  when it is recomputed). With flash attention the kernel also saves its output, which the
  output projection keeps too: that storage is copied to host and stays on the device;
* ``mlp``: ``norm2.out``, ``act.in``, ``act.out`` (its input, gate and up, SwiGLU's output; its
  input only when it is recomputed, gate and up only beside discarding ``mlp_act`` and ``norm``);
* ``mlp_act``: ``act.in`` (gate and up);
* ``layer``: every kept term (full recompute: ``layer_input``), and the rotary tables once per
  step, in the first offloading layer (the other layers save the same storages).

``qkv_input`` and ``proj_input`` move only with ``layer``. One config offloads every layer but
the last (backward needs it first); the layers come from
:func:`~neuron_ckpt.recompute.offload.install.per_layer_names`, as ``apply_recompute`` reads them.

Device: a layer keeps its terms less those it offloads. On top, in forward, the offloaded bytes
of at most the two most recent offloading layers are held until their copies complete (none
when copies keep up: :attr:`OffloadPrice.copies_in_flight` is the worst case), and in backward
the next offloading layer's reload runs beside the layer computing (:attr:`OffloadPrice.reload_buffer`).

Host: every offloaded storage of every layer and micro-batch in flight. On an accelerator each
is one pinned buffer from torch's caching host allocator, which rounds every allocation up to a
power of two (``c10::llvm::PowerOf2Ceil`` in torch 2.13's ``ATen/core/CachingHostAllocator.h``,
below ``pinned_max_round_threshold``, unlimited by default) and keeps freed blocks for the next
step (:func:`pinned_block`); the pricing takes one storage per term. :func:`~.host.host_budget`
holds them from the first step on (``offload_pinned_bytes``).

Measured (tests/test_memory_offload.py): ``offload_stats`` per layer is :attr:`LayerOffload.host`
to the byte, and a ``SavedTensorRecorder`` around the layers sees :attr:`LayerOffload.device`
(offloaded saves do not reach outer saved-tensor hooks); the storages held for their copies at
each layer's end (copies never done) are :attr:`OffloadPrice.in_flight`, and the reloads alive at
each layer's backward start its own bytes plus :attr:`OffloadPrice.reload_buffer`. The peak that
adds them up is priced, not measured.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from ..recompute import RecomputeConfig
from ..recompute.offload.install import per_layer_names
from .analytic import Recompute, layer_backward_peak, resolve, rotary_terms, stack_peak
from .shape import ModelShape, TrainingSetup
from .terms import ActivationTerm, layer_terms, term_roles

OFFLOADED_ROLES: dict[str, tuple[str, ...]] = {
    "norm": ("norm1.in", "norm1.own", "norm2.in", "norm2.own"),
    "core_attn": ("core.in", "core.own"),
    "mlp": ("norm2.out", "act.in", "act.out"),
    "mlp_act": ("act.in",),
}
PRICED = ("layer", *OFFLOADED_ROLES)


def pinned_block(nbytes: int) -> int:
    """The pinned host bytes torch's caching host allocator reserves for ``nbytes``: the next
    power of two (``CachingHostAllocator``'s ``PowerOf2Ceil``); 0 for nothing."""
    return 0 if nbytes <= 0 else 1 << (nbytes - 1).bit_length()


@dataclass(frozen=True)
class LayerOffload:
    """One layer on one rank: ``names`` it offloads, ``kept`` its bytes without offload,
    ``moved`` the terms whose storages leave the device, ``host_terms`` everything copied to
    host (``moved``, a storage also kept on the device, the rotary tables)."""

    index: int
    names: tuple[str, ...]
    kept: int
    moved: tuple[ActivationTerm, ...]
    host_terms: tuple[ActivationTerm, ...]

    @property
    def offloaded(self) -> int:
        """Bytes that leave the device once their copies are done."""
        return sum(t.nbytes for t in self.moved)

    @property
    def device(self) -> int:
        """Bytes the layer keeps on the device after its forward."""
        return self.kept - self.offloaded

    @property
    def host(self) -> int:
        """Bytes copied to host per micro-batch (what ``offload_stats`` counts for the layer)."""
        return sum(t.nbytes for t in self.host_terms)

    @property
    def twice(self) -> int:
        """Bytes on the device twice once the layer is reloaded: what it copied to host but also
        kept there (flash's output, the rotary tables)."""
        return self.host - self.offloaded

    @property
    def pinned(self) -> int:
        """:attr:`host` as pinned blocks (:func:`pinned_block` per storage)."""
        return sum(pinned_block(t.nbytes) for t in self.host_terms)


@dataclass(frozen=True)
class OffloadPrice:
    """The stack on one rank with ``micro_batches`` micro-batches' activations in flight."""

    layers: tuple[LayerOffload, ...]
    micro_batches: int
    in_flight: tuple[int, ...]  # per layer: bytes held for copies at the end of its forward, worst case
    peak_without: int  # device activation peak of one micro-batch without offload
    peak: int  # the same with offload, copies in flight and reload buffer included (worst case)

    @property
    def device_bytes(self) -> int:
        """Kept on the device after one micro-batch's forward, copies done."""
        return sum(x.device for x in self.layers)

    @property
    def host_bytes(self) -> int:
        return self.micro_batches * sum(x.host for x in self.layers)

    @property
    def host_pinned_bytes(self) -> int:
        """:attr:`host_bytes` as the caching host allocator reserves them."""
        return self.micro_batches * sum(x.pinned for x in self.layers)

    @property
    def offloaded_bytes_per_layer(self) -> int:
        """The most one layer offloads (bytes that leave the device)."""
        return max(x.offloaded for x in self.layers)

    @property
    def copies_in_flight(self) -> int:
        """The forward's worst case: a layer's and the nearest earlier offloading layer's bytes
        held for their copies (:attr:`in_flight`'s largest)."""
        return max(self.in_flight)

    @property
    def reload_buffer(self) -> int:
        """The backward's extra: the next offloading layer's reload beside the layer computing."""
        return self.offloaded_bytes_per_layer


def _check(model: ModelShape, names: set[str]) -> None:
    if names and model.kind != "llama":
        raise ValueError(f"offload_modules: offload is priced for llama only, got model kind {model.kind!r}")
    unpriced = sorted(names - set(PRICED))
    if unpriced:
        raise ValueError(f"offload_modules: {unpriced} not priced yet (mixture-of-experts); priced: {list(PRICED)}")


def layer_offloads(
    model: ModelShape, setup: TrainingSetup, recompute: Recompute | Sequence[RecomputeConfig | None]
) -> list[LayerOffload]:
    """Each layer's device and host bytes under ``recompute`` (a ``RecomputeConfig`` with
    ``offload_modules``, or one config per layer as ``apply_recompute`` takes them; a preset or a
    config without them offloads nothing)."""
    if isinstance(recompute, (str, RecomputeConfig)):
        priced = resolve(model, setup, recompute)
        wanted = per_layer_names(priced.config, model.layers)
        specs = [priced.layer(i, model.layers) for i in range(model.layers)]
    else:
        entries = [c or RecomputeConfig() for c in recompute]
        if len(entries) != model.layers:
            raise ValueError(f"recompute: need one config per layer ({model.layers}), got {len(entries)}")
        one = replace(model, layers=1)
        wanted = per_layer_names(entries, model.layers)
        specs = [resolve(one, setup, c).layer(0, 1) for c in entries]
    _check(model, {n for names in wanted for n in names})
    roles = term_roles(model, setup)
    rotary_done = False
    out = []
    for i, (names, spec) in enumerate(zip(wanted, specs)):
        kept = layer_terms(model, setup, spec)[0]
        if "layer" in names:
            moved = list(kept)
        else:
            chosen = {r for n in names for r in OFFLOADED_ROLES[n]}
            moved = [t for t in kept if roles[t.name] in chosen]
        host = list(moved)
        recomputed_core = "core_attn" in spec.modules
        if "core_attn" in names and setup.attention == "flash" and not recomputed_core:
            host += [t for t in kept if t.name == "proj_input"]  # the kernel's output: the projection keeps it too
        if "layer" in names and not rotary_done:
            host += rotary_terms(model, setup)
            rotary_done = True
        out.append(LayerOffload(i, names, sum(t.nbytes for t in kept), tuple(moved), tuple(host)))
    return out


def offload_price(
    model: ModelShape, setup: TrainingSetup, recompute: Recompute, micro_batches: int = 1
) -> OffloadPrice:
    """The stack's offload: per layer (:func:`layer_offloads`), device and host per job with
    ``micro_batches`` in flight (a pipeline stage holds up to its depth), and the device peak of
    one micro-batch with the worst-case copies in flight in forward and the reload buffer in
    backward (layer ``i``'s backward holds its own terms reloaded and the prefetch of the
    nearest earlier offloading layer)."""
    if not isinstance(micro_batches, int) or micro_batches < 1:
        raise ValueError(f"micro_batches must be a positive int, got {micro_batches!r}")
    priced = resolve(model, setup, recompute)
    layers = layer_offloads(model, setup, recompute)
    rows, plain, in_flight = [], [], []
    previous = 0  # the nearest earlier offloading layer's moved bytes
    for x in layers:
        _, events = layer_terms(model, setup, priced.layer(x.index, model.layers))
        back = layer_backward_peak(x.kept, events)
        plain.append((x.kept, back))
        rows.append((x.device, back + previous + x.twice))  # reloaded, its terms are back (``back`` counts them)
        # A layer's start lets go of all but the nearest earlier offloading layer's storages
        # (the engine's window); copies never done before that, the worst case.
        in_flight.append(x.offloaded + previous)
        previous = x.offloaded if x.host else previous
    rotary = sum(t.nbytes for t in rotary_terms(model, setup))
    prefix, forward = rotary, 0
    for x, held in zip(layers, in_flight):
        prefix += x.device
        forward = max(forward, prefix + held)
    peak = max(stack_peak(rows, rotary), forward)
    return OffloadPrice(tuple(layers), micro_batches, tuple(in_flight), stack_peak(plain, rotary), peak)


__all__ = ["OFFLOADED_ROLES", "LayerOffload", "OffloadPrice", "layer_offloads", "offload_price", "pinned_block"]
