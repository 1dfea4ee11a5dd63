"""A PNG of activation memory per layer against sequence length (``neuron-ckpt memory --plot``).

Six analytic curves: no recompute, selective and full recompute, each with and without sequence
parallelism, for the layer of a :class:`~.spec.LayerSpec` (its other fields fixed). With
``measure_points`` the six configurations are also run for real at the spec's own sequence length
and drawn as markers. matplotlib (an optional dependency, the ``tutorial`` extra) runs headless
with the Agg backend.
"""

from __future__ import annotations

from .analytic import RECOMPUTE_MODES
from .spec import LayerSpec

MIB = 1 << 20
MODES = RECOMPUTE_MODES  # the analytic model's modes
COLORS = {"none": "tab:red", "selective": "tab:blue", "full": "tab:green"}


def sequence_lengths(spec: LayerSpec) -> list[int]:
    """From s/8 to 4s in powers of two, keeping lengths that sequence parallel can split."""
    lengths = {spec.seq_len * 2**k // 8 for k in range(6)}
    return sorted(s for s in lengths if s >= spec.tp and s % spec.tp == 0 and s * 8 // spec.seq_len >= 1)


def _variants(spec: LayerSpec) -> dict[tuple[str, bool], LayerSpec]:
    return {
        (mode, sp): spec.with_(recompute=mode, sequence_parallel=sp, distribute_saved_activations=False)
        for mode in MODES for sp in (False, True)
    }


def plot_memory_vs_seq(spec: LayerSpec, path: str, measure_points: bool = False) -> str:
    """Write the PNG to ``path``; return the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    variants = _variants(spec)
    seqs = sequence_lengths(spec)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for (mode, sp), variant in variants.items():
        ys = [variant.with_(seq_len=s).bytes_per_layer() / MIB for s in seqs]
        ax.plot(seqs, ys, color=COLORS[mode], linestyle="-" if sp else "--", marker=None,
                label=f"{mode}{' + SP' if sp else ''}")
    if measure_points:
        from .report import measure

        results = measure(list(variants.values()))
        for ((mode, sp), _), result in zip(variants.items(), results):
            ax.plot([spec.seq_len], [result["measured_bytes_per_layer"] / MIB], color=COLORS[mode],
                    marker="o" if sp else "x", linestyle="none")
        ax.plot([], [], color="black", marker="o", linestyle="none", label="measured (o: SP, x: no SP)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length s")
    ax.set_ylabel("activation MiB per layer per rank")
    ax.set_title(f"{spec.model}: h={spec.hidden} a={spec.heads} b={spec.micro_batch} t={spec.tp} {spec.dtype}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=100)
    plt.close(fig)
    return path
