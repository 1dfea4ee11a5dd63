"""``neuron-ckpt memory``: activation memory of one layer, analytic and (``--measure``) measured.

The command's logic lives here; :mod:`neuron_ckpt.cli` only dispatches. The arguments become a
:class:`~.shape.ModelShape`, a :class:`~.shape.TrainingSetup` and a recompute preset
(:func:`case_from_args`); :func:`build_report` returns a plain dict (what ``--json`` prints);
:func:`format_report` renders it as a table. ``--measure`` spawns ``--tp`` local gloo processes
(``run_local``) and runs up to two real layers (:mod:`.layers`); per-layer figures do not
depend on the layer count. ``--recompute-modules`` prices any selective module set,
``--offload-modules`` offload (:mod:`.offload`: device and host bytes per layer, and with
``--measure`` the measured ones). ``--plot`` draws :mod:`.plot`. ``--config`` (a transformers
config.json of any family ``apply_tensor_parallel`` splits, or a preset) is :mod:`.moe.report`'s.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path

from ..parallel.attention import ATTENTION
from ..recompute import PRESETS, RecomputeConfig
from .analytic import (
    Recompute,
    layer_activation_bytes,
    layer_activation_terms,
    model_activation_bytes,
    outside_layer_terms,
    resolve,
    supported_presets,
)  # fmt: skip
from .layers import MEASURED_LAYERS, Case, measure_on_ranks
from .moe.shape import ATTENTION as MOE_ATTENTION
from .moe.shape import EP_DISPATCH as MOE_EP_DISPATCH
from .moe.shape import EXPERTS as MOE_EXPERTS
from .offload import layer_offloads, offload_price
from .shape import DEFAULT_VOCAB, DTYPE_BYTES, KINDS, ModelShape, TrainingSetup, default_ffn

MIB = 1 << 20

# Table 2 of Korthikanti et al., the row each GPT configuration falls in: by preset, without and
# with the saved input split by t (sequence parallel, or distributed saved activations).
PAPER_ROWS = {
    "none": ("sbh(10 + 24/t + 5as/(ht))", "sbh(34/t + 5as/(ht))"),
    "selective": ("sbh(10 + 24/t)", "sbh(34/t)"),
    "full": ("2sbh", "2sbh/t"),
}


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``memory`` subcommand's options."""
    add = parser.add_argument
    add("--model", choices=KINDS, default="gpt", help="gpt: the paper's layer; llama: RMSNorm/GQA/SwiGLU")
    add(
        "--config",
        metavar="CONFIG",
        help="a transformers config.json of any family apply_tensor_parallel splits (llama, mistral, qwen2, qwen3, "
        "gemma2, phi3, mixtral, qwen2_moe, qwen3_moe, olmoe, deepseek_v2, deepseek_v3, gpt_oss, aria, llama4), a "
        "directory holding one, or a preset (mixtral-8x7b, deepseek-v3, llama2-7b, llama3-8b): each of its layer "
        "kinds under every recompute module, analytic (the sizes come from the file; --measure: and measured)",
    )
    add("--hidden", type=positive_int, help="h, model width (required without --config)")
    add("--heads", type=positive_int, help="a, attention heads (required without --config)")
    add("--kv-heads", type=positive_int, help="llama: key/value heads (GQA); default: --heads")
    add("--ffn", type=positive_int, help="MLP width; default 4h (gpt) or Llama's 8h/3 rounded to 256")
    add("--seq", type=positive_int, required=True, help="s, tokens per sequence")
    add("--micro-batch", type=positive_int, default=1, help="b, sequences per micro-batch")
    add("--tp", type=positive_int, default=1, help="t, tensor-parallel degree")
    add(
        "--cp",
        type=positive_int,
        default=1,
        help="c, context-parallel degree (llama): each rank runs s/c of the sequence (docs/context_parallel.md); "
        "--measure runs t x c processes",
    )
    add(
        "--sequence-parallel",
        action="store_true",
        help="shard norms/dropouts along the sequence (with --config: apply_tensor_parallel(sequence_parallel=True))",
    )
    add("--recompute", choices=PRESETS, default="none", help="a recompute preset")
    add(
        "--recompute-modules",
        metavar="NAMES",
        help="selective recompute of these modules, any set (comma list of core_attn, mlp, mlp_act, norm); "
        "with --recompute none or selective",
    )
    add(
        "--offload-modules",
        metavar="NAMES",
        help="offload what these modules keep to host (comma list of layer, core_attn, mlp, mlp_act, norm; "
        "llama; every layer but the last, so --layers >= 2): device and host bytes (docs/offload.md)",
    )
    add("--distribute-saved-activations", action="store_true", help="full recompute: keep 1/t of the layer input")
    add("--layers", type=positive_int, default=1, help="layers in the model (totals are layers x per layer)")
    add("--dtype", choices=tuple(DTYPE_BYTES), default="bf16", help="activation dtype")
    add(
        "--attention",
        choices=ATTENTION + MOE_ATTENTION,
        help="core attention: explicit (keeps the s x s probabilities, the paper's layer; default) or flash "
        "(a fused kernel: torch SDPA's flash on CPU/CUDA, NxD's NKI kernel on trn1; llama only); with "
        "--config transformers' implementation: sdpa (default; torch's CPU dispatch), eager, or sdpa-fused "
        "(a fused sdpa kernel whatever the head sizes: CUDA's memory-efficient kernel for MLA)",
    )
    add(
        "--experts",
        choices=MOE_EXPERTS,
        help="with --config: transformers' experts implementation (default grouped_mm)",
    )
    add("--ep", type=positive_int, default=1, help="with --config: expert_model_parallel_size (E/e experts per rank)")
    add("--ep-rows", choices=("balanced", "worst"), default="balanced", help="with --ep: rows each rank's experts get")
    add(
        "--ep-dispatch",
        choices=MOE_EP_DISPATCH,
        default="all_to_all",
        help="with --ep: the dispatch form, all_to_all (dropless; eager backends) or all_gather (XLA's static form)",
    )
    add(
        "--capacity-factor",
        type=float,
        help="with --ep-dispatch all_gather: each expert's slots, ceil(N k / E x cf) (default: dropless, N)",
    )
    add("--measure", action="store_true", help=f"run {MEASURED_LAYERS} real layers on --tp local gloo processes")
    add("--json", action="store_true", help="print one JSON object instead of a table")
    add("--plot", metavar="PATH", help="write a PNG: bytes per layer against sequence length")


