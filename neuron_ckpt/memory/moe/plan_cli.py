"""``neuron-ckpt plan --config FILE`` for a transformers model: the whole job budgeted and its
recompute planned per layer kind, for every family ``apply_tensor_parallel`` splits.

::

    neuron-ckpt plan --config mixtral-8x7b --tp 8 --dp 8 --ep 8 [--ep-rows balanced|worst|N] \\
        --seq 4096 --device-memory 80 [--attention sdpa|eager|sdpa-fused] [--experts grouped_mm|eager] \\
        [--dtype bf16] [--zero1|--no-zero1] [--sequence-parallel|--no-sequence-parallel] [--json]

:mod:`neuron_ckpt.memory.plan_cli` hands it here when ``--config`` names another family than
``llama`` (:func:`wanted`), or with ``--model transformers`` (a Llama config then plans
transformers' ``LlamaForCausalLM``, not this library's). The file is read as ``neuron-ckpt memory
--config`` reads it (:func:`~.config.load_moe_config`); the model is a
:class:`~.model.TransformersModel`, planned by the planner that plans Llama
(:func:`~neuron_ckpt.memory.planner.plan_recompute`). Prints the budget, the plan (layers per
option per kind, the per-layer list ``apply_recompute`` takes) and the uniform choices; exit 0 when
it fits, 1 when nothing does (what would, on stderr), 2 with one line for bad input (every
problem of the job named at once: ``E % ep``, ``tp x dp % ep``, ``s % t``, the split).

``--pp P --micro-batches M [--schedule gpipe|1f1b] [--stage-layers ...]``: every rank's stage
planned on its own (:mod:`.stages`: as a Megatron-style pipeline would run it; the package
pipelines its own Llama only), one row per stage and the budget of the one that needs the most;
nothing fits on a stage: exit 1 and the smallest ``--pp`` at which every stage fits.

Not here: ``--cp`` above 1 (context parallelism runs this library's Llama only), the host-memory
and checkpoint lines (priced for ``train.py``'s Llama).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..budget import GIB
from ..plan_shared import DEFAULT_BUCKET_CAP_MB, GPT_ONLY, device_gib, plan_line, recompute_text
from ..planner import NothingFits, Plan, evaluate, longest_sequence, plan_recompute
from ..shape import TrainingSetup
from . import all_gather
from .config import config_path, load_moe_config
from .experts import expert_weight_bytes, received_rows
from .families import FAMILY
from .model import TransformersModel
from .report import describe
from .shape import EP_DISPATCH, EP_ROWS, EXPERTS
from .stages import StagePlan, plan_stages, smallest_pp

FAMILY_ONLY = ("ep", "ep_rows", "ep_dispatch", "capacity_factor", "experts")


def _ep_rows(text: str) -> str | int:
    if text in EP_ROWS:
        return text
    try:
        rows = int(text)
    except ValueError:
        rows = -1
    if rows < 0:
        raise argparse.ArgumentTypeError(f"expected one of {EP_ROWS} or a row count >= 0, got {text!r}")
    return rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options only a transformers model takes."""
    parser.add_argument("--ep", type=int, default=None, help="transformers MoE: expert_model_parallel_size (default 1)")
    parser.add_argument(
        "--ep-rows",
        type=_ep_rows,
        default=None,
        help="with --ep: the rows each rank's experts receive: balanced (default), worst (dropless worst case) or N",
    )
    parser.add_argument(
        "--ep-dispatch",
        choices=EP_DISPATCH,
        default=None,
        help="with --ep: all_to_all (dropless, default; eager backends) or all_gather (XLA's static form)",
    )
    parser.add_argument(
        "--capacity-factor",
        type=float,
        default=None,
        help="with --ep-dispatch all_gather: each expert's slots, ceil(N k / E x cf) (default: dropless, N)",
    )
    parser.add_argument("--experts", choices=EXPERTS, default=None, help="transformers MoE: experts implementation")


def model_type(config: str | None) -> str | None:
    """The ``model_type`` of a config file, directory or preset (None when there is none to read)."""
    if config is None:
        return None
    try:
        data = json.loads(Path(config_path(config)).read_text())
    except (ValueError, OSError):
        return None
    return data.get("model_type") if isinstance(data, dict) else None


def wanted(args: argparse.Namespace) -> bool:
    """Whether the arguments describe a transformers model (``--model transformers``, or a
    ``--config`` of another family than Llama with ``--model`` left out)."""
    if args.model is not None:
        return args.model == "transformers"
    kind = model_type(args.config)
    return kind is not None and kind != "llama"


