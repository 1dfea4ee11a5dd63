"""Every checkpoint variant against the un-checkpointed run, for every call pattern users of
``torch.utils.checkpoint`` and Megatron lean on (tests/checkpoint_patterns.py), then the same
patterns through ``apply_recompute`` on a tiny Llama for every preset.

Variants here (eager CPU, gloo): ``non_reentrant`` (the default off XLA), ``reentrant``,
``distributed`` (reentrant with ``distribute_saved_activations`` at TP 2: each rank keeps half
of the saved input) and ``compiled`` (``torch.compile`` tracing torch's checkpoint into the
graph; its reference is the same pattern compiled without a checkpoint). The XLA barrier variant
runs the same matrix in tests_xla/test_recompute_xla.py.

A cell passes when every output, every gradient and the outputs' ``requires_grad`` flags are
bit-identical to the reference, or when the variant cannot support the pattern and says so in
one line naming the variant to use (``UNSUPPORTED``). Dropout from the device generator needs an
accelerator: on a CPU-only machine those cells skip (the XLA suite covers XLA's generator).
"""

from __future__ import annotations

import functools

import pytest
import torch

import neuron_ckpt as nc
from neuron_ckpt.distributed.random import get_rng_tracker
from neuron_ckpt.recompute import PRESETS, RecomputeConfig, apply_recompute, checkpoint

from . import checkpoint_patterns as cp

USE_NON_REENTRANT = r"use use_reentrant=False"
# (variant, pattern) -> the one-line error that cell must raise instead of running.
UNSUPPORTED = {
    **{
        (v, p): USE_NON_REENTRANT
        for v in ("reentrant", "distributed")
        for p in ("double_backward", "nested_2_double_backward")
    },
}
# (variant, pattern) -> the error the un-checkpointed run raises as well, a limit of the setting:
# torch.compile (AOT autograd) has no double backward, with or without a checkpoint.
SAME_ERROR = {
    ("compiled", p): r"torch.compile with aot_autograd does not currently support double backward"
    for p in ("double_backward", "nested_2_double_backward")
}
# A reentrant Function runs its forward under no_grad, so every floating-point output it returns
# requires grad when any input does (torch's reentrant checkpoint does the same); the values and
# gradients still match. Only the flags of the outputs_without_grad pattern can show it.
FLAGS_DIFFER = {("reentrant", "outputs_without_grad"), ("distributed", "outputs_without_grad")}

# The distributed variant runs on gloo CPU ranks: it has no device generator to draw from.
ALL = [
    (v, p)
    for v in ("non_reentrant", "reentrant", "distributed", "compiled")
    for p in cp.PATTERNS
    if not (v == "distributed" and cp.PATTERNS[p].device_dropout)
]


def _device() -> str | None:
    acc = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    return None if acc is None else acc.type


def _cell(variant: str, pattern: str, device: str = "cpu") -> tuple[str, list[str] | str]:
    """("equal", []) | ("differs", [what]) | ("error", its message) | ("same error", its message:
    the un-checkpointed run raised it too)."""
    wrap = lambda f: f  # noqa: E731
    if variant == "compiled":
        torch._dynamo.reset()
        wrap = functools.partial(torch.compile, backend="aot_eager", fullgraph=False)
    ckpt = {
        "non_reentrant": functools.partial(checkpoint, use_reentrant=False),
        "reentrant": functools.partial(checkpoint, use_reentrant=True),
        "distributed": functools.partial(checkpoint, use_reentrant=True, distribute_saved_activations=True),
        "compiled": checkpoint,
    }[variant]
    ref_kind, ref = cp.outcome(cp.run, pattern, cp.plain, device, wrap)
    kind, got = cp.outcome(cp.run, pattern, ckpt, device, wrap)
    if ref_kind == "error":  # a limit of the setting itself (torch.compile): the same error or bust
        return ("same error" if got == ref else kind), got
    if kind == "error":
        return kind, got
    return "differs" if (d := cp.differences(ref, got, (variant, pattern) not in FLAGS_DIFFER)) else "equal", d


def _distributed_cells(patterns: list[str], device: str) -> dict[str, tuple]:
    nc.initialize_model_parallel(2)
    return {p: _cell("distributed", p, device) for p in patterns}


@pytest.fixture(scope="module")
def distributed_cells(world):
    """All distributed cells, run once on 2 ranks (rank 0's verdicts; rank 1 must agree)."""
    patterns = [p for p in cp.PATTERNS if not cp.PATTERNS[p].device_dropout]
    per_rank = world(2).run(_distributed_cells, patterns, "cpu")
    assert per_rank[0] == per_rank[1], "the two ranks disagree"
    return per_rank[0]


@pytest.mark.parametrize("variant,pattern", ALL, ids=[f"{v}-{p}" for v, p in ALL])
def test_variant_equals_no_recompute(variant, pattern, request):
    device = "cpu"
    if cp.PATTERNS[pattern].device_dropout:
        device = _device()
        if device is None:
            pytest.skip("dropout from the device generator needs an accelerator (CUDA, neuron); XLA's is in tests_xla")
    if variant == "distributed":
        verdict, detail = request.getfixturevalue("distributed_cells")[pattern]
    else:
        verdict, detail = _cell(variant, pattern, device)
    cell = (variant, pattern)
    if cell in UNSUPPORTED or cell in SAME_ERROR:
        expected = ("error", UNSUPPORTED[cell]) if cell in UNSUPPORTED else ("same error", SAME_ERROR[cell])
        assert verdict == expected[0] and cp.matches(detail, expected[1]), (verdict, detail)
        assert "\n" not in detail, "the error is more than one line"
    else:
        assert verdict == "equal", (verdict, detail)


