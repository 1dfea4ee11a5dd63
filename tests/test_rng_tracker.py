"""The RNG tracker's streams: each one an independent sequence however forks nest, no two streams
with one name or one seed, and no reset inside a fork."""

from __future__ import annotations

import random

import pytest
import torch

import neuron_ckpt as nc
from neuron_ckpt.distributed.random import RNGStatesTracker, get_rng_state, set_rng_state

SEEDS = {"a": 11, "b": 12, "c": 13}
DEFAULT_SEED = 5


def _nested_program(rng: random.Random, steps: int) -> list[tuple]:
    """A random program of ("open", stream), ("close",) and ("draw", n), forks up to 4 deep, the
    same stream allowed at several depths."""
    program, depth = [], 0
    for _ in range(steps):
        move = rng.choice(["open", "close", "draw", "draw"]) if depth < 4 else rng.choice(["close", "draw"])
        if move == "open":
            program.append(("open", rng.choice(list(SEEDS))))
            depth += 1
        elif move == "close" and depth:
            program.append(("close",))
            depth -= 1
        else:
            program.append(("draw", rng.randint(1, 3)))
    return program + [("close",)] * depth


def _run_nested(program: list[tuple]) -> dict[str, torch.Tensor]:
    """The numbers each stream (and the default one) gives out while ``program`` runs."""
    tracker = RNGStatesTracker()
    torch.manual_seed(DEFAULT_SEED)
    for name, seed in SEEDS.items():
        tracker.add(name, seed)
    drawn: dict[str, list[torch.Tensor]] = {name: [] for name in ["default", *SEEDS]}
    forks, open_names = [], []
    for step in program:
        if step[0] == "open":
            forks.append(tracker.fork(step[1]))
            forks[-1].__enter__()
            open_names.append(step[1])
        elif step[0] == "close":
            forks.pop().__exit__(None, None, None)
            open_names.pop()
        else:
            drawn[open_names[-1] if open_names else "default"].append(torch.rand(step[1]))
    drawn["default"].append(torch.rand(2))  # the default stream goes on after the last fork
    return {k: torch.cat(v) if v else torch.empty(0) for k, v in drawn.items()}


def _unnested(counts: dict[str, int]) -> dict[str, torch.Tensor]:
    """Each stream drawn alone from its seed: what nesting must not change."""
    seeds = {"default": DEFAULT_SEED, **SEEDS}
    return {k: torch.rand(n, generator=torch.Generator().manual_seed(seeds[k])) for k, n in counts.items()}


def test_megatron_example_a_b_a_continues_each_stream():
    program = [("open", "a"), ("draw", 2), ("open", "b"), ("draw", 2), ("open", "a"), ("draw", 2),
               ("close",), ("draw", 2), ("close",), ("draw", 2), ("close",)]  # fmt: skip
    got = _run_nested(program)
    want = _unnested({k: len(v) for k, v in got.items()})
    for k in got:
        assert torch.equal(got[k], want[k]), (k, got[k], want[k])
    # The inner fork of a continues a: its numbers are a's 3rd and 4th, not a repeat of its 1st and 2nd.
    assert not torch.equal(got["a"][:2], got["a"][2:4])


@pytest.mark.parametrize("seed", range(20))
def test_any_nesting_draws_the_unnested_sequences(seed):
    program = _nested_program(random.Random(seed), 60)
    got = _run_nested(program)
    want = _unnested({k: len(v) for k, v in got.items()})
    for k in got:
        assert torch.equal(got[k], want[k]), (k, program)


def test_a_name_or_a_seed_used_twice_is_refused():
    tracker = RNGStatesTracker()
    tracker.add("a", 1)
    with pytest.raises(ValueError, match="RNG stream 'a' already exists"):
        tracker.add("a", 2)
    with pytest.raises(ValueError, match="seed 1 is already the seed of stream 'a'"):
        tracker.add("b", 1)
    tracker.add("b", 2)
    tracker.reset()
    tracker.add("b", 1)  # a reset frees names and seeds


def test_reset_and_reseed_are_refused_inside_a_fork():
    tracker = nc.get_rng_tracker()
    tracker.reset()
    tracker.add("a", 1)
    try:
        with tracker.fork("a"):
            with pytest.raises(RuntimeError, match=r"cannot reset inside fork\('a'\)"):
                tracker.reset()
        with pytest.raises(RuntimeError, match="RNG stream 'zzz' is not set"):
            with tracker.fork("zzz"):
                pass
    finally:
        tracker.reset()


def test_a_snapshot_inside_a_fork_replays_it():
    tracker = RNGStatesTracker()
    torch.manual_seed(DEFAULT_SEED)
    tracker.add("a", 1)
    with tracker.fork("a"):
        torch.rand(3)
        generators, streams = get_rng_state(), tracker.snapshot()
        first = [torch.rand(2)]
        with tracker.fork("a"):
            first.append(torch.rand(2))
    set_rng_state(generators)
    tracker.restore(streams)  # as a recompute does, outside every fork
    second = [torch.rand(2)]
    with tracker.fork("a"):
        second.append(torch.rand(2))
    assert all(torch.equal(x, y) for x, y in zip(first, second))
    assert not torch.equal(first[0], first[1])
