"""What a recompute choice reruns in backward, in FLOPs, as the backend runs it.

One layer's forward is a list of ops in order (:func:`layer_ops`), each with its matmul FLOPs
(what ``torch.utils.flop_counter.FlopCounterMode`` counts: the projections, ``QK^T``, ``probs @
V``, the attention kernel) and its elementwise FLOPs (an estimate, per element: RMSNorm 4,
LayerNorm 8, rotary 3, softmax 5, SwiGLU 5, GeLU 8, dropout 2, residual add 1; casts, copies,
the scaling of q and bias adds are left out). What each recompute unit reruns, from what the
layer keeps (:func:`~.terms.saved_at`, the same terms the memory model counts):

* an ordinary checkpoint (``core_attn``, ``mlp``, a whole layer) reruns its region from its first
  op up to the last save inside it. torch's non-reentrant checkpoint stops its rerun as soon as
  every tensor backward needs is back (its early stop); on XLA the checkpoint is reentrant and
  reruns the whole region, but nothing reads the rest, so the compiler drops it. An aten op saves
  its inputs before it runs, so explicit core attention reruns ``QK^T`` and the softmax, not
  ``probs @ V`` (which keeps ``probs``), and an MLP or a Llama layer stops before the down
  projection (which keeps its input); the flash kernel saves its output, so it reruns whole, and
  the paper's GPT layer saves its last dropout's mask, so it reruns whole too.
* a group of ``k`` layers (full, ``uniform``, ``num_layers=k``) reruns its first ``k - 1``
  layers whole (each output feeds the next) and the last up to its last save: more than ``k``
  layers recomputed one by one. The group's first layer carries the group's cost.
* an output-discarding unit (``mlp_act``, ``norm``) calls its function again: all of it.

Selective modules add up: with ``norm`` and ``mlp`` the MLP checkpoint's input is the discarded
norm output, rerun once, before the MLP. The eager reentrant checkpoint (``use_reentrant=True``,
and ``distribute_saved_activations``, off XLA) reruns every region whole instead:
:func:`rerun_flops` with ``whole=True``.
"""

from __future__ import annotations

from dataclasses import dataclass

from .shape import ModelShape, TrainingSetup
from .terms import LayerSpec, saved_at

# Elementwise FLOPs per element (see the module docstring).
RMSNORM, LAYERNORM, ROTARY, SOFTMAX, SWIGLU, GELU, DROPOUT, ADD = 4, 8, 3, 5, 5, 8, 2, 1

# The ops each selective module covers (an ordinary checkpoint: its region is the span from the
# first to the last of them); ``norm`` is two units, one per norm.
REGIONS: dict[str, tuple[tuple[str, ...], ...]] = {
    # Under context parallelism the attention runs per query chunk: the second's ops end in 2.
    "core_attn": (
        ("scores", "softmax", "attn_dropout", "pv", "attention", "scores2", "softmax2", "pv2", "attention2"),
    ),
    "mlp": (("up", "act", "down"),),
    "mlp_act": (("act",),),
    "norm": (("norm1",), ("norm2",)),
}
DISCARDING = ("mlp_act", "norm")  # output-discarding: rerun whole


@dataclass(frozen=True)
class Flops:
    """FLOPs of some forward work on one rank: in matmuls and elementwise."""

    matmul: float = 0.0
    elementwise: float = 0.0

    @property
    def total(self) -> float:
        return self.matmul + self.elementwise

    def __add__(self, other: Flops) -> Flops:
        return Flops(self.matmul + other.matmul, self.elementwise + other.elementwise)

    def __mul__(self, k: float) -> Flops:
        return Flops(self.matmul * k, self.elementwise * k)


@dataclass(frozen=True)
class Op:
    """One op of a layer's forward, on one rank."""

    name: str
    flops: Flops


