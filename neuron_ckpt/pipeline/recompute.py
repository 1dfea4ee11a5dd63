"""Recompute per pipeline stage, as Megatron defines it.

:func:`~neuron_ckpt.recompute.apply_recompute` works on one stage as on a model (a stage's
``layers`` are its own); this applies it to every stage a rank holds:

* one :class:`RecomputeConfig` applies to each stage on its own: ``method="block",
  num_layers=k`` recomputes the first ``k`` layers *of each stage*, and of each virtual stage
  under an interleaved schedule (Megatron: ``recompute_num_layers`` counts "within each pipeline
  stage", and each virtual-pipeline chunk is its own ``TransformerBlock``); ``method="uniform"``
  groups never cross a stage; selective recompute is per layer anyway. ``k`` must fit the
  smallest stage of the cut (checked on every rank, so all ranks agree);
* a per-layer list over the whole model (``num_hidden_layers`` entries, as the memory planner
  writes one) gives each stage its slice;
* a per-stage list of plans (one entry per stage of the cut, ``p * v``, each a config or a
  per-layer list over that stage's layers) for plans that differ by stage (the first stage keeps
  the most micro-batches in flight under 1F1B and may want more recompute).

Every check passes on every local stage before any is changed. Unit names come back with global
layer indices (``"5.core_attn"``, ``"4"``, ``"4-5"``).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from ..recompute import RecomputeConfig, apply_recompute
from ..recompute.config import validate_per_layer
from .llama_pipeline import LlamaPipeline
from .llama_stage import LlamaStage
from .schedule import recompute_conflict

PerLayer = Sequence[RecomputeConfig | None]
Plan = RecomputeConfig | None | PerLayer | Sequence[RecomputeConfig | None | PerLayer]


def apply_pipeline_recompute(pipeline: LlamaPipeline, plan: Plan, module_map=None) -> list[str]:
    """Apply ``plan`` (module docstring) to every stage ``pipeline`` holds; the recomputed units."""
    cut, stages = pipeline.cut, pipeline.modules
    per_stage = _per_stage(plan, cut.num_layers, cut.num_stages, [len(r) for r in cut.layers])
    for k in range(cut.num_stages):  # every stage of the cut, so every rank refuses the same plans
        _validate(per_stage[k], len(cut.layers[k]), pipeline.modules[0].options.sequence_parallel, k)
        _composes(pipeline.config.schedule, per_stage[k], k)
    names: list[str] = []
    for stage in stages:
        names += apply_stage_recompute(stage, per_stage[stage.stage_index], module_map)
    return names


def apply_stage_recompute(stage: LlamaStage, config, module_map=None) -> list[str]:
    """``apply_recompute`` on one stage, the unit names in global layer indices."""
    first = stage.layer_ids.start
    return [_global_name(name, first) for name in apply_recompute(stage, config, module_map)]


def _per_stage(plan: Plan, num_layers: int, num_stages: int, sizes: list[int]) -> list:
    if plan is None or isinstance(plan, RecomputeConfig):
        return [plan] * num_stages
    if not isinstance(plan, (list, tuple)):
        raise TypeError(f"recompute plan must be a RecomputeConfig, a list or None, got {type(plan).__name__}")
    nested = any(isinstance(entry, (list, tuple)) for entry in plan)
    if not nested and len(plan) == num_layers:  # per layer, whole model
        starts = [sum(sizes[:k]) for k in range(num_stages)]
        return [list(plan[a : a + n]) for a, n in zip(starts, sizes)]
    if len(plan) == num_stages:  # per stage
        return list(plan)
    raise ValueError(
        f"recompute plan: a list needs one entry per layer ({num_layers}) or per stage ({num_stages}), "
        f"got {len(plan)} entries"
    )


def _validate(config, stage_layers: int, sequence_parallel: bool, k: int) -> None:
    try:
        if config is None or isinstance(config, RecomputeConfig):
            (config or RecomputeConfig()).validate(stage_layers, sequence_parallel)
        elif isinstance(config, (list, tuple)):
            validate_per_layer(config, stage_layers, sequence_parallel)
        else:
            raise TypeError(f"got {type(config).__name__}")
    except (ValueError, TypeError) as e:
        raise type(e)(f"recompute plan of stage {k} ({stage_layers} layers): {e}") from None


def _composes(schedule: str, config, k: int) -> None:
    for entry in config if isinstance(config, (list, tuple)) else [config]:
        reason = recompute_conflict(schedule, entry)
        if reason is not None:
            raise ValueError(f"recompute plan of stage {k}: {reason}")


def _global_name(name: str, first: int) -> str:
    """``"0.core_attn"`` / ``"0"`` / ``"0-1"`` of a stage whose first layer is ``first``."""
    match = re.match(r"^(\d+)(?:-(\d+))?(.*)$", name)
    if match is None:  # pragma: no cover - apply_recompute names units by layer index
        return name
    a, b, rest = match.groups()
    span = f"{int(a) + first}" + (f"-{int(b) + first}" if b is not None else "")
    return span + rest
