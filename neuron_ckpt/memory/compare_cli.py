"""``neuron-ckpt compare``: the analytic model next to what a device or a compiler measured.

::

    neuron-ckpt compare --capture runs/trn1-capture                  # what a capture script wrote
    neuron-ckpt compare --config llama2-7b --tp 8 --seq 4096 --recompute selective \\
        --run 8=L8/sysfs.json --run 16=L16/sysfs.json --run 32=L32/sysfs.json \\
        --recompute-run none=L32-none/sysfs.json [--json]

The job is described with ``neuron-ckpt plan``'s options; with ``--capture`` they default to the
capture's own (a value given that differs is refused). ``--run LAYERS=PATH`` (two or more layer
counts) gives reports of the job with that many decoder layers, every one with ``--recompute``;
``--recompute-run PRESET=PATH`` a report at the largest layer count with another preset. PATH is
any file :mod:`.readers` takes (:func:`.readers.detect.source_of` picks the reader). The method,
the uncertainty and the control are :mod:`.compare`'s. Exit status 0 when every comparison
agrees, 1 when one does not, 2 on bad input.
"""

from __future__ import annotations

import argparse
import json

from ..parallel.attention import ATTENTION
from ..recompute import PRESETS
from .capture import SOURCES, read_capture
from .compare import COVERAGE, Comparison, compare
from .plan_cli import DEFAULT_CONFIG, model_from_args
from .readers.detect import read_any
from .shape import DTYPE_BYTES, KINDS, TrainingSetup

HELP = "compare the analytic model with measured device or compiler memory, per layer by difference"
# Option: (default, type). None defaults come from --capture or stay unset.
JOB = {
    "model": ("llama", str),
    "config": (None, str),
    "hidden": (None, int),
    "heads": (None, int),
    "vocab": (None, int),
    "tp": (1, int),
    "dp": (1, int),
    "seq": (None, int),
    "micro_batch": (1, int),
    "dtype": ("bf16", str),
    "sequence_parallel": (True, bool),
    "zero1": (True, bool),
    "attention": ("flash", str),
}
MIB = 1 << 20


def _pair(kind: str):
    def parse(text: str) -> tuple[str, str]:
        key, sep, path = text.partition("=")
        if not sep or not key or not path:
            raise argparse.ArgumentTypeError(f"expected {kind}=PATH, got {text!r}")
        return key, path

    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--capture", metavar="DIR", help="a capture directory (manifest.json): job options and runs from it")
    add(
        "--run",
        type=_pair("LAYERS"),
        action="append",
        default=[],
        metavar="LAYERS=PATH",
        help="a report of the job with LAYERS decoder layers (give two or more layer counts)",
    )
    add(
        "--recompute-run",
        type=_pair("PRESET"),
        action="append",
        default=[],
        metavar="PRESET=PATH",
        help="a report at the largest --run layer count with another recompute preset",
    )
    add("--recompute", choices=PRESETS, default=None, help="the preset of every layer in --run (default none)")
    add("--source", choices=SOURCES, default=None, help="--capture: compare only this report format")
    add("--model", choices=KINDS, default=None)
    add("--config", default=None, help=f"llama: a config.json path or a preset (default {DEFAULT_CONFIG})")
    add("--hidden", type=int, help="gpt: hidden size")
    add("--heads", type=int, help="gpt: attention heads")
    add("--vocab", type=int, help="gpt: vocabulary size")
    add("--tp", type=int, help="tensor-parallel degree (default 1)")
    add("--dp", type=int, help="data-parallel degree: ZeRO-1 shards the optimizer state over it (default 1)")
    add("--seq", type=int, help="sequence length")
    add("--micro-batch", type=int, help="sequences per micro-batch (default 1)")
    add("--dtype", choices=tuple(DTYPE_BYTES), default=None, help="default bf16")
    add("--zero1", action=argparse.BooleanOptionalAction, default=None, help="default on")
    add("--sequence-parallel", action=argparse.BooleanOptionalAction, default=None, help="default on")
    add("--attention", choices=ATTENTION, default=None, help="default flash (what the reference trains with)")
    add("--json", action="store_true", help="one JSON object instead of tables")


