"""Measured against analytic for one model: ``python -m neuron_ckpt.memory.moe.compare``.

:func:`compare` builds one layer of each kind the model has (:func:`one_layer_each`: DeepSeek's
dense first layer and an MoE layer, Gemma2's sliding and full layers; the vocabulary shrunk,
which no layer reads), applies each recompute choice in
turn to the same model (``apply_recompute`` replaces the previous one), runs the layers once
per choice (:func:`~.measure.measure_layers`, no backward) and returns, per layer kind and
choice, what ``SavedTensorRecorder`` counted and what :func:`~.layer.layer_memory` says.
Under expert parallelism (``setup.ep`` > 1) with the all-to-all each MoE layer is priced at the
rows its experts actually received (:func:`~.measure.received_rows`), which routing decides (the
all-gather form's slots do not depend on it).
``experts=`` prices and builds fewer routed experts, to fit a real-size layer in memory: what a
layer keeps depends on E only through the router's ``[T, E]`` scores and grouped_mm's ``[E]``
offsets (the analytic side is computed for the same E, so the comparison stays exact).

Runs on one process (TP 1), or on every rank of an initialised world with ``setup.tp`` ranks
(:func:`compare_on_ranks` initialises it: ``neuron-ckpt memory --config ... --measure``).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field, replace

from ...recompute import apply_recompute, remove_recompute
from .config import load_moe_config
from .layer import CHOICES, applies, layer_memory
from .measure import build_model, measure_layers, received_rows, recompute_config
from .shape import ATTENTION, EXPERTS, MoESetup, MoEShape


@dataclass(frozen=True)
class Row:
    """One layer kind under one choice: what autograd kept on this rank (``per_rank``: on each rank,
    where the rows were gathered from several), what :func:`~.layer.layer_memory` says autograd
    keeps, and how long the forward took."""

    kind: str
    choice: str
    measured: int
    analytic: int
    seconds: float
    per_rank: list[int] = field(default_factory=list)


def one_layer_each(shape: MoEShape, experts: int | None = None) -> MoEShape:
    """``shape`` with one layer of each kind it has (its first), in their order; ``experts``:
    fewer routed experts."""
    first = [next(i for i in range(shape.layers) if shape.kind_of(i) == kind) for kind in shape.kinds]
    return replace(
        shape,
        layers=len(first),
        dense_layers=tuple(j for j, i in enumerate(first) if shape.is_dense(i)),
        attention_types=tuple(shape.variant(i) for i in first) if shape.attention_types else (),
        experts=experts or shape.experts,
    )


def compare(shape: MoEShape, setup: MoESetup, choices=CHOICES, vocab: int = 128) -> list[Row]:
    """Measured and analytic bytes of each layer of ``shape`` under each choice that applies."""
    kinds = [shape.kind_of(i) for i in range(shape.layers)]
    model = build_model(shape, setup, "none", vocab=vocab)
    rows = []
    for choice in choices:
        if not all(any(applies(shape, k, name) for k in kinds) for name in choice.split("+")):
            continue
        remove_recompute(model)
        config = recompute_config(choice)
        if config is not None:
            apply_recompute(model, config)
        start = time.perf_counter()
        measured = measure_layers(model, setup, backward=False).per_layer_bytes
        seconds = time.perf_counter() - start
        for kind, nbytes, received in zip(kinds, measured, received_rows(model)):
            priced = setup  # the all-gather form's slots do not depend on the routing
            if received is not None and setup.ep_dispatch == "all_to_all":
                priced = replace(setup, ep_rows=received)
            rows.append(Row(kind, choice, nbytes, layer_memory(shape, priced, choice, kind).autograd_bytes, seconds))
    return rows


def compare_on_ranks(shape: MoEShape, setup: MoESetup, choices=CHOICES, vocab: int = 128) -> list[Row]:
    """:func:`compare` on every rank of a local world (``run_local``): the tensor- and
    expert-parallel groups first, where the setup splits."""
    if setup.tp > 1 or setup.sequence_parallel or setup.ep > 1:
        from ...distributed import initialize_model_parallel

        initialize_model_parallel(setup.tp, expert_model_parallel_size=setup.ep)
    return compare(shape, setup, choices, vocab)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m neuron_ckpt.memory.moe.compare", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--config", required=True, help="a transformers config.json or preset (mixtral-8x7b, deepseek-v3)"
    )
    parser.add_argument("--seq", type=int, required=True)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    parser.add_argument("--attention", choices=ATTENTION, default="sdpa")
    parser.add_argument("--experts-impl", choices=EXPERTS, default="grouped_mm")
    parser.add_argument("--experts", type=int, help="build and price this many routed experts instead")
    parser.add_argument("--choices", default=",".join(CHOICES), help="comma-separated recompute choices")
    args = parser.parse_args(argv)
    shape = one_layer_each(load_moe_config(args.config), args.experts)
    setup = MoESetup(args.seq, args.micro_batch, 1, args.dtype, args.attention, args.experts_impl)
    print(
        f"{shape.name}: one layer of each kind ({', '.join(shape.kinds)}), E={shape.experts}, "
        f"s={setup.seq_len} b={setup.micro_batch} {setup.dtype} {setup.attention} {setup.experts}, TP 1"
    )
    print(f"{'kind':<16}{'recompute':<16}{'measured MiB':>14}{'analytic MiB':>14}{'equal':>7}{'forward s':>11}")
    for r in compare(shape, setup, args.choices.split(",")):
        print(
            f"{r.kind:<16}{r.choice:<16}{r.measured / 2**20:>14.3f}{r.analytic / 2**20:>14.3f}"
            f"{'yes' if r.measured == r.analytic else 'NO':>7}{r.seconds:>11.1f}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
