"""A rank's place in a sharded checkpoint: which model files it writes and reads, under TP x CP x DP x PP.

The model is the same on every DP and CP rank, so one rank per (pipeline stage, TP rank) writes
its slice: DP rank 0 and CP rank 0. Without pipeline parallelism the files are named by TP rank alone
(``model_tp00001-...``, format 2 as it was); with ``pp_size > 1`` by stage and TP rank
(``model_pp00001_tp00000-...``): each stage's ranks write their own stage's parameters. The
optimizer slices, data order and RNG streams stay per rank (``rank_NNNNN``), so every stage's
ZeRO-1 shards and dropout streams are saved by the ranks that hold them.

``meta.json`` records ``pp_size`` and ``cp_size`` beside ``tp_size`` and ``dp_size``; a checkpoint
written before pipeline (context) parallelism has none and counts as ``pp_size`` (``cp_size``) 1
(:data:`ABSENT`). Another CP degree is refused too (the ZeRO-1 slices are cut over DP x CP). A run at
another pipeline degree is refused at load, as another TP or DP degree is (the stages hold other
layers and their files other slices); the weights move through a ``transformers`` export.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

ABSENT = {"pp_size": 1, "cp_size": 1}
"""What a field missing from an older checkpoint's meta.json means."""


@dataclass(frozen=True)
class Placement:
    tp_rank: int = 0
    tp_size: int = 1
    dp_rank: int = 0
    dp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    cp_rank: int = 0
    cp_size: int = 1

    @classmethod
    def of(cls, parallel_state: Any) -> Placement:
        """From anything with ``tp_rank``, ``tp_size``, ``dp_rank``, ``dp_size`` (and ``pp_rank``,
        ``pp_size``, ``cp_rank``, ``cp_size``: 0 and 1 when absent)."""
        ps = parallel_state
        return cls(
            ps.tp_rank, ps.tp_size, ps.dp_rank, ps.dp_size, getattr(ps, "pp_rank", 0), getattr(ps, "pp_size", 1),
            getattr(ps, "cp_rank", 0), getattr(ps, "cp_size", 1),
        )  # fmt: skip

    @property
    def world_size(self) -> int:
        return self.tp_size * self.cp_size * self.dp_size * self.pp_size

    @property
    def writes_shared(self) -> bool:
        """This rank writes the shared (model) files of its stage and TP rank."""
        return self.dp_rank == 0 and self.cp_rank == 0

    def shared_prefix(self, key: str, tp_rank: int | None = None, pp_rank: int | None = None) -> str:
        """The file prefix of ``key``'s slice of TP rank ``tp_rank`` on stage ``pp_rank`` (default: this rank's)."""
        tp = self.tp_rank if tp_rank is None else tp_rank
        if self.pp_size == 1:
            return f"{key}_tp{tp:05d}"
        return f"{key}_pp{self.pp_rank if pp_rank is None else pp_rank:05d}_tp{tp:05d}"

    def shared_prefixes(self, key: str) -> list[str]:
        """Every (stage, TP rank)'s prefix of ``key``, stage-major."""
        return [self.shared_prefix(key, t, s) for s in range(self.pp_size) for t in range(self.tp_size)]

    def info(self, rank: int) -> dict[str, str]:
        """The metadata written into this rank's safetensors files."""
        out = {"rank": str(rank), "tp_rank": str(self.tp_rank), "dp_rank": str(self.dp_rank)}
        out = out if self.pp_size == 1 else {**out, "pp_rank": str(self.pp_rank)}
        return out if self.cp_size == 1 else {**out, "cp_rank": str(self.cp_rank)}

    def meta(self) -> dict[str, int]:
        return {"tp_size": self.tp_size, "dp_size": self.dp_size, "pp_size": self.pp_size, "cp_size": self.cp_size}


def saved(meta: dict[str, Any], key: str) -> Any:
    """``meta[key]``, or what its absence means (:data:`ABSENT`)."""
    return meta.get(key, ABSENT.get(key))
