"""``neuron-ckpt plan``: will the job fit, and with which recompute?

::

    neuron-ckpt plan --model llama --config llama2-7b --tp 8 --dp 4 --seq 4096 --micro-batch 1 \\
        --device-memory trn1 [--cp 4] [--attention flash|explicit] [--reserve 1] [--dtype bf16]
        [--zero1 | --no-zero1] [--longest-seq] [--json]
        [--pp 8 --micro-batches 256 [--schedule gpipe|1f1b|interleaved] [--virtual-stages 2]]

Prints the per-device budget of the chosen plan (GiB per line item), the plan (layers per
option, the ``RecomputeConfig`` or per-layer list to pass to the model) and its recompute
FLOPs as a share of a step, with the uniform choices beside it; then the optimizer step's
largest collective and transient bytes, host memory per rank at its peaks against the instance
(:mod:`.host`) and the checkpoint size on disk. ``--pp`` above 1 plans each pipeline stage
instead (:mod:`.pipeline.plan_cli`). Bad input: one line on stderr, exit status 2
(from the dispatcher, :mod:`neuron_ckpt.cli`). Nothing fits: the reason and what would fit on
stderr, exit status 1.

``--attention`` defaults to flash, what the reference recipe (NxD's trn1 Llama-3 tutorial) and
``train.py`` run where a kernel exists; with flash the planner does not offer selective recompute
(no ``s^2`` tensor to drop) and says so. ``--device-memory trn1`` prices what trn1 runs: NxD's
NKI flash kernel keeps k and v repeated to the query heads, and under context parallelism
(``--cp``) trn1 runs the explicit attention (the NKI kernel takes equal query and key lengths
only).

``--cp c``: each rank runs ``s/c`` of the sequence (docs/context_parallel.md); ``s`` must split
into ``2c`` chunks (``2ct`` with sequence parallelism), and ``--pp`` above 1 is refused with it,
as ``train.py`` refuses it. When nothing fits, the message names the smallest ``--cp`` that does.
``--longest-seq`` also prints the longest sequence that fits at these degrees.

Every option given is used or refused: ``--hidden/--heads/--layers/--vocab`` describe a
``--model gpt`` (a Llama's shape comes from ``--config``, which a GPT does not take);
``--bucket-cap-mb`` sizes ZeRO-1's buckets (refused with ``--no-zero1``). Sizes in GiB must be
finite, and ``--reserve`` must leave some of the device.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import replace

from ..parallel.attention import ATTENTION
from ..recompute import PRESETS, RecomputeConfig
from .budget import GIB, largest_collective_bytes, optimizer_step_bytes
from .host import INSTANCES, host_budget, offload_room
from .moe import plan_cli as transformers_cli
from .moe.shape import ATTENTION as TRANSFORMERS_ATTENTION
from .offload import PRICED as OFFLOAD_PRICED
from .offload_time import HostLink
from .options import offered_presets, selective_saving_with_flash
from .pipeline import plan_cli as pipeline_cli
from .plan_shared import DEFAULT_BUCKET_CAP_MB, GPT_ONLY, device_gib, plan_line, recompute_text
from .planner import (
    Choices,
    NothingFits,
    Plan,
    evaluate,
    longest_sequence,
    plan_recompute,
)
from .shape import DEFAULT_VOCAB, DTYPE_BYTES, KINDS, ModelShape, TrainingSetup

HELP = "plan recompute per layer so a training job fits a device's memory"

DEFAULT_CONFIG = "llama2-7b"


def _finite(low: float, low_ok: bool):
    """An argparse type: a finite float above ``low`` (or equal to it when ``low_ok``)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value < low or (value == low and not low_ok):
            raise argparse.ArgumentTypeError(
                f"expected a finite number {'>=' if low_ok else '>'} {low:g}, got {text!r}"
            )
        return value

    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``plan`` options, on an existing parser."""
    parser.add_argument(
        "--model",
        choices=(*KINDS, "transformers"),
        default=None,
        help="llama (this library's, default), gpt, or transformers (the config's family as transformers builds it; "
        "the default for a --config of another family than llama)",
    )
    parser.add_argument(
        "--config",
        default=None,
        help=f"a config.json path, a directory holding one, or a preset name (default {DEFAULT_CONFIG})",
    )
    parser.add_argument("--hidden", type=int, help="gpt: hidden size")
    parser.add_argument("--heads", type=int, help="gpt: attention heads")
    parser.add_argument("--layers", type=int, help="gpt: number of layers")
    parser.add_argument("--vocab", type=int, default=None, help=f"gpt: vocabulary size (default {DEFAULT_VOCAB})")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    parser.add_argument("--dp", type=int, default=1, help="data-parallel degree (ZeRO-1 shards over dp x cp)")
    parser.add_argument(
        "--cp",
        type=int,
        default=1,
        help="context-parallel degree: each rank runs s/cp of the sequence (docs/context_parallel.md)",
    )
    parser.add_argument("--seq", type=int, required=True, help="sequence length")
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument(
        "--device-memory",
        default=None,
        help="GiB per device or a preset (trn1 = 16 GiB per NeuronCore); default: the CUDA device",
    )
    parser.add_argument(
        "--reserve",
        type=_finite(0.0, True),
        default=None,
        help="GiB to keep free for the runtime, collectives and fragmentation (default: 10%% of the device)",
    )
    parser.add_argument("--dtype", choices=tuple(DTYPE_BYTES), default="bf16")
    parser.add_argument(
        "--zero1",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="shard fp32 master weights and AdamW moments over dp (default on)",
    )
    parser.add_argument("--sequence-parallel", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument(
        "--attention",
        choices=ATTENTION + TRANSFORMERS_ATTENTION,
        default=None,
        help="core attention: flash (a fused kernel, no s x s tensor: torch SDPA's flash on CPU/CUDA, "
        "NxD's NKI kernel on trn1; default, as the reference trains) or explicit; a transformers model: "
        "transformers' implementation, sdpa (default), eager or sdpa-fused",
    )
    parser.add_argument(
        "--bucket-cap-mb",
        type=_finite(0.0, False),
        default=None,
        help=f"ZeRO-1 bucket cap in MiB: the optimizer step's largest collective (default {DEFAULT_BUCKET_CAP_MB:g})",
    )
    parser.add_argument(
        "--instance",
        choices=sorted(INSTANCES),
        default=None,
        help="host whose memory the ranks share (default trn1.32xlarge: 512 GiB, 32 ranks; with --host-link "
        "p5.48xlarge: 2 TiB, 8 ranks)",
    )
    parser.add_argument(
        "--checkpoint-writers",
        type=int,
        default=8,
        help="ranks per host writing a checkpoint at once (train.py's default 8; 0: all)",
    )
    parser.add_argument(
        "--longest-seq",
        action="store_true",
        help="also find the longest sequence that fits at these degrees (a bisection over the planner)",
    )
    parser.add_argument(
        "--recompute-modules",
        type=lambda text: tuple(n.strip() for n in text.split(",") if n.strip()),
        default=None,
        help="the selective recompute the planner offers (comma list of modules, any set RecomputeConfig takes), "
        "instead of the presets' selective ones, beside none and full",
    )
    parser.add_argument(
        "--host-link",
        type=_host_link,
        default=None,
        metavar="D2H[,H2D]",
        help="weigh activation offload too: device-to-host (and host-to-device, default the same) GB/s per rank, "
        "pinned (scripts/device_report.py measures it); needs --device-tflops (docs/offload.md)",
    )
    parser.add_argument(
        "--device-tflops",
        type=_finite(0.0, False),
        default=None,
        help="with --host-link: the device's achieved dense TFLOP/s (prices a copy's exposed time against recompute)",
    )
    parser.add_argument(
        "--offload-modules",
        type=_module_list,
        default=None,
        help="with --host-link: the names offload may use (comma list of layer, core_attn, mlp, mlp_act, norm; "
        "default: each alone, norm+core_attn+mlp, and layer)",
    )
    parser.add_argument("--json", action="store_true", help="one JSON object instead of tables")
    pipeline_cli.add_arguments(parser)
    transformers_cli.add_arguments(parser)


def model_from_args(args: argparse.Namespace) -> ModelShape:
    """The model ``--model``/``--config`` (Llama) or ``--hidden/--heads/--layers/--vocab`` (GPT) describe."""
    if args.model in ("llama", None):
        given = [f"--{n}" for n in GPT_ONLY if getattr(args, n, None) is not None]
        if given:
            raise ValueError(
                f"{', '.join(given)} {'is' if len(given) == 1 else 'are'} for --model gpt; a Llama's shape comes "
                f"from its config: use --config (a config.json path, a directory holding one, or {DEFAULT_CONFIG})"
            )
        from ..models.config_file import load_llama_config  # lazily: it needs transformers

        name = args.config or DEFAULT_CONFIG
        return ModelShape.from_llama(load_llama_config(name), name=name)
    if args.config is not None:
        raise ValueError(
            "--config is for --model llama; a GPT's shape comes from --hidden, --heads, --layers and --vocab"
        )
    missing = [f"--{n}" for n in ("hidden", "heads", "layers") if getattr(args, n) is None]
    if missing:
        raise ValueError(f"--model gpt needs {', '.join(missing)}")
    vocab = DEFAULT_VOCAB if args.vocab is None else args.vocab
    return ModelShape.gpt(args.hidden, args.heads, args.layers, vocab, name="gpt")


def build(args: argparse.Namespace) -> tuple[ModelShape, TrainingSetup]:
    """The model and setup the arguments describe (ValueError naming the field when invalid)."""
    model = model_from_args(args)
    if args.checkpoint_writers < 0:
        raise ValueError(f"--checkpoint-writers must be >= 0 (0: all), got {args.checkpoint_writers}")
    if args.bucket_cap_mb is not None and not args.zero1:
        raise ValueError(
            "--bucket-cap-mb sizes ZeRO-1's buckets; with --no-zero1 there are none (a DP "
            "all-reduce of every gradient): drop it or use --zero1"
        )
    bucket_cap_mb = DEFAULT_BUCKET_CAP_MB if args.bucket_cap_mb is None else args.bucket_cap_mb
    if isinstance(args.cp, bool) or not isinstance(args.cp, int) or args.cp < 1:
        raise ValueError(f"--cp (the context-parallel degree) must be an integer >= 1, got {args.cp}")
    if args.cp > 1 and args.pp > 1:
        from ..pipeline.config import CP_REFUSAL

        raise ValueError(f"--cp {args.cp} --pp {args.pp}: {CP_REFUSAL.format(cp=args.cp)}")
    if args.cp > 1 and model.kind != "llama":
        raise ValueError(f"--cp {args.cp}: context parallelism is built for --model llama only; use --cp 1 for gpt")
    trn1 = str(args.device_memory).lower() == "trn1"
    setup = TrainingSetup(
        seq_len=args.seq,
        micro_batch=args.micro_batch,
        tp=args.tp,
        dp=args.dp,
        dtype=args.dtype,
        sequence_parallel=args.sequence_parallel,
        zero1=args.zero1,
        bucket_cap_mb=bucket_cap_mb,
        attention=args.attention,
        flash_kernel="nki" if trn1 and args.attention == "flash" else "torch",
    )
    return model, setup.at_context_parallel(args.cp)


def _alternatives(model: ModelShape, setup: TrainingSetup, plan: Plan) -> list[Plan]:
    return [evaluate(model, setup, name, plan.limit_bytes, plan.options) for name in PRESETS if name in plan.options]


def attention_notes(model: ModelShape, setup: TrainingSetup, device_memory: str | None) -> list[str]:
    """What the plan says about its attention: the presets it leaves out with flash, and where
    trn1's kernel keeps more than the model counts."""
    if setup.attention != "flash":
        return []
    left_out = [
        name
        for name in PRESETS
        if name not in offered_presets(model, setup)
        and name in offered_presets(model, replace(setup, attention="explicit"))
    ]
    notes = [
        (
            f"flash attention: {', '.join(left_out)} offered without core attention (as selective[...]): rerunning "
            f"the attention forward would drop {selective_saving_with_flash(model, setup) / 2**10:,.1f} KiB per "
            "layer (the kernel's fp32 logsumexp); their output-discarding modules still save what they save"
        )
    ]
    if setup.dtype == "fp32" and str(device_memory).lower() != "trn1":
        notes.append(
            "fp32: on CUDA torch's flash kernel takes only fp16/bf16 and SDPA runs its memory-efficient or "
            "math kernel, which keep other tensors than counted here (on CPU the flash kernel takes fp32: "
            "those figures are measured)"
        )
    a, g = model.local_heads(setup.tp), model.local_kv_heads(setup.tp)
    if setup.flash_kernel == "nki" and g < a:
        extra = 2 * setup.width * setup.local_seq_len * setup.micro_batch * (a - g) * model.head_dim
        notes.append(
            f"trn1: NxD's NKI kernel is called with k and v repeated to the {a} query heads of a rank "
            f"(its wrapper launches over query heads) and keeps them so: counted here, {extra / 2**20:,.1f} MiB "
            f"per layer more than torch's kernel keeps (k and v at the {g} kv heads)"
        )
    return notes