def _job(args: argparse.Namespace, capture) -> argparse.Namespace:
    """The job options: given, else the capture's, else the defaults; a conflict is refused."""
    job = argparse.Namespace(**{k: getattr(args, k) for k in JOB})
    saved = capture.job if capture is not None else {}
    for key in saved:
        if key not in JOB:
            raise ValueError(f"{capture.root}: manifest job has {key!r}; known options: {', '.join(JOB)}")
    for key, (default, kind) in JOB.items():
        given, stored = getattr(job, key), saved.get(key)
        if key == "config" and stored is not None and (capture.root / stored).exists():
            stored = str(capture.root / stored)
        if stored is not None and not isinstance(stored, kind):
            raise ValueError(f"{capture.root}: manifest job.{key}: expected {kind.__name__}, got {stored!r}")
        if given is not None and stored is not None and given != stored:
            raise ValueError(
                f"--{key.replace('_', '-')} {given!r} differs from the capture's {stored!r}: "
                f"leave it out to use the capture's"
            )
        setattr(job, key, given if given is not None else stored if stored is not None else default)
    job.layers = 1 if job.model == "gpt" else None  # a per-layer comparison: the count plays no part
    if job.seq is None:
        raise ValueError("--seq is required (or --capture, whose job names it)")
    return job


def _groups(args: argparse.Namespace, capture, base: str, attention: str) -> list[tuple]:
    """(source, attention, preset, runs, recompute_runs) for each comparison to make."""
    if capture is None:
        if not args.run:
            raise ValueError("give --run LAYERS=PATH two or more times, or --capture DIR")
        runs = []
        for layers, path in args.run:
            if not layers.isdigit() or int(layers) < 1:
                raise ValueError(f"--run {layers}={path}: LAYERS must be a positive integer")
            runs.append((int(layers), read_any(path)))
        extra = []
        for preset, path in args.recompute_run:
            if preset not in PRESETS:
                raise ValueError(f"--recompute-run {preset}={path}: PRESET must be one of {PRESETS}")
            extra.append((preset, read_any(path)))
        return [(runs[0][1].source, attention, base, runs, extra)]
    if args.run or args.recompute_run:
        raise ValueError("--run and --recompute-run are for reports given one by one; --capture reads its own runs")
    sources = [s for s in SOURCES if any(s in r.files for r in capture.runs)]
    if args.source is not None:
        if args.source not in sources:
            raise ValueError(f"--source {args.source}: the capture has {', '.join(sources)}")
        sources = [args.source]
    groups = []
    for source in sources:
        for att in sorted({r.attention for r in capture.runs}):
            mine = [r for r in capture.runs if source in r.files and r.attention == att]
            presets = [p for p in PRESETS if sum(r.recompute == p for r in mine) >= 1]
            # A capture's sysfs snapshot: the largest ``total`` polled while the run ran (the peak
            # counters outlive the process and hold earlier runs' peaks unless cleared as root).
            options = {"kind": "current"} if source == "sysfs" else {}
            read = {id(r): read_any(capture.path(r, source), source, **options) for r in mine}
            for preset in presets:
                runs = [(r.layers, read[id(r)]) for r in mine if r.recompute == preset]
                if len({n for n, _ in runs}) < 2:
                    continue
                largest = max(n for n, _ in runs)
                extra = [
                    (r.recompute, read[id(r)])
                    for r in mine
                    if preset == base and r.recompute != base and r.layers == largest
                ]
                groups.append((source, att, preset, runs, extra))
    if not groups:
        raise ValueError(f"{capture.root}: no preset has runs at two or more layer counts")
    return groups


def _line(c: Comparison, preset: str) -> str:
    m = c.measured
    ratio = m.bytes_per_layer / c.predicted if c.predicted else float("nan")
    return (
        f"{preset:<18}{c.predicted / MIB:>14.4f}{m.bytes_per_layer / MIB:>14.4f}{m.uncertainty / MIB:>11.4f}"
        f"{ratio:>8.3f}  {'agrees' if c.agrees else 'disagrees'}{'' if c.resolved else ' (unresolved)'}"
    )