def case_from_args(args: argparse.Namespace) -> Case:
    """``(model, setup, recompute)``, checked as the analytic model checks them; a
    ``ValueError`` naming the field otherwise. The vocabulary plays no part in one layer."""
    missing = [flag for flag, value in (("--hidden", args.hidden), ("--heads", args.heads)) if value is None]
    if missing:
        raise ValueError(f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} required (or --config)")
    if args.experts is not None:
        raise ValueError("--experts applies to --config (transformers MoE models) only")
    expert_parallel = (args.ep, args.ep_rows, args.ep_dispatch, args.capacity_factor)
    if expert_parallel != (1, "balanced", "all_to_all", None):
        raise ValueError(
            "--ep, --ep-rows, --ep-dispatch and --capacity-factor apply to --config (transformers MoE models) only"
        )
    attention = "explicit" if args.attention is None else args.attention
    if attention not in ATTENTION:
        raise ValueError(
            f"--attention must be one of {ATTENTION} for --model {args.model}, got {attention!r} "
            "(sdpa / eager / sdpa-fused are for --config)"
        )
    kv_heads = args.heads if args.kv_heads is None else args.kv_heads
    ffn = default_ffn(args.model, args.hidden) if args.ffn is None else args.ffn
    model = ModelShape(args.model, args.hidden, args.heads, kv_heads, ffn, args.layers, DEFAULT_VOCAB)
    if args.cp > 1 and args.model != "llama":
        raise ValueError(f"--cp {args.cp}: context parallelism is built for --model llama only; use --cp 1 for gpt")
    setup = TrainingSetup(
        args.seq,
        args.micro_batch,
        args.tp,
        dtype=args.dtype,
        sequence_parallel=args.sequence_parallel,
        attention=attention,
        cp=args.cp,
    )
    recompute = RecomputeConfig.preset(args.recompute)
    if args.recompute_modules is not None:
        if args.recompute not in ("none", "selective"):
            raise ValueError(
                f"--recompute-modules is selective recompute's; it does not combine with --recompute {args.recompute}"
            )
        recompute = _with_names(
            "--recompute-modules", args.recompute_modules, lambda names: RecomputeConfig("selective", modules=names)
        )
    if args.distribute_saved_activations:
        recompute = replace(recompute, distribute_saved_activations=True)
    if args.offload_modules is not None:
        if args.layers < 2:
            raise ValueError(
                f"--offload-modules with --layers {args.layers}: one config leaves the last layer alone (backward "
                "needs it first), so nothing would be offloaded; give --layers 2 or more"
            )
        recompute = _with_names(
            "--offload-modules", args.offload_modules, lambda names: replace(recompute, offload_modules=names)
        )
        layer_offloads(model, setup, recompute)  # priced: llama, the dense names
    resolve(model, setup, recompute)
    return model, setup, recompute