def context_parallel_notes(model: ModelShape, setup: TrainingSetup, args: argparse.Namespace) -> list[str]:
    """What the plan says about context parallelism: what it prices, what trn1 runs, what the
    backward all-gathers again."""
    if setup.cp == 1:
        return []
    c = setup.cp
    kv = 2 * setup.width * setup.local_seq_len * setup.micro_batch * model.local_kv_heads(setup.tp) * model.head_dim
    notes = [
        (
            f"context parallel: cp={c}, each rank runs s/{c} = {setup.local_seq_len} tokens; ZeRO-1 shards over "
            f"dp x cp = {setup.dp * c}; {setup.tp * c * setup.dp} ranks in all"
        ),
        (
            f"context parallel: each layer's backward all-gathers this rank's K and V again, (c-1) x "
            f"{kv / 2**20:,.2f} MiB sent per layer and rank: the regather without recompute, the rerun with core "
            "attention or full recompute (the same bytes under every choice, so the plan's FLOPs are its price)"
        ),
    ]
    if args.attention == "flash" and setup.attention == "explicit":
        notes.append(
            "trn1: NxD's NKI flash kernel takes equal query and key lengths only, so under context parallelism "
            "trn1 runs the explicit attention (parallel/flash.py): priced as explicit"
        )
    return notes


