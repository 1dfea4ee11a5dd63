"""``neuron-ckpt memory``: activation memory of one layer, analytic and (``--measure``) measured.

The command's logic lives here; :mod:`neuron_ckpt.cli` only dispatches. :func:`build_report`
returns a plain dict (what ``--json`` prints); :func:`format_report` renders it as a table.
``--measure`` spawns ``--tp`` local gloo processes (``run_local``) and runs up to two real layers
(:mod:`.layers`); per-layer figures do not depend on the layer count.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict
from pathlib import Path

from .analytic import RECOMPUTE_MODES
from .layers import measure_on_ranks
from .spec import DTYPES, MODELS, LayerSpec

MIB = 1 << 20
MEASURED_LAYERS = 2

# Table 2 of Korthikanti et al., the row each GPT configuration falls in.
PAPER_ROWS = {
    (False, "none"): "sbh(10 + 24/t + 5as/(ht))",
    (True, "none"): "sbh(34/t + 5as/(ht))",
    (False, "selective"): "sbh(10 + 24/t)",
    (True, "selective"): "sbh(34/t)",
    (False, "full"): "2sbh",
    (True, "full"): "2sbh/t",
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
    add("--model", choices=MODELS, default="gpt", help="gpt: the paper's layer; llama: RMSNorm/GQA/SwiGLU")
    add("--hidden", type=positive_int, required=True, help="h, model width")
    add("--heads", type=positive_int, required=True, help="a, attention heads")
    add("--kv-heads", type=positive_int, help="llama: key/value heads (GQA); default: --heads")
    add("--ffn", type=positive_int, help="MLP width; default 4h (gpt) or Llama's 8h/3 rounded to 256")
    add("--seq", type=positive_int, required=True, help="s, tokens per sequence")
    add("--micro-batch", type=positive_int, default=1, help="b, sequences per micro-batch")
    add("--tp", type=positive_int, default=1, help="t, tensor-parallel degree")
    add("--sequence-parallel", action="store_true", help="shard norms/dropouts along the sequence")
    add("--recompute", choices=RECOMPUTE_MODES, default="none")
    add("--distribute-saved-activations", action="store_true", help="full recompute: keep 1/t of the layer input")
    add("--layers", type=positive_int, default=1, help="layers in the model (totals are layers x per layer)")
    add("--dtype", choices=tuple(DTYPES), default="bf16", help="activation dtype")
    add("--measure", action="store_true", help=f"run {MEASURED_LAYERS} real layers on --tp local gloo processes")
    add("--json", action="store_true", help="print one JSON object instead of a table")
    add("--plot", metavar="PATH", help="write a PNG: bytes per layer against sequence length")


def spec_from_args(args: argparse.Namespace) -> LayerSpec:
    """The validated :class:`LayerSpec`; a ``ValueError`` naming the field otherwise."""
    return LayerSpec(
        model=args.model, seq_len=args.seq, micro_batch=args.micro_batch, hidden=args.hidden, heads=args.heads,
        kv_heads=args.kv_heads, ffn=args.ffn, tp=args.tp, sequence_parallel=args.sequence_parallel,
        recompute=args.recompute, distribute_saved_activations=args.distribute_saved_activations,
        layers=args.layers, dtype=args.dtype,
    )


def comparison_specs(spec: LayerSpec) -> dict[str, LayerSpec]:
    """The same layer under each recompute mode (distribution only where it applies: full)."""
    return {
        mode: spec.with_(recompute=mode, distribute_saved_activations=spec.distribute_saved_activations and mode == "full")
        for mode in RECOMPUTE_MODES
    }


def measure(specs: list[LayerSpec]) -> list[dict]:
    """Measure each spec (all of one TP degree) on ``tp`` spawned gloo ranks; per spec, all ranks."""
    from ..distributed.local import run_local

    small = [s.with_(layers=min(s.layers, MEASURED_LAYERS)) for s in specs]
    per_rank = run_local(measure_on_ranks, specs[0].tp, small)
    return [
        {
            "measured_bytes_per_layer": max(rank[i].bytes_per_layer for rank in per_rank),
            "measured_per_rank": [rank[i].bytes_per_layer for rank in per_rank],
            "measured_layers": small[i].layers,
            "measured_storages": [dict(zip(("scope", "dtype", "shape", "bytes"), row)) for row in per_rank[0][i].storages],
        }
        for i in range(len(specs))
    ]


def build_report(spec: LayerSpec, measured: dict | None = None) -> dict:
    """Everything the command prints, as a JSON-ready dict."""
    per_layer = spec.bytes_per_layer()
    outside = spec.outside_layer_terms()
    baseline = comparison_specs(spec)["none"].bytes_per_layer()
    report = {
        "spec": asdict(spec),
        "analytic_bytes_per_layer": per_layer,
        "analytic_bytes_total": spec.layers * per_layer + sum(t.nbytes for t in outside),
        "breakdown": [asdict(t) for t in spec.terms()],
        "outside_layer_terms": [asdict(t) for t in outside],
        "vs_no_recompute": {m: s.bytes_per_layer() / baseline for m, s in comparison_specs(spec).items()},
        "saving_vs_no_recompute": 1 - per_layer / baseline,
    }
    if spec.model == "gpt":
        report["paper_formula"] = PAPER_ROWS[(spec.sequence_parallel or spec.distribute_saved_activations,
                                              spec.recompute)]
    if measured is not None:
        report.update(measured)
        report["measured_over_analytic"] = measured["measured_bytes_per_layer"] / per_layer
    return report


def format_report(report: dict) -> str:
    """A readable table of :func:`build_report`'s dict (MiB, ratios, the term breakdown)."""
    s = report["spec"]
    flags = [f"t={s['tp']}"] + (["sequence parallel"] if s["sequence_parallel"] else []) + (
        ["distributed saved input"] if s["distribute_saved_activations"] else [])
    kv = f" kv={s['kv_heads']}" if s["kv_heads"] else ""
    lines = [
        f"{s['model']} layer: s={s['seq_len']} b={s['micro_batch']} h={s['hidden']} a={s['heads']}{kv} "
        f"{s['dtype']}, {', '.join(flags)}, recompute={s['recompute']}",
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
        lines.append(f"{term['name']:<24}{term['nbytes'] / MIB:>10.4f}{term['nbytes'] / total:>8.1%}  "
                     f"{'yes' if term['split_by_tp'] else 'no'}")
    for term in report["outside_layer_terms"]:
        lines.append(f"{term['name'] + ' (shared)':<24}{term['nbytes'] / MIB:>10.4f}")
    if "measured_bytes_per_layer" in report:
        lines += ["", f"measured ({report['measured_layers']} layers, {s['tp']} gloo ranks): "
                  f"{report['measured_bytes_per_layer'] / MIB:.3f} MiB per layer, "
                  f"measured/analytic {report['measured_over_analytic']:.4f}"]
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
    spec = spec_from_args(args)
    if args.plot:
        check_plot_path(args.plot)
    measured = None
    if args.measure:
        measured = measure([spec])[0]
    report = build_report(spec, measured)
    if args.plot:
        from .plot import plot_memory_vs_seq

        report["plot"] = plot_memory_vs_seq(spec, args.plot, measure_points=args.measure)
    print(json.dumps(report) if args.json else format_report(report))
    return 0
