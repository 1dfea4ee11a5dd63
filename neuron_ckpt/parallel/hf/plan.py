"""Reading a transformers ``tp_plan``: which modules and parameters it names, with which style,
checked before anything changes; then each style's change, and the model-wide pieces (tied
weights, the vocabulary-parallel loss, attention dropout on split heads)."""

from __future__ import annotations

import re
from collections.abc import Callable

import torch

from ...distributed.parallel_state import ParallelState
from ...distributed.random import MODEL_PARALLEL_RNG, get_rng_tracker
from ..experts.dispatch import ExpertDispatch
from ..layer_args import resolve_parallel_state
from .dense import DENSE_STYLES
from .dropout import draw_from_the_tp_stream, split_attention_with_dropout
from .expert_parallel import EP_MODULE_STYLES, EP_WEIGHT_STYLES, check_expert_parallel, expert_parallel_plan
from .experts import EXPERT_STYLES, EXPERT_WEIGHT_STYLES, check_experts_plan
from .grouped_mm import run_eager_where_grouped_mm_cannot
from .loss import loss_parallel_head, vocab_parallel_loss
from .mla import MLA_STYLES
from .sequence import apply_sequence_parallel, plan_sequence_parallel
from .style import Split, Style, Target

STYLES: dict[str, Style] = {**DENSE_STYLES, **EXPERT_STYLES, **MLA_STYLES, **EP_MODULE_STYLES}
"""Styles of plan entries that name a module."""
PARAMETER_STYLES: dict[str, Style] = {**EXPERT_WEIGHT_STYLES, **EP_WEIGHT_STYLES}
"""Styles of plan entries that name a parameter (``experts.gate_up_proj``)."""
PLAN_CHECKS: list[Callable[[torch.nn.Module, list[Target], int], None]] = [check_experts_plan]
"""Checks across targets, ``(model, targets, tp_size)``, after each target's own."""
SUPPORTED = tuple(dict.fromkeys([*STYLES, *PARAMETER_STYLES]))


def apply_tensor_parallel(
    model: torch.nn.Module,
    plan: dict[str, str] | None = None,
    *,
    loss_parallel: bool = True,
    sequence_parallel: bool = False,
    parallel_state: ParallelState | None = None,
    expert_dispatch: ExpertDispatch | None = None,
) -> torch.nn.Module:
    """Split ``model`` over the tensor-parallel group by ``plan`` (default: ``model.tp_plan``).

    ``plan`` maps module or parameter names (``*`` matches one name part, e.g. a layer index) to
    styles; see the package docstring. ``sequence_parallel``: also split the activations outside
    the split modules along the sequence (:mod:`.sequence`). Under expert parallelism
    (``expert_model_parallel_size`` > 1) the model's ``ep_plan`` is laid over ``plan`` and its
    experts spread over the EP group (:mod:`.expert_parallel`); ``expert_dispatch`` says how tokens
    reach them (default ``ExpertDispatch()``: dropless all-to-all, all-gather on XLA). Returns
    ``model``, changed in place.
    """
    state = resolve_parallel_state(parallel_state)
    if plan is None:
        plan = getattr(model, "tp_plan", None)
        if not plan:
            raise ValueError(
                f"apply_tensor_parallel: {type(model).__name__} has no tensor-parallel plan (model.tp_plan); "
                "pass plan={module name pattern: style}"
            )
    plan = expert_parallel_plan(model, plan, state)
    dispatch = expert_dispatch if expert_dispatch is not None else ExpertDispatch()
    targets = _resolve(model, plan)
    head = loss_parallel_head(model, targets) if loss_parallel else None
    tied = _tied_pairs(model, targets)
    for target in targets:
        _style(target).check(model, target, state.tp_size)
    for check in PLAN_CHECKS:
        check(model, targets, state.tp_size)
    check_expert_parallel(model, targets, state, dispatch.resolved_form())
    split_attention = split_attention_with_dropout(model, targets) if state.tp_size > 1 else []
    if split_attention and MODEL_PARALLEL_RNG not in get_rng_tracker().states:
        raise ValueError(
            f"apply_tensor_parallel: {split_attention[0]} has attention dropout and its heads are split: each rank "
            "draws its own mask from the tensor-parallel RNG stream; call nc.model_parallel_manual_seed(seed) first"
        )
    sequence = plan_sequence_parallel(model, targets, state.tp_size) if sequence_parallel else None
    split = Split(model, state, head, dispatch)
    for target in targets:
        _style(target).apply(target, split)
    run_eager_where_grouped_mm_cannot(model)
    for name in split_attention:
        draw_from_the_tp_stream(model.get_submodule(name))
    for lm_head, embedding in tied:
        model.get_submodule(lm_head).weight = model.get_submodule(embedding).weight
    if head is not None:
        model.loss_function = vocab_parallel_loss(state)  # type: ignore[assignment]  # torch types a module's attributes as Tensor | Module
    if sequence is not None:
        apply_sequence_parallel(model, sequence, state)
    return model