def test_the_matrix_can_fail():
    # Guards the matrix: a checkpoint that does not replay the tracker stream (torch's own, with
    # its CPU/CUDA preserve_rng_state) differs from the reference on the stream dropout patterns,
    # and a corrupted gradient is caught.
    torch_ckpt = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)
    for pattern in ("dropout_tracker_stream", "dropout_nested_streams"):
        ref, got = cp.run(pattern, cp.plain), cp.run(pattern, torch_ckpt)
        assert cp.differences(ref, got), pattern
    ref = cp.run("backward", cp.plain)
    bad = [t.clone() if t is not None else None for t in ref]
    bad[-1][0, 0] += 1e-3
    assert cp.differences(ref, bad) == [f"result {len(ref) - 1} differs by 0.001"]
    get_rng_tracker().reset()


# ---------------------------------------------------------------------------------------------
# The same patterns through apply_recompute on a tiny Llama (TP 2), every preset.

LLAMA_PATTERNS = (
    "backward",
    "backward_twice_retain_graph",
    "double_backward",
    "logits_without_labels",
    "attention_dropout",
)
# apply_recompute's variants: the default (non-reentrant off XLA) and the reentrant one, both at
# TP 2 with sequence parallel; distributed saved inputs at TP 2 without it (they exclude each other).
LLAMA_VARIANTS = {
    "default": ({}, True),
    "reentrant": ({"use_reentrant": True}, True),
    "distributed": ({"distribute_saved_activations": True}, False),
}
# The Llama's fused RMSNorm, SwiGLU and masked softmax are once-differentiable (their backward
# kernels have no derivative), so double backward raises without recompute too: with the
# non-reentrant default the same torch error, with the reentrant one ours.
LLAMA_DOUBLE_BACKWARD = r"once_differentiable|use use_reentrant=False"


def _llama_run(preset: str, variant: str, pattern: str) -> list:
    from neuron_ckpt.models import LlamaForCausalLM

    from .helpers import TINY, tiny_config

    options, sp = LLAMA_VARIANTS[variant]
    torch.manual_seed(0)
    p = 0.1 if pattern == "attention_dropout" else 0.0
    model = LlamaForCausalLM(tiny_config(attention_dropout=p), sequence_parallel=sp)
    if preset != "none":
        config = RecomputeConfig.preset(preset)
        apply_recompute(model, RecomputeConfig(**{**config.__dict__, **options}))
    nc.model_parallel_manual_seed(5)
    ids = torch.randint(0, TINY["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(1))
    params = list(model.parameters())
    if pattern == "logits_without_labels":
        logits = model(ids, labels=None).logits  # [s, b, v/t], local shard
        loss = logits.float().pow(2).mean()
    else:
        loss = model(ids, labels=ids).loss
    if pattern == "double_backward":
        grads = torch.autograd.grad(loss, params, create_graph=True)
        sum(g.pow(2).sum() for g in grads).backward()
    elif pattern == "backward_twice_retain_graph":
        loss.backward(retain_graph=True)
        loss.backward()
    else:
        loss.backward()
    return [loss.detach()] + [q.grad.clone() for q in params]


def _llama_cells() -> dict[tuple[str, str, str], tuple[str, list[str] | str]]:
    nc.initialize_model_parallel(2)
    cells = {}
    for variant in LLAMA_VARIANTS:  # _llama_run reads its options and sequence parallel
        for pattern in LLAMA_PATTERNS:
            ref_kind, ref = cp.outcome(_llama_run, "none", variant, pattern)
            for preset in PRESETS[1:]:
                kind, got = cp.outcome(_llama_run, preset, variant, pattern)
                if ref_kind == "error" or kind == "error":
                    cells[preset, variant, pattern] = ("error", f"{ref} | {got}")
                else:
                    d = cp.differences([None] + ref, [None] + got, outputs_grad_flags=False)
                    cells[preset, variant, pattern] = ("differs" if d else "equal", d)
    return cells


@pytest.fixture(scope="module")
def llama_cells(world):
    per_rank = world(2).run(_llama_cells)
    assert per_rank[0] == per_rank[1], "the two ranks disagree"
    return per_rank[0]


LLAMA_ALL = [(pr, v, pa) for pr in PRESETS[1:] for v in LLAMA_VARIANTS for pa in LLAMA_PATTERNS]


@pytest.mark.parametrize("preset,variant,pattern", LLAMA_ALL, ids=["-".join(c) for c in LLAMA_ALL])
def test_llama_preset_equals_no_recompute(llama_cells, preset, variant, pattern):
    verdict, detail = llama_cells[preset, variant, pattern]
    if pattern == "double_backward":
        ref, got = detail.split(" | ")
        assert verdict == "error" and "once_differentiable" in ref and cp.matches(got, LLAMA_DOUBLE_BACKWARD), detail
    else:
        assert verdict == "equal", (verdict, detail)
