"""Initialisation that does not depend on the tensor-parallel degree.

Every rank draws the *full* weight from the default CPU generator (seeded identically on all
ranks) and keeps its slice. A layer built at t=1 and at t=4 from the same seed therefore holds
the same full weight, and every rank advances the default generator identically, so replicated
parameters built later agree too. The cost is a transient full-size tensor on the host during
construction (for Llama-2 7B, at most the 32000 x 4096 embedding: 0.5 GB fp32).

A model built from one ``seed`` draws each part from the default generator seeded for that part
(:func:`drawn_for`: the embedding, each layer by its global index, the head), so the same seed
gives the same model whatever builds it: ``LlamaForCausalLM`` whole, or the stages of any
pipeline cut (a stage never has to draw the parts before it).
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from collections.abc import Callable, Iterator

import torch

InitMethod = Callable[[torch.Tensor], object]


def default_init(weight: torch.Tensor) -> None:
    """``torch.nn.Linear``'s default: kaiming-uniform with a=sqrt(5) on the full fan-in."""
    torch.nn.init.kaiming_uniform_(weight, a=math.sqrt(5))


def normal_init(std: float) -> InitMethod:
    """N(0, std^2), the GPT / Llama convention (``initializer_range``)."""
    return lambda w: torch.nn.init.normal_(w, mean=0.0, std=std)


def shard_of_full(
    full_shape: tuple[int, ...],
    partition_dim: int,
    index: int,
    num_shards: int,
    init_method: InitMethod,
    dtype: torch.dtype,
    device: torch.device | str | None,
) -> torch.Tensor:
    """Draw the full tensor on CPU in fp32 with ``init_method``; return shard ``index`` of ``num_shards``."""
    full = torch.empty(full_shape, dtype=torch.float32)
    init_method(full)
    shard = full.chunk(num_shards, dim=partition_dim)[index]
    return shard.to(dtype=dtype, device=device).contiguous()


def part_seed(seed: int, part: str) -> int:
    """The seed a part of the model is drawn from: ``seed`` and the part's name, hashed."""
    digest = hashlib.blake2b(f"{seed}/{part}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # torch.manual_seed takes up to 2**63 - 1


@contextlib.contextmanager
def drawn_for(seed: int | None, part: str) -> Iterator[None]:
    """Build a part with the default CPU generator (where the parallel layers draw full weights)
    seeded for it by :func:`part_seed`; the live generator is put back afterwards. ``seed`` None:
    draw from the live generator as it stands (no reseeding)."""
    if seed is None:
        yield
        return
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(part_seed(seed, part))
        yield


def check_divisible(value: int, name: str, tp_size: int) -> None:
    if value % tp_size:
        raise ValueError(
            f"{name}={value} is not divisible by the tensor-parallel size {tp_size}; "
            f"choose {name} as a multiple of {tp_size}"
        )
