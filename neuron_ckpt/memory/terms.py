"""What one layer keeps for backward under a recompute choice, and what its recompute brings back.

Each layer (the paper's GPT layer, our Llama layer) is first written as the tensors it keeps
with no recompute, in forward order, each with a *role*: whose input or output it is. One set of
rules then turns that list into the terms a layer keeps under any selective module set or full
recompute (:func:`layer_terms`) and the moments its backward recomputes something
(:class:`RecomputeEvent`). The rules, module by module (docs/memory.md, "Every recompute
choice"):

* ``core_attn``: an ordinary checkpoint around core attention: its inputs (q, k, v) stay, its own
  tensors go (explicit: the ``s^2`` terms; flash: the logsumexp).
* ``mlp``: an ordinary checkpoint around the MLP: its input stays (a 1/t slice when distributed),
  everything inside goes.
* ``mlp_act``: output-discarding around the activation: its inputs stay, its output (what the
  down projection / fc2 keeps) goes. Inside ``mlp`` it changes nothing (the outermost wins).
* ``norm``: output-discarding around both norms: each norm's input stays (a 1/t slice when
  distributed), its own tensors (Llama's fp32 1/rms) and its output (what the QKV projection and
  the MLP keep) go, also when that keeper is the ``mlp`` checkpoint.
* full recompute: a layer that starts a checkpoint keeps its input (a 1/t slice when
  distributed); the other layers of a group keep nothing.

Each term also says where the forward saves it (:func:`saved_at`): the op that keeps it last, as
that op's input (saved before the op runs) or its output (after). A checkpoint's rerun stops at
the last of its region's saves (:mod:`.rerun` prices it from there).

A recompute event happens in the layer's backward when the layer still holds ``held`` bytes of
its own terms (those before the recomputed part in forward order, and the part's own saved
inputs) and ``again`` bytes come back: what the rerun saves as new storages (a rerun's detached
inputs share the kept ones' storage; core attention copies q, and the flash kernel q, k, v and
its output) and, for output-discarding, the recomputed output handed to its consumer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .shape import ModelShape, TrainingSetup

_FP32, _BOOL, _INT64 = 4, 1, 8


@dataclass(frozen=True)
class ActivationTerm:
    """One tensor kept for backward: its name, its bytes on one rank, and whether TP split it."""

    name: str
    nbytes: int
    split_by_tp: bool


@dataclass(frozen=True)
class RecomputeEvent:
    """A recompute during one layer's backward: ``unit`` (a module name, or ``layers i-j``)
    reruns while the layer holds ``held`` bytes of its own terms, and ``again`` bytes come back."""

    unit: str
    held: int
    again: int


@dataclass(frozen=True)
class _Term:
    term: ActivationTerm
    role: str  # "norm1.in", "norm1.own", "norm1.out", "core.in", "core.own", "norm2.*", "act.in", "act.out", ""
    at: str  # the op that saves it last (:mod:`.rerun`'s names): "op" before it runs, "op+" after


@dataclass(frozen=True)
class LayerSpec:
    """How one layer runs: ``modules`` the selective modules in effect (empty: none, or full);
    ``span``: None (not fully recomputed), k >= 1 (starts a full checkpoint of k layers) or 0
    (inside another layer's checkpoint); ``distribute``: checkpoint inputs kept as 1/t slices."""

    modules: tuple[str, ...] = ()
    span: int | None = None
    distribute: bool = False


def layer_terms(
    model: ModelShape, setup: TrainingSetup, spec: LayerSpec
) -> tuple[list[ActivationTerm], list[RecomputeEvent]]:
    """The terms one layer keeps (forward order) and its recompute events, under ``spec``."""
    none, core_again = (_gpt if model.kind == "gpt" else _llama)(model, setup)
    if spec.span == 0:
        return [], []
    w, t = setup.width, setup.tp
    numel = setup.local_seq_len * setup.micro_batch * model.hidden // (t if setup.sequence_parallel else 1)
    slice_ = w * -(-numel // t) if spec.distribute else w * numel  # a distributed input: ceil(numel/t)
    gathered = t * slice_ if spec.distribute else 0  # all-gathered back for the rerun: a new storage
    if spec.span is not None:
        total = sum(x.term.nbytes for x in none)
        kept = ActivationTerm("layer_input", slice_, setup.sequence_parallel or spec.distribute)
        again = spec.span * total - w * numel + gathered  # the rerun's input is the kept one, or gathered
        again += spec.span * _regathered_in_rerun(model, setup)
        return [kept], [RecomputeEvent("layer" if spec.span == 1 else f"{spec.span} layers", slice_, again)]
    return _selective(none, set(spec.modules), core_again, slice_, gathered)


def _regathered_in_rerun(model: ModelShape, setup: TrainingSetup) -> int:
    """What a layer's rerun keeps more than its forward under context parallelism: inside a
    checkpoint's rerun the regather steps aside, so its attention keeps the gathered K and V
    (``c`` times this rank's) where the forward kept this rank's rows: ``(c - 1)`` times them."""
    if setup.cp == 1 or model.kind != "llama":
        return 0
    kv = setup.width * setup.local_seq_len * setup.micro_batch * model.local_kv_heads(setup.tp) * model.head_dim
    return (setup.cp - 1) * 2 * kv


def saved_at(model: ModelShape, setup: TrainingSetup) -> list[tuple[str, str]]:
    """Each term the layer keeps without recompute, in forward order, with where the forward saves
    it last: ``(role, at)``, ``at`` an op of :func:`~.rerun.layer_ops` (``"op"``: as its input,
    before it runs; ``"op+"``: as its output, after). A checkpoint's rerun stops at the last save
    of its region: what is kept decides what is rerun."""
    none, _ = (_gpt if model.kind == "gpt" else _llama)(model, setup)
    return [(x.role, x.at) for x in none]


def term_roles(model: ModelShape, setup: TrainingSetup) -> dict[str, str]:
    """Each term's role by its name (``"norm1.in"``, ``"core.own"``, ``""`` for the projection
    input and the masks after the row layers), and ``"layer"`` for full recompute's
    ``layer_input``: what :mod:`.offload` reads to know which module keeps a term."""
    none, _ = (_gpt if model.kind == "gpt" else _llama)(model, setup)
    return {**{x.term.name: x.role for x in none}, "layer_input": "layer"}


def _selective(none: Sequence[_Term], modules: set[str], core_again: int, slice_: int, gathered: int):
    mlp, norm = "mlp" in modules, "norm" in modules
    act_out = mlp or "mlp_act" in modules
    dropped = {
        "core.own": "core_attn" in modules,
        "norm1.own": norm,
        "norm2.own": norm,
        "norm1.out": norm,
        "norm2.out": norm,
        "act.in": mlp,
        "act.out": act_out,
    }
    by_role: dict[str, int] = {}
    for x in none:
        by_role[x.role] = by_role.get(x.role, 0) + x.term.nbytes
    kept: list[ActivationTerm] = []
    events: list[RecomputeEvent] = []

    def event(unit: str, again: int) -> None:
        events.append(RecomputeEvent(unit, sum(k.nbytes for k in kept), again))

    for i, x in enumerate(none):
        role, term = x.role, x.term
        if dropped.get(role):
            continue
        sliced = (norm and role.endswith(".in") and role.startswith("norm")) or (mlp and role == "norm2.out")
        kept.append(ActivationTerm(term.name, slice_, term.split_by_tp) if sliced else term)
        if norm and role in ("norm1.in", "norm2.in"):
            j = role[:5]
            again = by_role.get(f"{j}.out", 0) + by_role.get(f"{j}.own", 0) + gathered
            if j == "norm2" and mlp:  # the MLP checkpoint's input is the discarded norm output
                event("norm+mlp", again + by_role["act.in"] + by_role["act.out"])
            else:
                event(j, again)
        last_of_role = i + 1 == len(none) or none[i + 1].role != role
        if role == "core.in" and last_of_role and "core_attn" in modules:
            event("core_attn", core_again)
        elif role == "norm2.out" and mlp:
            event("mlp", by_role["act.in"] + by_role["act.out"] + gathered)
        elif role == "act.in" and last_of_role and act_out and not mlp:
            event("mlp_act", by_role["act.out"])
    return kept, events


# --------------------------------------------------------------------------------------------
# The paper's GPT layer: activations ``setup.width`` bytes wide, dropout masks 1 byte. Under TP
# alone the norms, the QKV and fc1 inputs and the dropouts after the row-parallel layers see the
# full [s, b, h] activation on every rank (10sbh); everything between a column and a row layer is
# split by heads or by the 4h dimension (24sbh/t + 5as^2b/t). LayerNorm's mean and 1/std
# (2 x [s, b, 1] per norm) are left out, as the paper leaves them out.

# name, units of sbh (of as^2b for the core), is a mask, split by t under TP without SP, role, saved at
# (aten ops save their inputs before they run and their outputs after; LayerNorm is aten's).
_GPT: tuple[tuple[str, int, bool, bool, str, str], ...] = (
    ("ln1_input", 1, False, False, "norm1.in", "norm1"),
    ("qkv_input", 1, False, False, "norm1.out", "qkv"),
    ("q_k", 2, False, True, "core.in", "scores"),
    ("v", 1, False, True, "core.in", "pv"),
    ("softmax_out", 1, False, True, "core.own", "softmax+"),
    ("softmax_dropout_mask", 1, True, True, "core.own", "attn_dropout+"),
    ("attn_dropout_out", 1, False, True, "core.own", "pv"),
    ("proj_input", 1, False, True, "", "o_proj"),
    ("attn_dropout_mask", 1, True, False, "", "dropout1+"),
    ("ln2_input", 1, False, False, "norm2.in", "norm2"),
    ("mlp_fc1_input", 1, False, False, "norm2.out", "up"),
    ("gelu_input", 4, False, True, "act.in", "act"),
    ("fc2_input", 4, False, True, "act.out", "down"),
    ("mlp_dropout_mask", 1, True, False, "", "dropout2+"),
)


def _gpt(model: ModelShape, setup: TrainingSetup) -> tuple[list[_Term], int]:
    t, w, sp = setup.tp, setup.width, setup.sequence_parallel
    sbh = setup.seq_len * setup.micro_batch * model.hidden
    as2b = model.heads * setup.seq_len * setup.seq_len * setup.micro_batch
    terms = []
    for name, units, is_mask, split_under_tp, role, at in _GPT:
        if sp and t > 1 and at in ("qkv", "up"):
            at += "+"  # the sequence-parallel column linear: an autograd Function, saves after it runs
        split = split_under_tp or sp
        nbytes = units * (_BOOL if is_mask else w) * (as2b if role == "core.own" else sbh)
        terms.append(_Term(ActivationTerm(name, nbytes // t if split else nbytes, split), role, at))
    # The rerun copies q (scaled) and keeps the three core terms again.
    core_again = w * sbh // t + sum(x.term.nbytes for x in terms if x.role == "core.own")
    return terms, core_again


# --------------------------------------------------------------------------------------------
# The Llama layer (docs/memory.md, "The Llama layer").


def _llama(model: ModelShape, setup: TrainingSetup) -> tuple[list[_Term], int]:
    # s: this rank's tokens of the sequence, s/c under context parallelism (every per-token term).
    s, b, h, t, w, c = setup.local_seq_len, setup.micro_batch, model.hidden, setup.tp, setup.width, setup.cp
    sp = setup.sequence_parallel
    sb = s * b // t if sp else s * b  # replicated over TP without sequence parallel, a shard with it
    d, a_loc, g_loc, f_loc = model.head_dim, model.local_heads(t), model.local_kv_heads(t), model.ffn // t
    flash = setup.attention == "flash"
    if flash and setup.flash_kernel == "nki":  # trn1: k and v repeated to the query heads, kept so
        g_loc = a_loc
    q, kv, f = w * s * b * a_loc * d, w * s * b * g_loc * d, w * s * b * f_loc
    if c > 1:
        own, gathered = _context_parallel_core(setup, q, kv, a_loc, s)
    elif not flash:
        # The fused masked softmax keeps only its output, in the activation dtype: the tensor
        # the matmul with V keeps too (one storage).
        own, gathered = [("probs", w * a_loc * s * s * b, "pv")], 0
    else:
        # torch's flash kernel: contiguous [b, heads, s, d] copies of q, k, v (k and v at kv
        # heads) instead of the rotary outputs, its output (the projection's input) and one
        # fp32 logsumexp per query row.
        own, gathered = [("softmax_lse_fp32", _FP32 * a_loc * s * b, "attention+")], 2 * kv + q
    # Where each is saved: our fused RMSNorm, SwiGLU and sequence-parallel column linear are
    # autograd Functions, which save after they run; aten ops (matmuls, the flash kernel) save
    # their inputs before and their outputs after.
    column = "+" if sp and t > 1 else ""
    rows = [
        # The fused RMSNorm keeps its input and the [s, b, 1] fp32 1/rms; backward recomputes
        # the normalised value from them.
        ("norm1_input", w * sb * h, sp, "norm1.in", "norm1+"),
        ("norm1_rstd_fp32", _FP32 * sb, sp, "norm1.own", "norm1+"),
        ("qkv_input", w * sb * h, sp, "norm1.out", "qkv" + column),  # the Q/K/V weight gradients' one input
        ("q", q, True, "core.in", "attention" if flash else "scores"),  # after rotary: the score matmul keeps it
        # At kv heads, never repeated; under CP this rank's rows only (the regather's note).
        ("k", kv, True, "core.in", "attention" if flash else "scores"),
        ("v", kv, True, "core.in", "attention" if flash else "pv"),
        *((name, nbytes, True, "core.own", at) for name, nbytes, at in own),
        ("proj_input", q, True, "", "o_proj"),
        ("norm2_input", w * sb * h, sp, "norm2.in", "norm2+"),
        ("norm2_rstd_fp32", _FP32 * sb, sp, "norm2.own", "norm2+"),
        ("mlp_input", w * sb * h, sp, "norm2.out", "up" + column),
        ("gate", f, True, "act.in", "act+"),  # the fused SwiGLU keeps its inputs and recomputes silu(gate)
        ("up", f, True, "act.in", "act+"),
        ("down_input", f, True, "act.out", "down"),
    ]
    # What a core-attention rerun saves anew: its own terms again, a copy of q (scaled) for
    # explicit, the flash kernel's copies of q, k, v at CP 1; under CP the gathered K and V
    # (the regather steps aside inside a checkpoint's rerun: :mod:`neuron_ckpt.parallel.context_parallel`).
    core_again = sum(n for _, n, _ in own) + (0 if flash else q) + gathered
    return [_Term(ActivationTerm(n, v, split), role, at) for n, v, split, role, at in rows], core_again


def _context_parallel_core(
    setup: TrainingSetup, q: int, kv: int, a_loc: int, s: int
) -> tuple[list[tuple[str, int, str]], int]:
    """The core attention's own terms at CP ``c > 1`` (docs/context_parallel.md, "What backward
    keeps"), and the gathered K and V a rerun keeps (``c`` times this rank's). Each of the rank's
    two query chunks of ``L = s/(2c)`` tokens attends to the keys up to its end: explicit keeps
    the probabilities of both, ``(2c + 1) L^2`` per head and sample; flash each chunk's output
    (together ``q``'s size, a new tensor beside the concatenated projection input) and its fp32
    logsumexp. Both keep the ``2c``-element int64 index that puts the gathered rows in sequence
    order. q, k, v are kept as at CP 1 (k, v: this rank's rows, which the regather keeps
    concatenated)."""
    c, b, w = setup.cp, setup.micro_batch, setup.width
    n = s // 2  # L
    index = ("cp_index_int64", _INT64 * 2 * c)
    if setup.attention == "flash":
        own = [
            ("attention_out", q, "attention2+"),
            ("softmax_lse_fp32", _FP32 * a_loc * s * b, "attention2+"),
            (*index, "attention"),
        ]
    else:
        own = [("probs", w * a_loc * b * (2 * c + 1) * n * n, "pv2"), (*index, "scores")]
    return own, c * 2 * kv


__all__ = ["ActivationTerm", "LayerSpec", "RecomputeEvent", "layer_terms", "saved_at", "term_roles"]
