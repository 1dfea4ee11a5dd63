"""``neuron-ckpt memory --config CONFIG``: one dense and one MoE layer of a transformers MoE model
under every recompute module, analytic.

:mod:`neuron_ckpt.memory.report` owns the command and hands it here when ``--config`` is given
(:func:`run`): the file (or preset) is read strictly (:func:`~.config.load_moe_config`), the job
is ``--seq``, ``--micro-batch``, ``--tp``, ``--sequence-parallel``, ``--dtype``, ``--attention`` (sdpa |
eager | sdpa-fused) and ``--experts`` (grouped_mm | eager); :func:`build_report` returns the plain dict ``--json``
prints, :func:`format_report` the table. The options that describe a model by hand or a
measurement (``--hidden``, ``--recompute``, ``--measure``...) are refused in one line: the file
gives the sizes, and every recompute module is printed.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict

from .config import load_moe_config
from .layer import CHOICES, LayerMemory, module_table
from .shape import ATTENTION, EXPERTS, MoESetup, MoEShape

MIB, GIB = 1 << 20, 1 << 30

# The command's options that describe a model by hand, measure or plot: not with --config.
HAND_OPTIONS = ("model", "hidden", "heads", "kv_heads", "ffn", "recompute", "distribute_saved_activations", "layers",
                "measure", "plot")  # fmt: skip
_DEFAULTS = {"model": "gpt", "recompute": "none", "layers": 1, "distribute_saved_activations": False,
             "measure": False}  # fmt: skip


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


def setup_from_args(args: argparse.Namespace) -> MoESetup:
    return MoESetup(
        args.seq,
        args.micro_batch,
        args.tp,
        args.dtype,
        args.attention or "sdpa",
        args.experts or "grouped_mm",
        args.sequence_parallel,
    )


def _describe(shape: MoEShape) -> str:
    dense = len(shape.dense_layers)
    attention = (
        f"MLA q_lora={shape.mla.q_lora_rank} kv_lora={shape.mla.kv_lora_rank} "
        f"qk={shape.mla.qk_nope_head_dim}+{shape.mla.qk_rope_head_dim} v={shape.mla.v_head_dim}"
        if shape.mla
        else f"g={shape.kv_heads} d={shape.head_dim}"
    )
    parts = [
        f"h={shape.hidden}",
        f"L={shape.layers} ({dense} dense, {shape.layers - dense} MoE)",
        f"a={shape.heads}",
        attention,
        f"E={shape.experts} k={shape.top_k} F={shape.moe_ffn}",
    ]
    if shape.shared_ffn:
        parts.append(f"shared={shape.shared_ffn}")
    if dense:
        parts.append(f"dense ffn={shape.dense_ffn}")
    return " ".join(parts)


def _known(memory: LayerMemory | None) -> LayerMemory:
    """The "none" column: every layer kind has it (only a module a kind lacks is None)."""
    assert memory is not None
    return memory


def build_report(shape: MoEShape, setup: MoESetup, source: str = "", notices: list[str] | None = None) -> dict:
    """Everything the command prints, as a JSON-ready dict: per layer kind and recompute choice
    the bytes one rank keeps (None where the module does not apply to that kind), the bytes
    outside autograd among them, all layers together, and the no-recompute breakdown."""
    table = module_table(shape, setup)
    dense, moe = len(shape.dense_layers), shape.layers - len(shape.dense_layers)

    def stack(choice: str) -> int:  # a module a kind lacks leaves those layers as they are
        per_kind = {kind: _known(row[choice] or row["none"]).nbytes for kind, row in table.items()}
        return dense * per_kind.get("dense", 0) + moe * per_kind.get("moe", 0)

    return {
        "spec": {"config": source, "name": shape.name, "family": shape.family, "seq_len": setup.seq_len,
                 "micro_batch": setup.micro_batch, "tp": setup.tp, "sequence_parallel": setup.sequence_parallel,
                 "dtype": setup.dtype, "attention": setup.attention,
                 "experts": setup.experts, "layers": shape.layers, "dense_layers": dense, "moe_layers": moe,
                 "description": _describe(shape)},
        "model": {k: v for k, v in asdict(shape).items() if k != "name"},
        "per_layer_bytes": {kind: {c: None if m is None else m.nbytes for c, m in row.items()}
                            for kind, row in table.items()},
        "outside_autograd_bytes": {kind: {c: None if m is None else m.nbytes - m.autograd_bytes
                                          for c, m in row.items()} for kind, row in table.items()},
        "layers_total_bytes": {c: stack(c) for c in CHOICES},
        "breakdown": {kind: [asdict(t) for t in _known(row["none"]).terms] for kind, row in table.items()},
        "notices": list(notices or ()),
    }  # fmt: skip


def format_report(report: dict) -> str:
    """The table of :func:`build_report`'s dict: MiB per layer per rank by kind, GiB for all layers."""
    s, kinds = report["spec"], list(report["per_layer_bytes"])
    title = f"{s['name'] or s['family']} ({s['family']}): {s['description']}"
    lines = [
        *report["notices"],
        title,
        (
            f"s={s['seq_len']} b={s['micro_batch']} {s['dtype']}, t={s['tp']} (the model's TP plan, "
            f"{'' if s['sequence_parallel'] else 'no '}sequence parallel), {s['attention']} attention, "
            f"{s['experts']} experts"
        ),
        "activations per layer per rank (analytic), MiB; '-': the module is not in that layer",
        "",
        f"{'recompute':<16}" + "".join(f"{k + ' layer':>14}" for k in kinds) + f"{'all layers GiB':>16}",
    ]
    for choice in CHOICES:
        cells = [report["per_layer_bytes"][k][choice] for k in kinds]
        lines.append(
            f"{choice:<16}"
            + "".join(f"{'-' if c is None else f'{c / MIB:.3f}':>14}" for c in cells)
            + f"{report['layers_total_bytes'][choice] / GIB:>16.3f}"
        )
    outside = {k: v for k, v in report["outside_autograd_bytes"].get("moe", {}).items() if v}
    if outside:
        lines.append(
            "(moe and full on an MoE layer include the routing replay's indices, held outside autograd: "
            f"{next(iter(outside.values())) / MIB:.3f} MiB)"
        )
    for kind in kinds:
        terms = report["breakdown"][kind]
        total = sum(t["nbytes"] for t in terms)
        lines += ["", f"{kind} layer without recompute: {total / MIB:.3f} MiB", f"{'term':<32}{'MiB':>12}{'share':>8}"]
        lines += [f"{t['name']:<32}{t['nbytes'] / MIB:>12.4f}{t['nbytes'] / total:>8.1%}" for t in terms]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """``neuron-ckpt memory --config ...``; a ``ValueError`` on bad input (the CLI prints one line)."""
    check_options(args)
    setup = setup_from_args(args)
    notices: list[str] = []
    shape = load_moe_config(args.config, notices)
    report = build_report(shape, setup, str(args.config), notices)
    print(json.dumps(report) if args.json else format_report(report))
    return 0


__all__ = ["EXPERTS", "build_report", "check_options", "format_report", "run", "setup_from_args"]
