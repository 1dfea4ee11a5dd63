"""``neuron-ckpt plan --pp P``: recompute planned per pipeline stage.

::

    neuron-ckpt plan --config llama3.1-70b --tp 32 --dp 4 --seq 8192 --device-memory trn1 \\
        --pp 8 --micro-batches 256 [--schedule gpipe|1f1b|interleaved] [--virtual-stages V] \\
        [--stage-layers 9,10,...] [--pipeline-buffers torch|none] [--json]

:mod:`..plan_cli` parses and checks the shared options and hands ``--pp`` above 1 here. Prints
the memory planned for, one row per stage (layers, micro-batches in flight at its most, its
activations and peak, the recompute chosen and its share of the stage's FLOPs), then the line
items of the stage that needs the most. ``--json`` prints :meth:`~.stage_planner.PipelinePlan.to_dict`
with the model and the attention notes. Exit 0 when every stage fits; 1 when one does not (the
reason and the smallest pipeline degree that would fit on stderr).
"""

from __future__ import annotations

import argparse
import json
import sys

from ..budget import GIB
from ..shape import ModelShape, TrainingSetup
from .cut import BUFFERS, PipelineSetup
from .schedule import SCHEDULES, closed_form_in_flight
from .stage_planner import PipelinePlan, plan_pipeline

PIPELINE_ONLY = ("virtual_stages", "schedule", "stage_layers", "pipeline_buffers")


def _stage_layers(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated layer counts such as 9,10,10,11, got {text!r}"
        ) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The pipeline options of ``neuron-ckpt plan``."""
    parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel degree (default 1: no pipeline)")
    parser.add_argument(
        "--micro-batches",
        type=int,
        default=None,
        help="micro-batches per step per data-parallel replica (needed with --pp > 1; NxD's "
        "recipes: global batch / dp / micro-batch)",
    )
    parser.add_argument(
        "--schedule",
        choices=SCHEDULES,
        default=None,
        help="pipeline schedule as torch 2.13 runs it (default 1f1b; interleaved needs --virtual-stages >= 2)",
    )
    parser.add_argument("--virtual-stages", type=int, default=None, help="model chunks per pipeline rank (interleaved)")
    parser.add_argument(
        "--stage-layers",
        type=_stage_layers,
        default=None,
        help="decoder layers per virtual stage, comma-separated (default: LlamaPipeline's cut, "
        "balanced by cost with the embedding and the head counted)",
    )
    parser.add_argument(
        "--pipeline-buffers",
        choices=BUFFERS,
        default=None,
        help="torch (default): count torch PipelineStage's per-micro-batch receive buffers and "
        "held outputs; none: leave them out (another runtime, such as NxD's)",
    )


def pipeline_from_args(args: argparse.Namespace) -> PipelineSetup | None:
    """The :class:`PipelineSetup` the options describe; None with ``--pp 1`` (refusing the
    options that only a pipeline takes)."""
    if args.micro_batches is not None and args.micro_batches < 1:
        raise ValueError(f"--micro-batches must be a positive integer, got {args.micro_batches}")
    if args.pp == 1:
        given = [f"--{n.replace('_', '-')}" for n in PIPELINE_ONLY if getattr(args, n) is not None]
        if given:
            raise ValueError(
                f"{', '.join(given)} {'applies' if len(given) == 1 else 'apply'} to a pipeline: give --pp > 1"
            )
        return None
    if not (isinstance(args.pp, int) and args.pp >= 1):
        raise ValueError(f"--pp must be a positive integer, got {args.pp}")
    if args.micro_batches is None:
        raise ValueError(
            "--micro-batches is required with --pp > 1 (micro-batches per step per data-parallel "
            "replica; NxD's 70B recipes: 1024 / dp 4 = 256)"
        )
    schedule = args.schedule or "1f1b"
    virtual = args.virtual_stages if args.virtual_stages is not None else 1
    return PipelineSetup(
        args.pp, args.micro_batches, schedule, virtual, args.stage_layers, args.pipeline_buffers or "torch"
    )


def _notes(plan: PipelinePlan) -> list[str]:
    """Where the textbook count of micro-batches in flight differs from torch's order."""
    p = plan.pipeline
    notes = []
    for stage in plan.stages:
        closed = closed_form_in_flight(p.schedule, p.pp, p.microbatches, stage.budget.rank, p.virtual_stages)
        if closed != stage.budget.microbatches_in_flight:
            notes.append(
                f"stage {stage.budget.rank} holds {stage.budget.microbatches_in_flight} chunk forwards at "
                f"its most in torch's order; the closed form (Megatron's warm-up + 1) says {closed}"
            )
    if p.buffers == "torch":
        notes.append("pipeline buffers: torch 2.13's PipelineStage (not NxD's runtime: --pipeline-buffers none)")
    return notes


def _print(model: ModelShape, setup: TrainingSetup, plan: PipelinePlan, notes: list[str]) -> None:
    p = plan.pipeline
    print(
        f"{model.name or model.kind}: L={model.layers} h={model.hidden} a={model.heads} g={model.kv_heads} "
        f"f={model.ffn} v={model.vocab} | tp={setup.tp} dp={setup.dp} s={setup.seq_len} b={setup.micro_batch} "
        f"{setup.dtype} sequence_parallel={setup.sequence_parallel} zero1={setup.zero1} attention={setup.attention}"
    )
    print(
        f"pipeline: pp={p.pp} {p.schedule} m={p.microbatches} virtual_stages={p.virtual_stages} "
        f"layers per virtual stage {list(p.cut(model.layers))}"
    )
    print(f"memory to plan for: {plan.limit_bytes / GIB:.2f} GiB (device memory less the reserve)\n")
    header = f"{'stage':>5}  {'layers':>6}  {'in flight':>9}  {'act GiB':>8}  {'total GiB':>9}  {'fits':<4}  recompute"
    print(header)
    for stage in plan.stages:
        b = stage.budget
        print(
            f"{b.rank:>5}  {b.layers:>6}  {b.microbatches_in_flight:>9}  {b.activation_bytes / GIB:>8.2f}  "
            f"{b.total_bytes / GIB:>9.2f}  {'yes' if stage.fits else 'no':<4}  {stage.describe()} "
            f"({stage.overhead:.2%} of the stage's FLOPs)"
        )
    heaviest = max(plan.stages, key=lambda s: s.budget.total_bytes)
    print(f"\nstage {heaviest.budget.rank}, the most loaded, line by line:")
    print(heaviest.budget.budget.table())
    for note in (*heaviest.budget.budget.notes, *notes):
        print(f"note: {note}")


def run(
    args: argparse.Namespace,
    model: ModelShape,
    setup: TrainingSetup,
    pipeline: PipelineSetup,
    device_gib: float,
    attention_notes: list[str],
) -> int:
    """Plan every stage and print it; 0 when every stage fits, 1 otherwise."""
    plan = plan_pipeline(model, setup, pipeline, device_gib, reserve_gib=args.reserve)
    notes = [*attention_notes, *_notes(plan)]
    if args.json:
        out = plan.to_dict()
        out.update(
            model=model.name or model.kind,
            attention=setup.attention,
            attention_notes=attention_notes,
            notes=notes,
            message=plan.message(),
        )
        print(json.dumps(out, indent=2))
    else:
        _print(model, setup, plan, notes)
    if not plan.fits:
        print(f"neuron-ckpt plan: {plan.message()}", file=sys.stderr)
        return 1
    return 0


__all__ = ["add_arguments", "pipeline_from_args", "run"]
