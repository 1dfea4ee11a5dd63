"""Each pipeline stage draws its dropout from streams of its own.

A stage's forward runs with two streams swapped in: the default stream (CPU and device
generators), seeded ``seed + 100 * stage_index``, and the tensor-parallel stream of the
:func:`~neuron_ckpt.get_rng_tracker` tracker, seeded ``seed + 100 * stage_index + 2718 + tp_rank``.
With one stage per rank that is Megatron's seeding (``seed + 100 * pp_rank``, then its TP offset);
torchtitan also seeds each stage differently. Around the forward the surrounding streams are parked
and put back, so nothing outside the stage (another virtual stage on the same rank, the trainer's
own draws) moves them.

What this gives:

* Stages never share masks: with one seed everywhere, stage 0's layer 0 and stage 1's layer 2
  would draw the same masks for the same micro-batch.
* A stage's masks depend on its index and on the order of its own micro-batches only, not on the
  schedule: interleaved schedules run the virtual stages of a rank in turns, and each turn
  continues its own stream.
* Recompute replays bit-exact: the activation checkpoint snapshots the streams that are live when
  a recomputed unit runs (these) and replays from them in backward, outside the stage's forward.

What it does not give: the masks of pipeline parallelism with dropout are not those of the same
model at ``pp=1`` (one stream, whole batch, one draw per layer), so the pp vs pp=1 parity holds
with dropout off; seeding per global layer and micro-batch would match, at the price of a seed
per layer call (no peer does it).
"""

from __future__ import annotations

import contextlib

from ..distributed.random import (
    MODEL_PARALLEL_RNG,
    TP_SEED_OFFSET,
    RNGState,
    _seed_all,
    get_rng_state,
    get_rng_tracker,
    set_rng_state,
)

STAGE_SEED_OFFSET = 100
"""Megatron's pipeline offset: stage ``k`` seeds its default stream ``seed + 100 * k``."""


def stage_seed(seed: int, stage_index: int) -> int:
    """The default stream's seed of stage ``stage_index``."""
    return seed + STAGE_SEED_OFFSET * stage_index


class StageRNG:
    """The default and tensor-parallel streams of one stage; :meth:`active` runs a block on them."""

    def __init__(self, seed: int, stage_index: int, tp_rank: int):
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise ValueError(f"seed must be an int, got {seed!r}")
        self.seed = stage_seed(seed, stage_index)
        self.default = _drawn_from(self.seed)
        self.tp = _drawn_from(self.seed + TP_SEED_OFFSET + tp_rank)

    @contextlib.contextmanager
    def active(self):
        """Swap the stage's streams in; park them, and put the surrounding ones back, on exit."""
        tracker = get_rng_tracker()
        outer_default, outer_streams = get_rng_state(), tracker.get_states()
        set_rng_state(self.default)
        tracker.set_states({**outer_streams, MODEL_PARALLEL_RNG: self.tp})
        try:
            yield
        finally:
            self.default, self.tp = get_rng_state(), tracker.get_states()[MODEL_PARALLEL_RNG]
            tracker.set_states(outer_streams)
            set_rng_state(outer_default)


def _drawn_from(seed: int) -> RNGState:
    """The generators' state right after seeding them with ``seed`` (the live state is kept)."""
    outer = get_rng_state()
    _seed_all(seed)
    state = get_rng_state()
    set_rng_state(outer)
    return state
