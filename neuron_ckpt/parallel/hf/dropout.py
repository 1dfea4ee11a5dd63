"""Attention whose heads the plan splits draws its dropout from the tensor-parallel RNG stream."""

from __future__ import annotations

from typing import Any

import torch

from ...distributed.random import get_rng_tracker
from .style import Target


def split_attention_with_dropout(model: torch.nn.Module, targets: list[Target]) -> list[str]:
    """Attention modules whose heads the plan splits (a ``colwise`` child) and that drop out."""
    names = {t.name.rpartition(".")[0] for t in targets if t.param is None and t.style == "colwise" and "." in t.name}
    return sorted(n for n in names if _attention(model.get_submodule(n))
                  and getattr(model.get_submodule(n), "attention_dropout", 0) > 0)  # fmt: skip


def _attention(module: torch.nn.Module) -> bool:
    """An attention module: it has a head size (multi-head latent attention: its query-key one)."""
    return any(isinstance(getattr(module, a, None), int) for a in ("head_dim", "qk_head_dim"))


def draw_from_the_tp_stream(attention: torch.nn.Module) -> None:
    """Run ``attention``'s forward inside ``get_rng_tracker().fork()``: its dropout, on this rank's
    heads only, then draws a mask of its own on each rank (as our ``CoreAttention`` does) instead
    of the same pattern on every rank from the default generator. The projections draw nothing."""
    forks: list[Any] = []

    def enter(module, args):
        forks.append(get_rng_tracker().fork())
        forks[-1].__enter__()

    def leave(module, args, output):
        forks.pop().__exit__(None, None, None)

    attention.register_forward_pre_hook(enter)
    attention.register_forward_hook(leave, always_call=True)