def refuse_for_llama(args: argparse.Namespace) -> None:
    """One line when an option only a transformers model takes is given for another."""
    given = [f"--{n.replace('_', '-')}" for n in FAMILY_ONLY if getattr(args, n, None) is not None]
    if given:
        raise ValueError(
            f"{', '.join(given)}: for transformers MoE models (--config of an MoE family, or --model transformers); "
            f"--model {args.model or 'llama'} plans this library's {args.model or 'llama'}, which has no experts"
        )


def build(args: argparse.Namespace, notices: list[str]) -> tuple[TransformersModel, TrainingSetup]:
    """The model and job the arguments describe; one ``ValueError`` naming every problem."""
    given = [f"--{n}" for n in GPT_ONLY if getattr(args, n, None) is not None]
    if given:
        raise ValueError(f"{', '.join(given)}: for --model gpt; a transformers model's shape comes from --config")
    llama_only = ("recompute_modules", "host_link", "device_tflops", "offload_modules")
    offload = [f"--{n.replace('_', '-')}" for n in llama_only if getattr(args, n, None)]
    if offload:
        raise ValueError(f"{', '.join(offload)}: offload and a chosen recompute set are planned for --model llama only")
    if args.config is None:
        raise ValueError("--model transformers needs --config (a config.json, a directory holding one, or a preset)")
    if args.pipeline_buffers is not None:
        raise ValueError(
            "--pipeline-buffers: a transformers model's stages are priced without a runtime's buffers (the package "
            "pipelines its own Llama only); the received input and sent output per micro-batch are counted"
        )
    if args.bucket_cap_mb is not None and not args.zero1:
        raise ValueError("--bucket-cap-mb sizes ZeRO-1's buckets; with --no-zero1 there are none: drop it")
    shape = load_moe_config(args.config, notices)
    family = FAMILY[shape.family]
    attention = args.attention or ("eager" if family.eager_only else "sdpa")
    if attention in ("flash", "explicit"):
        raise ValueError(
            f"--attention {attention} is this library's Llama's; a transformers model takes transformers' "
            "implementation: sdpa, eager or sdpa-fused"
        )
    if args.experts is not None and not family.moe:
        raise ValueError(f"--experts: {shape.family} has no experts (a dense family)")
    ep, rows = args.ep or 1, args.ep_rows if args.ep_rows is not None else "balanced"
    if ep == 1 and args.ep_rows is not None:
        raise ValueError("--ep-rows: the rows an expert-parallel rank receives; give --ep above 1")
    if ep == 1 and args.ep_dispatch is not None:
        raise ValueError("--ep-dispatch: how tokens reach an expert-parallel rank's experts; give --ep above 1")
    dispatch = args.ep_dispatch or "all_to_all"
    if args.capacity_factor is not None and dispatch != "all_gather":
        raise ValueError("--capacity-factor: the all-gather form's slots per expert; give --ep-dispatch all_gather")
    model = TransformersModel(shape, attention, args.experts or "grouped_mm", ep, rows, dispatch, args.capacity_factor)
    bucket = DEFAULT_BUCKET_CAP_MB if args.bucket_cap_mb is None else args.bucket_cap_mb
    setup = TrainingSetup(
        seq_len=args.seq, micro_batch=args.micro_batch, tp=args.tp, dp=args.dp, dtype=args.dtype,
        sequence_parallel=args.sequence_parallel, zero1=args.zero1, bucket_cap_mb=bucket, cp=args.cp,
        attention="explicit" if attention == "eager" else "flash",
    )  # fmt: skip
    model.check(setup)
    return model, setup


def counts_by_kind(model: TransformersModel, plan: Plan) -> dict[str, dict[str, int]]:
    """Layers per option per layer kind."""
    out: dict[str, dict[str, int]] = {}
    for i, name in enumerate(plan.layers):
        kind = model.shape.kind_of(i)
        option = name.removeprefix(f"{kind}:")
        out.setdefault(kind, {})
        out[kind][option] = out[kind].get(option, 0) + 1
    return out


def alternatives(model: TransformersModel, setup: TrainingSetup, plan: Plan) -> list[Plan]:
    """The same choice on every layer, for each choice every kind offers."""
    labels = [n.partition(":")[2] or n for n in plan.options]
    common = [n for n in dict.fromkeys(labels) if labels.count(n) == len(model.shape.kinds)]
    return [evaluate(model, setup, n, plan.limit_bytes, plan.options) for n in common]


def _capacity(model: TransformersModel) -> str:
    cf = model.capacity_factor
    return "dropless" if cf is None else f"capacity factor {cf}"


