"""``neuron-ckpt memory --config CONFIG``: each layer kind of a transformers model (any family of
:mod:`.families`) under every recompute module, analytic, and with ``--measure`` measured.

:mod:`neuron_ckpt.memory.report` owns the command and hands it here when ``--config`` is given
(:func:`run`): the file (or preset) is read (:func:`~.config.load_moe_config`), the job is
``--seq``, ``--micro-batch``, ``--tp``, ``--sequence-parallel``, ``--dtype``, ``--attention`` (sdpa |
eager | sdpa-fused; default sdpa, or eager for the families transformers runs eager only),
``--experts`` (grouped_mm | eager) and, under expert parallelism, ``--ep``, ``--ep-rows`` (the
all-to-all's), ``--ep-dispatch`` and ``--capacity-factor`` (the all-gather form's);
:func:`build_report` returns the plain dict ``--json`` prints, :func:`format_report` the table.
``--measure`` builds one real layer of each kind (the vocabulary shrunk) on ``--tp`` local gloo
processes and counts what autograd keeps under each module (:func:`~.compare.compare`). The
options that describe a model by hand (``--hidden``, ``--recompute``...) are refused in one line:
the file gives the sizes, and every recompute module is printed.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict

from . import all_gather
from .config import load_moe_config
from .experts import expert_weight_bytes, received_rows
from .families import FAMILY
from .layer import CHOICES, LayerMemory, module_table
from .shape import ATTENTION, EXPERTS, MoESetup, MoEShape

MIB, GIB = 1 << 20, 1 << 30

# The command's options that describe a model by hand or plot: not with --config.
HAND_OPTIONS = ("model", "hidden", "heads", "kv_heads", "ffn", "recompute", "distribute_saved_activations", "layers",
                "plot")  # fmt: skip
_DEFAULTS = {"model": "gpt", "recompute": "none", "layers": 1, "distribute_saved_activations": False}


def check_options(args: argparse.Namespace) -> None:
    """One ``ValueError`` naming every option that ``--config`` replaces."""
    given = [name for name in HAND_OPTIONS if getattr(args, name, None) not in (None, _DEFAULTS.get(name))]
    if given:
        flags = ", ".join("--" + name.replace("_", "-") for name in given)
        raise ValueError(f"--config gives the model and prints every recompute module: drop {flags}")
    if args.attention is not None and args.attention not in ATTENTION:
        raise ValueError(
            f"--attention with --config is transformers' implementation, one of {ATTENTION}, got {args.attention!r}"
        )


def setup_from_args(args: argparse.Namespace, shape: MoEShape | None = None) -> MoESetup:
    """The job; ``--attention`` by default what transformers runs for ``shape``'s family."""
    family = FAMILY[shape.family] if shape is not None else None
    if args.experts is not None and family is not None and not family.moe:
        raise ValueError(f"--experts: {shape.family} has no experts (a dense family)")  # type: ignore[union-attr]  # family set: shape given
    attention = args.attention or ("eager" if family is not None and family.eager_only else "sdpa")
    experts, sp = args.experts or "grouped_mm", args.sequence_parallel
    ep, rows = getattr(args, "ep", 1), getattr(args, "ep_rows", "balanced")
    form, cf = getattr(args, "ep_dispatch", "all_to_all"), getattr(args, "capacity_factor", None)
    return MoESetup(args.seq, args.micro_batch, args.tp, args.dtype, attention, experts, sp, ep, rows, form, cf)


def describe(shape: MoEShape) -> str:
    """The sizes of ``shape`` in one line (``h=4096 L=32 (32 moe) a=32 g=8 d=128 E=8 k=2 F=14336``)."""
    attention = (
        f"MLA q_lora={shape.mla.q_lora_rank} kv_lora={shape.mla.kv_lora_rank} "
        f"qk={shape.mla.qk_nope_head_dim}+{shape.mla.qk_rope_head_dim} v={shape.mla.v_head_dim}"
        if shape.mla
        else f"g={shape.kv_heads} d={shape.head_dim}"
    )
    kinds = ", ".join(f"{shape.count(k)} {k}" for k in shape.kinds)
    parts = [f"h={shape.hidden}", f"L={shape.layers} ({kinds})", f"a={shape.heads}", attention]
    if shape.experts:
        parts.append(f"E={shape.experts} k={shape.top_k} F={shape.moe_ffn}")
    if shape.shared_ffn:
        parts.append(f"shared={shape.shared_ffn}")
    if shape.dense_layers:
        parts.append(f"dense ffn={shape.dense_ffn}")
    if shape.window:
        parts.append(f"window={shape.window}")
    return " ".join(parts)


def _known(memory: LayerMemory | None) -> LayerMemory:
    """The "none" column: every layer kind has it (only a module a kind lacks is None)."""
    assert memory is not None
    return memory