def _with_names(flag: str, text: str, make: Callable[[tuple[str, ...]], RecomputeConfig]) -> RecomputeConfig:
    """``make`` of the comma list ``text``; an unknown name refused in one line naming ``flag``
    and the names allowed (``RecomputeConfig`` checks them)."""
    try:
        return make(tuple(name for name in text.split(",") if name))
    except ValueError as exc:
        raise ValueError(f"{flag} {text}: {exc}") from None


def comparisons(model: ModelShape, setup: TrainingSetup, recompute: Recompute) -> dict[str, RecomputeConfig]:
    """The same layer under each preset (distribution only where it applies: full)."""
    distribute = resolve(model, setup, recompute).config.distribute_saved_activations
    return {name: RecomputeConfig.preset(name, distribute and name == "full") for name in supported_presets(model)}


def measure(cases: list[Case]) -> list[dict]:
    """Measure each case (all of one TP and CP degree) on ``tp x cp`` spawned gloo ranks; per case, all ranks."""
    from ..distributed.local import run_local

    layers = min(cases[0][0].layers, MEASURED_LAYERS)
    per_rank = run_local(measure_on_ranks, cases[0][1].tp * cases[0][1].cp, cases, layers)
    out = []
    for i, case in enumerate(cases):
        got = [rank[i] for rank in per_rank]
        result = {
            "measured_bytes_per_layer": max(m.bytes_per_layer for m in got),
            "measured_per_rank": [m.bytes_per_layer for m in got],
            "measured_layers": layers,
            "measured_storages": [dict(zip(("scope", "dtype", "shape", "bytes"), row)) for row in got[0].storages],
        }
        if resolve(*case).config.offload_modules:
            # Layer 0 offloads; the last is left alone, so it keeps what a layer keeps without offload.
            result.update(
                measured_bytes_per_layer=max(m.per_layer_bytes[-1] for m in got),
                measured_per_rank=[m.per_layer_bytes[-1] for m in got],
                measured_device_bytes_per_layer=max(m.per_layer_bytes[0] for m in got),
                measured_host_bytes_per_layer=max(m.offloaded_per_layer[0] for m in got),
                measured_offloaded_bytes_per_layer=max(m.per_layer_bytes[-1] - m.per_layer_bytes[0] for m in got),
            )
        out.append(result)
    return out


def _spec(model: ModelShape, setup: TrainingSetup, recompute: Recompute) -> dict:
    """What the report describes, flat (the ``spec`` of ``--json``)."""
    priced = resolve(model, setup, recompute)
    name, distribute = priced.name, priced.config.distribute_saved_activations
    return {
        "model": model.kind, "seq_len": setup.seq_len, "micro_batch": setup.micro_batch, "hidden": model.hidden,
        "heads": model.heads, "kv_heads": model.kv_heads if model.kind == "llama" else None, "ffn": model.ffn,
        "tp": setup.tp, "cp": setup.cp, "sequence_parallel": setup.sequence_parallel, "recompute": name,
        "distribute_saved_activations": distribute, "layers": model.layers, "dtype": setup.dtype,
        "attention": setup.attention, "offload_modules": list(priced.config.offload_modules),
    }  # fmt: skip