def _header(model: TransformersModel, setup: TrainingSetup) -> str:
    s, ms = model.shape, model.layer_setup(setup)
    ep = ""
    if model.ep > 1:
        how = model.ep_rows if model.ep_dispatch == "all_to_all" else f"all_gather, {_capacity(model)}"
        ep = (
            f" ep={model.ep} edp={model.expert_data_parallel(setup)} ({how}: "
            f"{received_rows(s, ms):,} rows per MoE layer)"
        )
    return (
        f"{model.name} ({s.family}): {describe(s)}\n"
        f"tp={setup.tp} dp={setup.dp}{ep} s={setup.seq_len} b={setup.micro_batch} {setup.dtype} "
        f"sequence_parallel={setup.sequence_parallel} zero1={setup.zero1} attention={model.attention}"
        + (f" experts={model.experts}" if s.experts else "")
    )


def _notes(model: TransformersModel, setup: TrainingSetup) -> list[str]:
    s, ms = model.shape, model.layer_setup(setup)
    notes = [
        (
            "transformers' layers as apply_tensor_parallel splits them, as eager torch runs them (docs/memory.md; on "
            "XLA the compiler decides what is kept); host memory and checkpoint size: priced for train.py's Llama only"
        )
    ]
    if s.experts and FAMILY[s.family].experts not in (None, "all"):
        weights = expert_weight_bytes(s, ms) / 2**20
        where = f"E/{model.ep} whole experts" if model.ep > 1 else "every expert at 1/t of its width"
        notes.append(f"routed experts' weights per MoE layer per rank: {weights:,.1f} MiB ({where})")
    if model.ep > 1 and model.ep_dispatch == "all_gather" and s.experts:
        rank, group = all_gather.dropped_worst(s, ms)
        notes.append(
            f"all-gather dispatch, {_capacity(model)}: {all_gather.capacity(s, ms):,} slots per expert; routes "
            f"dropped per MoE layer at worst: {rank:,} on a rank, {group:,} in the EP group (none when balanced "
            "at a factor of 1 or more)"
        )
    return notes


def _print(model: TransformersModel, setup: TrainingSetup, plan: Plan, notes: list[str]) -> None:
    print(_header(model, setup))
    print(f"memory to plan for: {plan.limit_bytes / GIB:.2f} GiB (device memory less the reserve)\n")
    print(plan.budget.table())
    for note in (*plan.budget.notes, *notes):
        print(f"note: {note}")
    print(f"\n{plan_line(plan)}")
    print(f"recompute: {recompute_text(plan)}")
    print("\nalternatives (the same choice on every layer):")
    for alt in alternatives(model, setup, plan):
        verdict = "fits" if alt.fits else "does not fit"
        name = alt.layers[0].partition(":")[2] or alt.layers[0]
        print(f"  {name:<34}{alt.budget.total_gib:>8.2f} GiB  {verdict:<13} recompute {alt.overhead:.2%}")
    step = model.static_items(setup)[1]
    print(f"\noptimizer step: transient {step / GIB:.2f} GiB per device (fp32 slices + one bucket)")


def run(args: argparse.Namespace) -> int:
    """``neuron-ckpt plan`` for a transformers model: 0 when it fits, 1 when nothing does."""
    from ..pipeline.plan_cli import pipeline_from_args

    notices: list[str] = []
    model, setup = build(args, notices)
    pipeline = pipeline_from_args(args)
    memory = device_gib(args)
    if pipeline is not None:
        return _run_pipeline(args, model, setup, pipeline, memory, notices)
    if args.longest_seq and model.ep > 1 and setup.tp > 1 and not setup.sequence_parallel:
        raise ValueError("--longest-seq with --ep above 1 and tp above 1 needs --sequence-parallel (s steps by tp)")
    longest = longest_sequence(model, setup, memory, reserve_gib=args.reserve) if args.longest_seq else None
    notes = _notes(model, setup)
    head = {"family": model.shape.family, "name": model.name, "attention": model.attention,
            "experts": model.experts, "ep": model.ep, "ep_rows": model.ep_rows,
            "ep_dispatch": model.ep_dispatch, "capacity_factor": model.capacity_factor,
            "edp": model.expert_data_parallel(setup), "notices": notices}  # fmt: skip
    try:
        plan = plan_recompute(model, setup, memory, reserve_gib=args.reserve)
    except NothingFits as exc:
        if args.json:
            out = {"fits": False, **head, "message": str(exc), "smallest_tp": exc.smallest_tp,
                   "largest_micro_batch": exc.largest_micro_batch, "least_memory": exc.least.to_dict()}  # fmt: skip
            if args.longest_seq:
                out["longest_seq"] = longest
            print(json.dumps(out, indent=2))
        else:
            for notice in notices:
                print(notice)
            if args.longest_seq:
                print(_longest_text(model, setup, longest))
        print(f"neuron-ckpt plan: {exc}", file=sys.stderr)
        return 1
    if args.json:
        out = {
            **plan.to_dict(),
            **head,
            "counts_by_kind": counts_by_kind(model, plan),
            "notes": notes,
            "optimizer_step": {"transient_bytes": model.static_items(setup)[1]},
        }
        out["alternatives"] = {
            alt.layers[0].partition(":")[2] or alt.layers[0]: {
                "total_gib": round(alt.budget.total_gib, 4), "fits": alt.fits, "overhead": alt.overhead}
            for alt in alternatives(model, setup, plan)
        }  # fmt: skip
        if args.longest_seq:
            out["longest_seq"] = longest
        print(json.dumps(out, indent=2))
        return 0
    for notice in notices:
        print(notice)
    _print(model, setup, plan, notes)
    if args.longest_seq:
        print(_longest_text(model, setup, longest))
    return 0


