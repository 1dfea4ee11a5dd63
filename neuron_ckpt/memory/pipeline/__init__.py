"""Pipeline parallelism's memory: each stage's peak under a schedule, and recompute planned per stage.

::

    from neuron_ckpt.memory.pipeline import PipelineSetup, plan_pipeline, stage_budgets

    pipeline = PipelineSetup(pp=8, microbatches=256, schedule="1f1b")   # or "gpipe", "interleaved" + virtual_stages
    budgets = stage_budgets(model, setup, pipeline, "selective")         # one StageBudget per rank
    plan = plan_pipeline(model, setup, pipeline, "trn1")                 # recompute per stage, per layer

:mod:`.schedule` writes the order torch 2.13 runs each rank's forwards and backwards in and
counts the micro-batches in flight from it; :mod:`.cut` says where the layers are cut;
:mod:`.stage_budget` adds up one rank's memory over its order; :mod:`.stage_planner` picks each
stage's recompute and, when nothing fits, the smallest pipeline degree that would.
"""

from .cut import PipelineSetup
from .schedule import SCHEDULES, closed_form_in_flight, peak_in_flight, rank_order
from .stage_budget import StageBudget, stage_budgets
from .stage_planner import PipelinePlan, StagePlan, plan_pipeline, smallest_pp

__all__ = [
    "SCHEDULES",
    "PipelinePlan",
    "PipelineSetup",
    "StageBudget",
    "StagePlan",
    "closed_form_in_flight",
    "peak_in_flight",
    "plan_pipeline",
    "rank_order",
    "smallest_pp",
    "stage_budgets",
]