def _print_plan(model: ModelShape, setup: TrainingSetup, plan: Plan, notes: list[str]) -> None:
    print(
        f"{model.name or model.kind}: L={model.layers} h={model.hidden} a={model.heads} g={model.kv_heads} "
        f"f={model.ffn} v={model.vocab} | tp={setup.tp} cp={setup.cp} dp={setup.dp} s={setup.seq_len} "
        f"b={setup.micro_batch} "
        f"{setup.dtype} sequence_parallel={setup.sequence_parallel} zero1={setup.zero1} attention={setup.attention}"
    )
    print(f"memory to plan for: {plan.limit_bytes / GIB:.2f} GiB (device memory less the reserve)\n")
    print(plan.budget.table())
    for note in (*plan.budget.notes, *notes):
        print(f"note: {note}")
    print(f"\n{plan_line(plan)}")
    print(f"recompute: {recompute_text(plan)}")
    print("\nalternatives (the same option on every layer):")
    for alt in _alternatives(model, setup, plan):
        verdict = "fits" if alt.fits else "does not fit"
        print(f"  {alt.describe():<26}{alt.budget.total_gib:>8.2f} GiB  {verdict:<13} recompute {alt.overhead:.2%}")


def _print_step_and_host(model: ModelShape, setup: TrainingSetup, args: argparse.Namespace, plan: Plan) -> None:
    print(
        f"\noptimizer step: largest collective {largest_collective_bytes(model, setup) / 2**20:,.0f} MiB, "
        f"transient {optimizer_step_bytes(model, setup) / GIB:.2f} GiB per device"
    )
    print(_host(model, setup, args, plan).table())