def _longest_text(model: TransformersModel, setup: TrainingSetup, longest: int | None) -> str:
    where = (f"tp={setup.tp} ep={model.ep} dp={setup.dp} micro-batch {setup.micro_batch}, {model.attention} "
             "attention")  # fmt: skip
    return f"longest sequence that fits: {'none' if longest is None else f'{longest} tokens'} at {where}"


def _run_pipeline(args, model: TransformersModel, setup: TrainingSetup, pipeline, memory: float, notices) -> int:
    """``--pp`` above 1: every rank's stage planned on its own (:mod:`.stages`)."""

    if args.longest_seq:
        raise ValueError("--longest-seq: not with --pp above 1 for a transformers model")
    stages = plan_stages(model, setup, pipeline, memory, args.reserve)
    ok = all(st.plan is not None for st in stages)
    smallest = None if ok else smallest_pp(model, setup, pipeline, memory, args.reserve)
    worst = max(stages, key=lambda st: (st.plan is None, st.budget.total_bytes))
    limit = stages[0].plan.limit_bytes if stages[0].plan is not None else stages[0].nothing.least.limit_bytes  # type: ignore[union-attr]  # one is set
    if args.json:
        out = {"fits": ok, "family": model.shape.family, "name": model.name, "pp": pipeline.pp,
               "microbatches": pipeline.microbatches, "schedule": pipeline.schedule, "ep": model.ep,
               "edp": model.expert_data_parallel(setup), "limit_bytes": limit, "smallest_pp": smallest,
               "notices": notices, "stages": [_stage_dict(st) for st in stages]}  # fmt: skip
        print(json.dumps(out, indent=2))
    else:
        for notice in notices:
            print(notice)
        print(_header(model, setup) + f" pp={pipeline.pp} micro-batches={pipeline.microbatches} {pipeline.schedule}")
        print(f"memory to plan for: {limit / GIB:.2f} GiB (device memory less the reserve)\n")
        print(f"{'stage':<7}{'layers':<12}{'in flight':>10}{'GiB':>9}  {'recompute':>9}  plan")
        for st in stages:
            first, stop = st.model.indices.start, st.model.indices.stop
            what = st.plan.describe() if st.plan is not None else f"nothing fits (least: {st.budget.total_gib:.2f})"
            share = f"{st.plan.overhead:.2%}" if st.plan is not None else "-"
            print(f"{st.rank:<7}{f'{first}-{stop - 1} ({stop - first})':<12}{st.setup.microbatches_in_flight:>10}"
                  f"{st.budget.total_gib:>9.2f}  {share:>9}  {what}")  # fmt: skip
        print(f"\nstage {worst.rank}, the one that needs the most:\n{worst.budget.table()}")
        for note in (*worst.budget.notes, *_notes(model, setup)):
            print(f"note: {note}")
        if worst.plan is not None:
            print(f"recompute (stage {worst.rank}, its layers counted from 0): {recompute_text(worst.plan)}")
    if not ok:
        failing = [st.rank for st in stages if st.plan is None]
        where = f"smallest pipeline degree that fits: --pp {smallest}" if smallest else "no pipeline degree fits"
        print(f"neuron-ckpt plan: nothing fits on stage(s) {failing} at --pp {pipeline.pp}; {where}", file=sys.stderr)
        return 1
    return 0


def _stage_dict(st: StagePlan) -> dict:
    where = {"stage": st.rank, "layers": [st.model.indices.start, st.model.indices.stop],
             "microbatches_in_flight": st.setup.microbatches_in_flight, "fits": st.plan is not None}  # fmt: skip
    if st.plan is not None:
        return {**where, **st.plan.to_dict()}
    return {**where, "message": str(st.nothing), "least_memory": st.nothing.least.to_dict()}  # type: ignore[union-attr]  # set when plan is None


__all__ = [
    "add_arguments", "alternatives", "build", "counts_by_kind", "model_type", "refuse_for_llama", "run", "wanted",
]  # fmt: skip