def _resolve(model: torch.nn.Module, plan: dict[str, str]) -> list[Target]:
    """Every target the plan matches, in module order (a module before its parameters); unknown
    styles, and styles given to the wrong kind of target, refused."""
    patterns = []
    for key, style in plan.items():
        if style not in SUPPORTED:
            raise ValueError(
                f"apply_tensor_parallel: plan entry {key!r} has style {style!r}, which neuron_ckpt does not map "
                f"(supported: {', '.join(SUPPORTED)})"
            )
        parts = (re.escape(p) if p != "*" else r"[^.]+" for p in key.split("."))
        patterns.append((re.compile(r"\.".join(parts) + r"\Z"), style))
    targets = []
    for name, module in model.named_modules():
        named = [(name, None)] + [(f"{name}.{p}" if name else p, p) for p, _ in module.named_parameters(recurse=False)]
        for full, param in named:
            styles = {style for pattern, style in patterns if pattern.match(full)}
            if len(styles) > 1:
                raise ValueError(f"apply_tensor_parallel: {full} matches plan entries with styles {sorted(styles)}")
            if styles:
                targets.append(Target(full, module, styles.pop(), param))
                _style(targets[-1])
    return targets


def _style(target: Target) -> Style:
    if target.param is None and target.style not in STYLES:
        raise ValueError(
            f"{target.where}: neuron_ckpt maps this style on parameters (3-D expert weights), not on a module"
        )
    if target.param is not None and target.style not in PARAMETER_STYLES:
        raise ValueError(f"{target.where}: neuron_ckpt maps this style on modules, not on a parameter")
    return (STYLES if target.param is None else PARAMETER_STYLES)[target.style]


def _tied_pairs(model: torch.nn.Module, targets: list[Target]) -> list[tuple[str, str]]:
    """(LM head, embedding) names sharing one weight: both planned, both split by vocabulary rows."""
    planned = {t.name: t.style for t in targets}
    holders: dict[int, list[str]] = {}  # id(weight) -> the modules holding it, one pass over the model
    for other, m in model.named_modules():
        if isinstance(getattr(m, "weight", None), torch.Tensor):
            holders.setdefault(id(m.weight), []).append(other)
    pairs = []
    for target in targets:
        name, style = target.name, target.style
        weight = getattr(target.module, "weight", None) if target.param is None else None
        for other in holders.get(id(weight), []) if isinstance(weight, torch.Tensor) else []:
            if other == name:
                continue
            if other not in planned:
                raise ValueError(
                    f"apply_tensor_parallel: {name} ({style}) shares its weight with {other}, which the plan "
                    f"leaves whole; plan both or neither"
                )
            if style == "embedding_rowwise":
                if not planned[other].startswith("colwise"):
                    raise ValueError(
                        f"apply_tensor_parallel: {other} ({planned[other]}) shares its weight with {name} "
                        f"(embedding_rowwise); a tied weight must be split by vocabulary rows in both (colwise)"
                    )
                pairs.append((other, name))
    return pairs