def build_report(model: ModelShape, setup: TrainingSetup, recompute: Recompute, measured: dict | None = None) -> dict:
    """Everything the command prints, as a JSON-ready dict."""
    priced = resolve(model, setup, recompute)
    name, distribute = priced.name, priced.config.distribute_saved_activations
    per_layer = layer_activation_bytes(model, setup, recompute)
    outside = outside_layer_terms(model, setup, recompute)
    baseline = layer_activation_bytes(model, setup, "none")
    report = {
        "spec": _spec(model, setup, recompute),
        "analytic_bytes_per_layer": per_layer,
        "analytic_bytes_total": model_activation_bytes(model, setup, recompute, outside),
        "breakdown": [asdict(t) for t in layer_activation_terms(model, setup, recompute)],
        "outside_layer_terms": [asdict(t) for t in outside],
        "vs_no_recompute": {
            n: layer_activation_bytes(model, setup, c) / baseline
            for n, c in comparisons(model, setup, recompute).items()
        },
        "saving_vs_no_recompute": 1 - per_layer / baseline,
    }
    if model.kind == "gpt" and name in PAPER_ROWS:
        report["paper_formula"] = PAPER_ROWS[name][setup.sequence_parallel or distribute]
    if priced.config.offload_modules:
        report.update(_offload_report(model, setup, recompute))
    if measured is not None:
        report.update(measured)
        report["measured_over_analytic"] = measured["measured_bytes_per_layer"] / per_layer
    return report


def _offload_report(model: ModelShape, setup: TrainingSetup, recompute: Recompute) -> dict:
    """Layer 0's device and host bytes (an offloading layer; the first also copies what the layers
    share, the rotary tables, under ``layer``), and the stack's with one micro-batch (:mod:`.offload`)."""
    price = offload_price(model, setup, recompute)
    first = price.layers[0]
    return {
        "offloaded_bytes_per_layer": first.offloaded,
        "device_bytes_per_layer": first.device,
        "host_bytes_per_layer": first.host,
        "offload": {
            "layers_offloading": sum(1 for x in price.layers if x.names),
            "device_bytes_total": price.device_bytes,
            "host_bytes_total": price.host_bytes,
            "host_pinned_bytes_total": price.host_pinned_bytes,
            "copies_in_flight_bytes": price.copies_in_flight,
            "reload_buffer_bytes": price.reload_buffer,
            "peak_bytes": price.peak,
            "peak_without_offload_bytes": price.peak_without,
        },
    }


def format_report(report: dict) -> str:
    """A readable table of :func:`build_report`'s dict (MiB, ratios, the term breakdown)."""
    s = report["spec"]
    flags = (
        [f"t={s['tp']}"]
        + ([f"cp={s['cp']} (s/{s['cp']} = {s['seq_len'] // s['cp']} tokens per rank)"] if s["cp"] > 1 else [])
        + (["sequence parallel"] if s["sequence_parallel"] else [])
        + (["distributed saved input"] if s["distribute_saved_activations"] else [])
    )
    kv = f" kv={s['kv_heads']}" if s["kv_heads"] else ""
    lines = [
        (
            f"{s['model']} layer: s={s['seq_len']} b={s['micro_batch']} h={s['hidden']} a={s['heads']}{kv} "
            f"{s['dtype']}, {', '.join(flags)}, {s['attention']} attention, recompute={s['recompute']}"
        ),
        f"activations per layer per rank (analytic): {report['analytic_bytes_per_layer'] / MIB:.3f} MiB"
        + (f"   [paper: {report['paper_formula']}]" if "paper_formula" in report else ""),
        f"x {s['layers']} layers (+ shared terms): {report['analytic_bytes_total'] / MIB:.3f} MiB",
        "",
        f"{'recompute':<12}{'vs none':>10}",
    ]
    for mode, ratio in report["vs_no_recompute"].items():
        lines.append(f"{mode:<12}{ratio:>10.3f}" + ("   <- this run" if mode == s["recompute"] else ""))
    lines += ["", f"{'term':<24}{'MiB':>10}{'share':>8}  split by t"]
    total = report["analytic_bytes_per_layer"]
    for term in report["breakdown"]:
        lines.append(
            f"{term['name']:<24}{term['nbytes'] / MIB:>10.4f}{term['nbytes'] / total:>8.1%}  "
            f"{'yes' if term['split_by_tp'] else 'no'}"
        )
    for term in report["outside_layer_terms"]:
        lines.append(f"{term['name'] + ' (shared)':<24}{term['nbytes'] / MIB:>10.4f}")
    if "offload" in report:
        o, mib = report["offload"], {k: v / MIB for k, v in report.items() if isinstance(v, int)}
        o_mib = {k: v / MIB for k, v in o.items()}
        modules = ",".join(s["offload_modules"])
        lines += [
            "",
            f"offload {modules}: {o['layers_offloading']} of {s['layers']} layers (the last left alone)",
            (
                f"  per layer: device {mib['device_bytes_per_layer']:.3f} MiB, to host "
                f"{mib['host_bytes_per_layer']:.3f} MiB ({mib['offloaded_bytes_per_layer']:.3f} MiB leave the device)"
            ),
            (
                f"  the layers, one micro-batch: device {o_mib['device_bytes_total']:.3f} MiB, host "
                f"{o_mib['host_bytes_total']:.3f} MiB (pinned blocks {o_mib['host_pinned_bytes_total']:.3f} MiB)"
            ),
            (
                f"  device peak {o_mib['peak_bytes']:.3f} MiB (without offload "
                f"{o_mib['peak_without_offload_bytes']:.3f}): copies in flight up to "
                f"{o_mib['copies_in_flight_bytes']:.3f}, reload buffer {o_mib['reload_buffer_bytes']:.3f}"
            ),
        ]
    if "measured_device_bytes_per_layer" in report:
        lines.append(
            f"  measured: device {report['measured_device_bytes_per_layer'] / MIB:.3f} MiB, to host "
            f"{report['measured_host_bytes_per_layer'] / MIB:.3f} MiB per layer "
            f"(layer 0 of {report['measured_layers']})"
        )
    if "measured_bytes_per_layer" in report:
        lines += [
            "",
            (
                f"measured ({report['measured_layers']} layers, {s['tp'] * s['cp']} gloo ranks): "
                f"{report['measured_bytes_per_layer'] / MIB:.3f} MiB per layer, "
                f"measured/analytic {report['measured_over_analytic']:.4f}"
            ),
        ]
    if "plot" in report:
        lines.append(f"plot: {report['plot']}")
    return "\n".join(lines)