def build_report(
    shape: MoEShape, setup: MoESetup, source: str = "", notices: list[str] | None = None, measured: list | None = None
) -> dict:
    """Everything the command prints, as a JSON-ready dict: per layer kind and recompute choice
    the bytes one rank keeps (None where the module does not apply to that kind), the bytes
    outside autograd among them, all layers together, the no-recompute breakdown, and with
    ``measured`` (:func:`measure`'s rows) what autograd kept, by kind and choice."""
    table = module_table(shape, setup)
    dense = len(shape.dense_layers)

    def stack(choice: str) -> int:  # a module a kind lacks leaves those layers as they are
        return sum(shape.count(kind) * _known(row[choice] or row["none"]).nbytes for kind, row in table.items())

    report = {
        "spec": {"config": source, "name": shape.name, "family": shape.family, "seq_len": setup.seq_len,
                 "micro_batch": setup.micro_batch, "tp": setup.tp, "sequence_parallel": setup.sequence_parallel,
                 "dtype": setup.dtype, "attention": setup.attention,
                 "experts": setup.experts, "ep": setup.ep,
                 "ep_rows": setup.ep_rows if setup.ep_dispatch == "all_to_all" else None,
                 "received_rows": received_rows(shape, setup) if setup.ep > 1 and shape.experts else None,
                 **_gathered(shape, setup),
                 "expert_weight_bytes": expert_weight_bytes(shape, setup) if shape.experts else None,
                 "layers": shape.layers, "dense_layers": dense,
                 "moe_layers": shape.layers - dense, "kinds": {k: shape.count(k) for k in shape.kinds},
                 "description": describe(shape)},
        "model": {k: v for k, v in asdict(shape).items() if k != "name"},
        "per_layer_bytes": {kind: {c: None if m is None else m.nbytes for c, m in row.items()}
                            for kind, row in table.items()},
        "outside_autograd_bytes": {kind: {c: None if m is None else m.nbytes - m.autograd_bytes
                                          for c, m in row.items()} for kind, row in table.items()},
        "layers_total_bytes": {c: stack(c) for c in CHOICES},
        "breakdown": {kind: [asdict(t) for t in _known(row["none"]).terms] for kind, row in table.items()},
        "notices": list(notices or ()),
    }  # fmt: skip
    if measured is not None:
        report["measured"] = {
            kind: {r.choice: {"measured": r.measured, "analytic": r.analytic, "per_rank": r.per_rank}
                   for r in measured if r.kind == kind}
            for kind in dict.fromkeys(r.kind for r in measured)
        }  # fmt: skip
    return report


def _gathered(shape: MoEShape, setup: MoESetup) -> dict:
    """The all-gather form's figures (None without it): its capacity (slots per expert) and the
    most routes it can drop per MoE layer, on one rank and over the EP group."""
    if setup.ep == 1 or not shape.experts or setup.ep_dispatch != "all_gather":
        return {"ep_dispatch": setup.ep_dispatch, "capacity_factor": None, "capacity": None,
                "dropped_routes_worst": None}  # fmt: skip
    rank, group = all_gather.dropped_worst(shape, setup)
    return {"ep_dispatch": setup.ep_dispatch, "capacity_factor": setup.capacity_factor,
            "capacity": all_gather.capacity(shape, setup),
            "dropped_routes_worst": {"rank": rank, "group": group}}  # fmt: skip


_EP_ROWS = {
    "balanced": "T' k, T' the tokens each rank dispatches",
    "worst": "dropless worst case: e T' min(k, E/e), every route that can land on one rank",
}


def _expert_lines(s: dict) -> list[str]:
    """The expert-parallel line (EP > 1) and the routed experts' weights per rank."""
    lines = []
    if s["ep"] > 1 and s["capacity"] is not None:
        cf, worst = s["capacity_factor"], s["dropped_routes_worst"]
        lines.append(
            f"ep={s['ep']} (E/{s['ep']} whole experts per rank, all-gather dispatch, "
            + (f"capacity factor {cf}" if cf is not None else "dropless")
            + f"): {s['capacity']:,} slots per expert, {s['received_rows']:,} rows per MoE layer per rank; "
            f"routes dropped per MoE layer at worst: {worst['rank']:,} on a rank, {worst['group']:,} in the EP group"
        )
    elif s["ep"] > 1 and s["received_rows"] is not None:
        lines.append(
            f"ep={s['ep']} (E/{s['ep']} whole experts per rank, all-to-all dispatch): {s['received_rows']:,} rows "
            f"received per MoE layer per rank ({s['ep_rows']}: {_EP_ROWS[s['ep_rows']]})"
        )
    if s["expert_weight_bytes"]:
        lines.append(f"routed experts' weights per MoE layer per rank: {s['expert_weight_bytes'] / MIB:,.1f} MiB")
    return lines


