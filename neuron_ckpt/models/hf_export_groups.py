"""What :func:`~.hf_export.save_hf_checkpoint` gathers, group by group, and which rank holds each.

A group is what one gather step brings to rank 0: a decoder layer's parameters together, every
other module alone (the embedding, the final norm, the LM head). Without pipeline parallelism every
rank holds every group. Under pipeline parallelism a group lives on one stage: its ranks (DP rank
0 of that stage's TP group) gather it over TP, then the stage's TP rank 0 sends the full tensors
to global rank 0 (point to point on the default group: gloo on CPU, nccl on CUDA; a pipeline does
not run on XLA, :mod:`neuron_ckpt.pipeline.xla`). The groups of all stages, in stage order, are
known on every rank from one host-side exchange of their names, dtypes and shapes, so rank 0
plans the shards of the whole model before anything is gathered. A tied model's LM head on the
last stage is not exported: ``save_pretrained`` writes the table once, from the first stage.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..distributed import host
from . import hf_conversion

Entry = tuple[str, torch.dtype, tuple[int, ...]]  # transformers key, dtype on disk, full shape


@dataclass
class ExportGroup:
    entries: list[Entry]
    params: list[tuple[str, torch.nn.Parameter]] | None
    """This rank's parameters of the group (key, parameter), None when another stage holds it."""
    owner: int
    """The global rank that holds the gathered tensors (0 without pipeline parallelism)."""


def named_groups(module: torch.nn.Module) -> list[list[tuple[str, torch.nn.Parameter]]]:
    """``module``'s parameters by gather step, ``transformers`` keys (a stage's tied LM head left out)."""
    skip = getattr(module, "tied_weight", None) if not getattr(module, "is_first", True) else None
    groups: dict[str, list] = {}
    for name, p in module.named_parameters():
        if p is skip:
            continue
        parts = name.split(".")
        key = ".".join(parts[:2]) if parts[0] == "layers" else parts[0]
        groups.setdefault(key, []).append((hf_conversion.to_hf_name(name), p))
    return list(groups.values())


def _entries(group: list[tuple[str, torch.nn.Parameter]], dtype: torch.dtype | None, tp_size: int) -> list[Entry]:
    return [(key, dtype or p.dtype, hf_conversion.full_shape(p, tp_size)) for key, p in group]


def export_groups(model: Any, dtype: torch.dtype | None) -> list[ExportGroup]:
    """Every group of the whole model in order, each with this rank's parameters (if it holds them)."""
    state = model.parallel_state
    if state.pp_size == 1:
        return [ExportGroup(_entries(g, dtype, state.tp_size), g, 0) for g in named_groups(model)]
    local = {m.stage_index: named_groups(m) for m in model.modules}
    described = {k: [_entries(g, dtype, state.tp_size) for g in groups] for k, groups in local.items()}
    stages: dict[int, list[list[Entry]]] = {}
    for theirs in host.gather(described):  # every rank's stages; the same entries on every TP / DP rank
        stages.update(theirs)
    out = []
    for k in sorted(stages):
        owner = model.cut.rank_of_stage(k) * state.dp_size * state.tp_size  # that stage's DP 0, TP 0
        for i, entries in enumerate(stages[k]):
            out.append(ExportGroup(entries, local[k][i] if k in local else None, owner))
    return out


def to_rank0(group: ExportGroup, full: list[tuple[str, torch.Tensor]] | None, device: torch.device):
    """Under pipeline parallelism: the owner sends ``full`` to global rank 0, which receives it
    (returned there); every other rank returns ``full`` unchanged (None, or a gather it made)."""
    rank = dist.get_rank()
    if group.owner == 0 or rank not in (0, group.owner):
        return full
    if rank == group.owner:
        for _, tensor in full:  # type: ignore[union-attr]  # the owner gathered it
            dist.send(tensor.contiguous(), dst=0)
        return None
    out = []
    for key, dtype, shape in group.entries:
        buffer = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(buffer, src=group.owner)
        out.append((key, buffer))
    return out