def check_plot_path(path: str) -> None:
    """Refuse a ``--plot`` path that cannot be written, before anything is computed or measured:
    a missing or unwritable directory, a directory given as the file, matplotlib not installed.
    Raises ``ValueError`` naming the path."""
    target = Path(path)
    parent = target.parent
    if target.is_dir():
        raise ValueError(f"--plot {path}: is a directory; give a file name such as {target / 'memory.png'}")
    if not parent.is_dir():
        what = "is not a directory" if parent.exists() else "does not exist"
        raise ValueError(f"--plot {path}: directory {str(parent)!r} {what}")
    existed = target.exists()
    try:  # open it for real: os.access answers for the real uid, and says yes to root on any mode
        with open(target, "ab"):
            pass
    except OSError as exc:
        raise ValueError(f"--plot {path}: cannot write there: {exc.strerror or exc}") from None
    finally:
        if not existed and target.exists():
            os.unlink(target)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ValueError("--plot needs matplotlib (pip install 'neuron_ckpt[tutorial]')") from None


def run(args: argparse.Namespace) -> int:
    """The ``memory`` command. Raises ``ValueError`` on bad input (the CLI prints one line)."""
    if args.config is not None:  # a transformers model: its own report (.moe.report)
        if args.offload_modules is not None or args.recompute_modules is not None:
            raise ValueError("--offload-modules and --recompute-modules apply to --model llama / gpt, not --config yet")
        if args.cp > 1:
            raise ValueError(
                f"--cp {args.cp} applies to --model llama (our Llama layer); a transformers --config takes no "
                "context parallelism"
            )
        from .moe import report as moe_report

        return moe_report.run(args)
    model, setup, recompute = case_from_args(args)
    if args.plot:
        check_plot_path(args.plot)
    measured = None
    if args.measure:
        measured = measure([(model, setup, recompute)])[0]
    report = build_report(model, setup, recompute, measured)
    if args.plot:
        from . import plot

        points = None
        if args.measure:  # each curve's configuration run for real at this sequence length
            variants = plot.variants(model, setup)
            results = measure([(model, variant, name) for (name, _), variant in variants.items()])
            points = {key: result["measured_bytes_per_layer"] for key, result in zip(variants, results)}
        report["plot"] = plot.plot_memory_vs_seq(model, setup, args.plot, points)
    print(json.dumps(report) if args.json else format_report(report))
    return 0