def format_report(report: dict) -> str:
    """The table of :func:`build_report`'s dict: MiB per layer per rank by kind, GiB for all layers."""
    s, kinds = report["spec"], list(report["per_layer_bytes"])
    width = max(14, *(len(k) + 8 for k in kinds))
    lines = [
        *report["notices"],
        f"{s['name'] or s['family']} ({s['family']}): {s['description']}",
        (
            f"s={s['seq_len']} b={s['micro_batch']} {s['dtype']}, t={s['tp']} (the model's TP plan, "
            f"{'' if s['sequence_parallel'] else 'no '}sequence parallel), {s['attention']} attention"
            + (f", {s['experts']} experts" if s["moe_layers"] else "")
        ),
        *_expert_lines(s),
        "activations per layer per rank (analytic), MiB; '-': the module is not in that layer",
        "",
        f"{'recompute':<16}" + "".join(f"{k + ' layer':>{width}}" for k in kinds) + f"{'all layers GiB':>16}",
    ]
    for choice in CHOICES:
        cells = [report["per_layer_bytes"][k][choice] for k in kinds]
        if all(c is None for c in cells):  # a module no layer of this model has
            continue
        lines.append(
            f"{choice:<16}"
            + "".join(f"{'-' if c is None else f'{c / MIB:.3f}':>{width}}" for c in cells)
            + f"{report['layers_total_bytes'][choice] / GIB:>16.3f}"
        )
    outside = [v for k in kinds for v in report["outside_autograd_bytes"][k].values() if v]
    if outside:
        lines.append(
            "(moe and full on an MoE layer include the routing replay's indices, held outside autograd: "
            f"{outside[0] / MIB:.3f} MiB)"
        )
    for kind in kinds:
        terms = report["breakdown"][kind]
        total = sum(t["nbytes"] for t in terms)
        lines += ["", f"{kind} layer without recompute: {total / MIB:.3f} MiB", f"{'term':<32}{'MiB':>12}{'share':>8}"]
        lines += [f"{t['name']:<32}{t['nbytes'] / MIB:>12.4f}{t['nbytes'] / total:>8.1%}" for t in terms]
    if "measured" in report:
        lines += [
            "",
            (
                f"measured (one layer of each kind, {_world(s['tp'], s['ep'])} gloo ranks): what autograd kept, MiB "
                "per rank (the routing replay's indices are outside it"
                + ("; each rank priced at the rows its experts received, the largest shown)" if s["ep"] > 1 else ")")
            ),
            f"{'kind':<16}{'recompute':<16}{'measured':>12}{'analytic':>12}{'equal':>7}",
        ]
        for kind, rows in report["measured"].items():
            lines += [
                f"{kind:<16}{c:<16}{r['measured'] / MIB:>12.3f}{r['analytic'] / MIB:>12.3f}"
                f"{'yes' if r['measured'] == r['analytic'] else 'NO':>7}"
                for c, r in rows.items()
            ]
    return "\n".join(lines)


def _world(tp: int, ep: int) -> int:
    """The smallest world that runs TP ``tp`` and EP ``ep`` (EP is carved from the TP x DP ranks)."""
    return tp * ep // math.gcd(tp, ep)


def measure(shape: MoEShape, setup: MoESetup) -> list:
    """:func:`~.compare.compare` of one layer of each kind on ``setup.tp`` spawned gloo ranks (the
    least common multiple of TP and EP under expert parallelism): per kind and choice, the largest
    rank's bytes, with every rank's; under EP the analytic side is each rank's at the rows its
    experts received, and the largest is shown."""
    from ...distributed.local import run_local
    from .compare import Row, compare_on_ranks, one_layer_each

    per_rank = run_local(compare_on_ranks, _world(setup.tp, setup.ep), one_layer_each(shape), setup)
    return [
        Row(
            r.kind,
            r.choice,
            max(rank[i].measured for rank in per_rank),
            max(rank[i].analytic for rank in per_rank),  # under EP each rank's at the rows it received
            r.seconds,
            [rank[i].measured for rank in per_rank],
        )  # fmt: skip
        for i, r in enumerate(per_rank[0])
    ]


def run(args: argparse.Namespace) -> int:
    """``neuron-ckpt memory --config ...``; a ``ValueError`` on bad input (the CLI prints one line)."""
    check_options(args)
    notices: list[str] = []
    shape = load_moe_config(args.config, notices)
    setup = setup_from_args(args, shape)
    report = build_report(shape, setup, str(args.config), notices)  # the analytic side checks the job first
    if args.measure:
        report = build_report(shape, setup, str(args.config), notices, measure(shape, setup))
    print(json.dumps(report) if args.json else format_report(report))
    return 0


__all__ = ["EXPERTS", "build_report", "check_options", "describe", "format_report", "measure", "run", "setup_from_args"]