def _host(model: ModelShape, setup: TrainingSetup, args: argparse.Namespace, plan: Plan | None = None):
    pinned = plan.host_pinned_bytes if plan is not None else 0
    return host_budget(model, setup, _instance(args), writers=args.checkpoint_writers, offload_pinned_bytes=pinned)


def _instance(args: argparse.Namespace) -> str:
    """``--instance``; by default a trn1.32xlarge, or with ``--host-link`` a GPU host, where offload runs."""
    return args.instance or ("p5.48xlarge" if args.host_link else "trn1.32xlarge")


def _host_link(text: str) -> tuple[float, float]:
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        values = []
    if len(values) not in (1, 2) or not all(math.isfinite(v) and v > 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected D2H[,H2D], GB/s > 0 each, got {text!r}")
    return values[0], values[-1]


def _module_list(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    if not names or set(names) - set(OFFLOAD_PRICED):
        raise argparse.ArgumentTypeError(f"expected a comma list of {list(OFFLOAD_PRICED)}, got {text!r}")
    return names


def choices_from_args(args: argparse.Namespace, model: ModelShape, setup: TrainingSetup) -> Choices | None:
    """What else the planner may choose (``--recompute-modules``; offload: ``--host-link``,
    ``--device-tflops``, ``--offload-modules``), or None; one line for what cannot be planned."""
    modules = args.recompute_modules
    if modules is not None:
        if getattr(args, "pp", None) not in (None, 1):
            raise ValueError("--recompute-modules: the pipeline planner offers its own choices; drop --pp or it")
        RecomputeConfig(granularity="selective", modules=modules)  # the names checked here, in one line
    link, tflops, names = args.host_link, args.device_tflops, args.offload_modules
    if link is None:
        given = [f for f, v in (("--device-tflops", tflops), ("--offload-modules", names)) if v is not None]
        if given:
            raise ValueError(f"{', '.join(given)}: prices activation offload; give --host-link D2H[,H2D] too")
        return None if modules is None else Choices(recompute_modules=modules)
    if tflops is None:
        raise ValueError(
            "--host-link: give --device-tflops too (the achieved rate that prices a copy against recompute)"
        )
    why = None
    if args.device_memory == "trn1" or (args.instance or "").startswith("trn1"):
        why = "trn1 trains through XLA, which has no streams to copy beside the compute (docs/offload.md)"
    elif model.kind != "llama":
        why = f"offload is priced for --model llama, got {model.kind}"
    elif setup.cp > 1:
        why = "offload is planned at --cp 1 only"
    elif getattr(args, "pp", None) not in (None, 1):
        why = "offload is planned without --pp (the pipeline planner prices recompute only)"
    if why is not None:
        raise ValueError(f"--host-link: {why}")
    room = offload_room(model, setup, _instance(args), writers=args.checkpoint_writers)
    return Choices(modules, HostLink(link[0], link[1], tflops), names, room)


def run(args: argparse.Namespace) -> int:
    """Run ``neuron-ckpt plan``: exit status 0 when it fits, 1 when nothing fits. Bad input raises
    (``ValueError`` naming the field; the dispatcher prints one line and exits 2)."""
    if transformers_cli.wanted(args):  # another family's config, or --model transformers
        return transformers_cli.run(args)
    transformers_cli.refuse_for_llama(args)
    args.attention = args.attention or "flash"
    if args.attention not in ATTENTION:
        raise ValueError(f"--attention {args.attention} is transformers'; --model llama and gpt take {ATTENTION}")
    model, setup = build(args)
    pipeline = pipeline_cli.pipeline_from_args(args)
    notes = attention_notes(model, setup, args.device_memory) + context_parallel_notes(model, setup, args)
    choices = choices_from_args(args, model, setup)
    if pipeline is not None:
        return pipeline_cli.run(args, model, setup, pipeline, device_gib(args), notes)
    longest = None
    if args.longest_seq:
        longest = longest_sequence(model, setup, device_gib(args), reserve_gib=args.reserve, choices=choices)
    try:
        plan = plan_recompute(model, setup, device_gib(args), reserve_gib=args.reserve, choices=choices)
    except NothingFits as exc:
        if args.json:
            out = {
                "fits": False,
                "attention": setup.attention,
                "cp": setup.cp,
                "message": str(exc),
                "smallest_tp": exc.smallest_tp,
                "smallest_cp": exc.smallest_cp,
                "largest_micro_batch": exc.largest_micro_batch,
                "least_memory": exc.least.to_dict(),
            }
            if args.longest_seq:
                out["longest_seq"] = longest
            print(json.dumps(out, indent=2))
        elif args.longest_seq:
            print(_longest_text(setup, longest))
        print(f"neuron-ckpt plan: {exc}", file=sys.stderr)
        return 1
    if args.json:
        out = plan.to_dict()
        out["attention"] = setup.attention
        out["cp"] = setup.cp
        out["attention_notes"] = notes
        if args.longest_seq:
            out["longest_seq"] = longest
        out["alternatives"] = {
            alt.layers[0]: {"total_gib": round(alt.budget.total_gib, 4), "fits": alt.fits, "overhead": alt.overhead}
            for alt in _alternatives(model, setup, plan)
        }
        out["optimizer_step"] = {
            "largest_collective_bytes": largest_collective_bytes(model, setup),
            "transient_bytes": optimizer_step_bytes(model, setup),
        }
        out["host"] = _host(model, setup, args, plan).to_dict()
        print(json.dumps(out, indent=2))
    else:
        _print_plan(model, setup, plan, notes)
        if args.longest_seq:
            print(_longest_text(setup, longest))
        _print_step_and_host(model, setup, args, plan)
    return 0


def _longest_text(setup: TrainingSetup, longest: int | None) -> str:
    where = f"tp={setup.tp} cp={setup.cp} dp={setup.dp} micro-batch {setup.micro_batch}, {setup.attention} attention"
    if longest is None:
        return f"longest sequence that fits: none at {where}"
    return f"longest sequence that fits: {longest} tokens at {where}"
