"""A PNG of activation memory per layer against sequence length (``neuron-ckpt memory --plot``).

One analytic curve per recompute preset the model prices, each with and without sequence
parallelism (:func:`variants`), for one layer of a :class:`~.shape.ModelShape` run as a
:class:`~.shape.TrainingSetup` says (its other fields fixed). ``measured`` points, when the
caller ran the variants for real at the setup's own sequence length, are drawn as markers.
matplotlib (an optional dependency, the ``tutorial`` extra) runs headless with the Agg backend.
"""

from __future__ import annotations

from dataclasses import replace

from ..recompute import PRESETS
from .analytic import layer_activation_bytes, supported_presets
from .shape import ModelShape, TrainingSetup

MIB = 1 << 20
COLORS = dict(zip(PRESETS, ("tab:red", "tab:blue", "tab:purple", "tab:orange", "tab:green")))  # by increasing recompute


def sequence_lengths(setup: TrainingSetup) -> list[int]:
    """From s/8 to 4s in powers of two, keeping lengths that sequence parallel (and context
    parallel: ``2c`` chunks, ``2ct`` with sequence parallel) can split."""
    lengths = {setup.seq_len * 2**k // 8 for k in range(6)}
    step = (2 * setup.cp if setup.cp > 1 else 1) * setup.tp
    return sorted(s for s in lengths if s >= step and s % step == 0 and s * 8 // setup.seq_len >= 1)


def variants(model: ModelShape, setup: TrainingSetup) -> dict[tuple[str, bool], TrainingSetup]:
    """The curves: (preset, sequence parallel) -> the setup it runs with."""
    presets = supported_presets(model)
    return {(name, sp): replace(setup, sequence_parallel=sp) for name in presets for sp in (False, True)}


def plot_memory_vs_seq(
    model: ModelShape, setup: TrainingSetup, path: str, measured: dict[tuple[str, bool], float] | None = None
) -> str:
    """Write the PNG to ``path``; return the path. ``measured``: bytes per layer of each variant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seqs = sequence_lengths(setup)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for (name, sp), variant in variants(model, setup).items():
        ys = [layer_activation_bytes(model, replace(variant, seq_len=s), name) / MIB for s in seqs]
        ax.plot(
            seqs,
            ys,
            color=COLORS[name],
            linestyle="-" if sp else "--",
            marker=None,
            label=f"{name}{' + SP' if sp else ''}",
        )
    if measured is not None:
        for (name, sp), nbytes in measured.items():
            ax.plot([setup.seq_len], [nbytes / MIB], color=COLORS[name], marker="o" if sp else "x", linestyle="none")
        ax.plot([], [], color="black", marker="o", linestyle="none", label="measured (o: SP, x: no SP)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length s")
    ax.set_ylabel("activation MiB per layer per rank")
    ax.set_title(
        f"{model.kind}: h={model.hidden} a={model.heads} b={setup.micro_batch} t={setup.tp} {setup.dtype}, "
        f"{setup.attention} attention"
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=100)
    plt.close(fig)
    return path