def _to_dict(c: Comparison, attention: str, preset: str) -> dict:
    return {
        "source": c.source,
        "attention": attention,
        "recompute": preset,
        "predicted_bytes_per_layer": c.predicted,
        "measured_bytes_per_layer": c.measured.bytes_per_layer,
        "uncertainty_bytes_per_layer": c.measured.uncertainty,
        "quantum": c.quantum,
        "per_core": {
            str(k): {"measured_bytes_per_layer": s.bytes_per_layer, "uncertainty_bytes_per_layer": s.uncertainty}
            for k, s in c.per_core.items()
        },
        "control": c.control,
        "savings": c.savings,
        "agrees": c.agrees,
        "resolved": c.resolved,
        "verdict": c.verdict(),
        "notes": c.notes,
    }


def run(args: argparse.Namespace) -> int:
    capture = read_capture(args.capture) if args.capture else None
    job = _job(args, capture)
    model = model_from_args(job)
    base = args.recompute or "none"
    results = []
    for _source, attention, preset, runs, extra in _groups(args, capture, base, job.attention):
        setup = TrainingSetup(
            seq_len=job.seq,
            micro_batch=job.micro_batch,
            tp=job.tp,
            dp=job.dp,
            dtype=job.dtype,
            sequence_parallel=job.sequence_parallel,
            zero1=job.zero1,
            attention=attention,
        )
        results.append((attention, preset, compare(model, setup, preset, runs, extra)))
    primary = next((r for r in results if r[1] == base), results[0])
    if args.json:
        out = _to_dict(primary[2], primary[0], primary[1])
        out["comparisons"] = [_to_dict(c, a, p) for a, p, c in results]
        out["capture_notes"] = list(capture.notes) if capture else []
        print(json.dumps(out, indent=2))
    else:
        _print(model, job, results, capture)
    agree = all(c.agrees and all(s["agrees"] for s in c.savings) for _, _, c in results)
    return 0 if agree else 1


def _print(model, job, results, capture) -> None:
    print(
        f"{model.name or model.kind}: h={model.hidden} a={model.heads} g={model.kv_heads} f={model.ffn} | "
        f"tp={job.tp} dp={job.dp} s={job.seq} b={job.micro_batch} {job.dtype} "
        f"sequence_parallel={job.sequence_parallel} zero1={job.zero1}"
    )
    for note in capture.notes if capture else ():
        print(f"capture note: {note}")
    shown = None
    for attention, preset, c in results:
        if (c.source, attention) != shown:
            shown = (c.source, attention)
            page = "exact bytes, no page"
            if c.quantum:
                page = f"page {c.quantum / MIB:,.0f} MiB" if c.quantum >= 64 * MIB else f"printed to {c.quantum:,} B"
            what = " + ".join(COVERAGE[c.source].measured) + (
                " (with the layers' state)" if COVERAGE[c.source].with_state else ""
            )
            print(f"\n{c.source}: {what}, {page}; {attention} attention; MiB per layer, the largest core")
            print(f"{'recompute':<18}{'predicted':>14}{'measured':>14}{'±':>11}{'ratio':>8}")
        print(_line(c, preset))
        if len(c.per_core) > 1:
            for core, s in c.per_core.items():
                print(f"  core {core:<12}{'':>14}{s.bytes_per_layer / MIB:>14.4f}{s.uncertainty / MIB:>11.4f}")
        if c.control is not None:
            k = c.control
            print(
                f"  control: {k['category']} per layer {k['measured']:,.0f} B vs {k['state']} {k['predicted']:,} B: "
                f"{'ok' if k['ok'] else 'FAILS'}"
            )
        for s in c.savings:
            print(
                f"  saving of {s['preset']} at {s['layers']} layers: predicted {s['predicted'] / MIB:,.3f} MiB, "
                f"measured {s['measured'] / MIB:,.3f} MiB (±{s['uncertainty'] / MIB:,.0f}): "
                f"{'agrees' if s['agrees'] else 'disagrees'}"
            )
        for note in c.notes:
            print(f"  note: {note}")
        print(f"  verdict: {c.verdict()}")


__all__ = ["HELP", "add_arguments", "run"]