def layer_ops(model: ModelShape, setup: TrainingSetup, cp_rank: int | None = None) -> list[Op]:
    """One layer's forward on one rank, op by op, in order, per micro-batch. The matmuls see the
    whole sequence and this rank's heads or MLP columns; the norms, residual adds and hidden
    dropouts see ``s*b/t`` tokens under sequence parallel, ``s*b`` otherwise. Under context
    parallelism ``s`` is this rank's ``s/c`` tokens, and the attention runs once per query chunk
    (``L = s/(2c)`` queries against the keys up to the chunk's end: chunk ``j`` scores ``(j + 1) L^2``
    per head), the second chunk's ops named ``scores2``, ``softmax2``, ``pv2`` / ``attention2``. CP
    rank ``r`` holds chunks ``r`` and ``2c - 1 - r``: together ``(2c + 1) L^2`` on every rank, but
    what a rerun stops short of is the first chunk's, so the price depends on the rank; ``cp_rank``
    None prices rank ``c - 1``, the one whose rerun costs most (the step waits for it)."""
    s, b, t, h, d = setup.local_seq_len, setup.micro_batch, setup.tp, model.hidden, model.head_dim
    a, g, f = model.local_heads(t), model.local_kv_heads(t), model.ffn // t
    tokens = s * b // t if setup.sequence_parallel else s * b
    c, n = setup.cp, s // 2
    square = a * s * s * b  # scores of this rank's heads
    rank = c - 1 if cp_rank is None else cp_rank
    chunks = [a * b * n * (j + 1) * n for j in (rank, 2 * c - 1 - rank)] if c > 1 else [square]

    def mm(n: float) -> Flops:
        return Flops(matmul=2.0 * n)

    def ew(per_element: int, n: float) -> Flops:
        return Flops(elementwise=float(per_element * n))

    if model.kind == "gpt":
        ops = [("norm1", ew(LAYERNORM, tokens * h)), ("qkv", mm(s * b * h * 3 * a * d))]
        attention = [("scores", mm(square * d)), ("softmax", ew(SOFTMAX, square)),
                     ("attn_dropout", ew(DROPOUT, square)), ("pv", mm(square * d))]  # fmt: skip
        ops += [*attention, ("o_proj", mm(s * b * a * d * h)), ("dropout1", ew(DROPOUT, tokens * h))]
        ops += [("residual1", ew(ADD, tokens * h)), ("norm2", ew(LAYERNORM, tokens * h))]
        ops += [("up", mm(s * b * h * f)), ("act", ew(GELU, s * b * f)), ("down", mm(s * b * f * h))]
        ops += [("dropout2", ew(DROPOUT, tokens * h)), ("residual2", ew(ADD, tokens * h))]
        return [Op(n, x) for n, x in ops]
    ops = [("norm1", ew(RMSNORM, tokens * h)), ("qkv", mm(s * b * h * (a + 2 * g) * d))]
    ops.append(("rotary", ew(ROTARY, s * b * (a + g) * d)))
    for i, sq in enumerate(chunks):  # the whole square at CP 1, each query chunk's under CP
        tag = "2" if i else ""
        if setup.attention == "flash":  # one kernel: both matmuls over the whole square, as torch counts
            ops.append(("attention" + tag, mm(2 * sq * d) + ew(SOFTMAX, sq)))
        else:
            ops += [("scores" + tag, mm(sq * d)), ("softmax" + tag, ew(SOFTMAX, sq)), ("pv" + tag, mm(sq * d))]
    ops += [("o_proj", mm(s * b * a * d * h)), ("residual1", ew(ADD, tokens * h))]
    ops += [("norm2", ew(RMSNORM, tokens * h)), ("up", mm(s * b * h * 2 * f)), ("act", ew(SWIGLU, s * b * f))]
    ops += [("down", mm(s * b * f * h)), ("residual2", ew(ADD, tokens * h))]
    return [Op(n, x) for n, x in ops]


def _sum(ops: list[Op]) -> Flops:
    return sum((o.flops for o in ops), Flops())


def _checkpoint(ops: list[Op], saves: list[str], first: int, last: int, whole: bool) -> Flops:
    """What an ordinary checkpoint over ``ops[first..last]`` reruns: up to its last save (or all
    of it, ``whole``)."""
    if whole:
        return _sum(ops[first : last + 1])
    names = [o.name for o in ops]
    stop = first
    for at in saves:
        i = names.index(at.rstrip("+"))
        if first <= i <= last:
            stop = max(stop, i + at.endswith("+"))
    return _sum(ops[first:stop])


def rerun_flops(
    model: ModelShape, setup: TrainingSetup, spec: LayerSpec, whole: bool = False, cp_rank: int | None = None
) -> Flops:
    """The forward FLOPs one layer's backward reruns under ``spec`` (:class:`~.terms.LayerSpec`),
    per micro-batch on one rank; for a group's first layer, the group's. ``whole``: as the eager
    reentrant checkpoint reruns, every region to its end (see the module docstring). ``cp_rank``:
    under context parallelism, the rank priced (:func:`layer_ops`; None: the costliest)."""
    ops = layer_ops(model, setup, cp_rank)
    saves = [at for _, at in saved_at(model, setup)]
    if spec.span == 0:
        return Flops()
    if spec.span is not None:
        layer = _checkpoint(ops, saves, 0, len(ops) - 1, whole)
        return _sum(ops) * (spec.span - 1) + layer
    names = [o.name for o in ops]
    out = Flops()
    for module in spec.modules:
        for region in REGIONS[module]:
            where = [i for i, n in enumerate(names) if n in region]
            if module in DISCARDING:
                out += _sum([ops[i] for i in where])
            else:
                out += _checkpoint(ops, saves, where[0], where[-1], whole)
    return out


__all__ = ["Flops", "Op", "REGIONS", "layer_ops", "rerun_flops"]
