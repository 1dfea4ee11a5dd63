"""Initialisation that does not depend on the tensor-parallel degree.

Every rank draws the *full* weight from the default CPU generator (seeded identically on all
ranks) and keeps its slice. A layer built at t=1 and at t=4 from the same seed therefore holds
the same full weight, and every rank advances the default generator identically, so replicated
parameters built later agree too. The cost is a transient full-size tensor on the host during
construction (for Llama-2 7B, at most the 32000 x 4096 embedding: 0.5 GB fp32).
"""

from __future__ import annotations

import math
from collections.abc import Callable

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


def check_divisible(value: int, name: str, tp_size: int) -> None:
    if value % tp_size:
        raise ValueError(
            f"{name}={value} is not divisible by the tensor-parallel size {tp_size}; "
            f"choose {name} as a multiple of {tp_size}"
        )
