"""The parameters one rank holds of a transformers model split by ``nc.apply_tensor_parallel``, at
any tensor- and expert-parallel degree: :func:`parameter_split`, then :meth:`ParameterSplit.local`.

The model is built on the meta device from its config (transformers' own modules: every bias,
norm, sink and router the family has, nothing allocated; DeepSeek-V3's 671 B in under a second)
and each parameter is classed by the plan ``apply_tensor_parallel`` lays on it: the model's
``tp_plan``, with its ``ep_plan`` laid over the experts at EP > 1 (entries under a dispatched
experts module dropped, as :func:`~neuron_ckpt.parallel.hf.expert_parallel.expert_parallel_plan`
does). Per style, as :mod:`neuron_ckpt.parallel.hf` slices:

=================================================  ==============================================
style                                              what one rank holds
=================================================  ==============================================
a module ``colwise``, ``colwise_gather_output``,   ``1/t`` of the weight (and of the bias)
``colwise_rep``, ``embedding_rowwise``
a module ``rowwise``, ``rowwise_split_input``,     ``1/t`` of the weight; the bias whole
``rowwise_rep``
a 3-D expert weight ``packed_colwise``,            ``1/t`` (each expert's intermediate size)
``packed_rowwise``, ``colwise``, ``rowwise``
a 3-D expert weight ``grouped_gemm`` (EP > 1)      ``1/e``: ``E/e`` whole experts (expert tensor
                                                   parallel size 1, ``distributed/layout.py``)
anything else, or not planned                      whole (replicated)
=================================================  ==============================================

A tied LM head is the embedding (counted once). ``tests/test_planner_families.py`` checks the
counts against the ``numel`` of real models split on gloo ranks.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from dataclasses import dataclass

from .shape import MoESetup, MoEShape

SPLIT_ALL = ("colwise", "colwise_gather_output", "colwise_rep", "embedding_rowwise")  # a module's weight and bias
SPLIT_WEIGHT = ("rowwise", "rowwise_split_input", "rowwise_rep")  # a module's weight
EXPERT_SLICE = "grouped_gemm"
SPLIT_PARAMETER = ("packed_colwise", "packed_rowwise", "colwise", "rowwise", EXPERT_SLICE)  # a 3-D expert weight
DISPATCH = "ep_dispatch_experts"


@dataclass(frozen=True)
class ParameterSplit:
    """Parameters of the whole model by how a rank holds them: ``split`` (``1/t`` each),
    ``whole`` (replicated) and, of those, the routed experts' (``experts_split``,
    ``experts_whole``: what the ``ep_plan`` spreads over EP instead at e > 1). ``total``: the
    model's parameters."""

    split: int = 0
    whole: int = 0
    experts_split: int = 0
    experts_whole: int = 0

    def __add__(self, other: ParameterSplit) -> ParameterSplit:
        a, b = (self.split, self.whole, self.experts_split, self.experts_whole), dataclasses.astuple(other)
        return ParameterSplit(*(x + y for x, y in zip(a, b)))

    @property
    def total(self) -> int:
        return self.split + self.whole

    @property
    def experts(self) -> int:
        return self.experts_split + self.experts_whole

    def local(self, tp: int, ep: int = 1) -> tuple[int, int]:
        """``(dense, experts)``: the parameters one rank holds at TP ``tp`` and EP ``ep``, those
        ZeRO-1 shards over DP and those it shards over expert DP (none at EP 1: every
        parameter is in the dense flats then)."""
        if ep == 1:
            return self.split // tp + self.whole, 0
        dense_split, dense_whole = self.split - self.experts_split, self.whole - self.experts_whole
        return dense_split // tp + dense_whole, self.experts // ep


def _patterns(plan: dict[str, str]) -> list[tuple[re.Pattern[str], str]]:
    """``apply_tensor_parallel``'s reading of plan keys: ``*`` is one name part."""
    out = []
    for key, style in plan.items():
        parts = (re.escape(p) if p != "*" else r"[^.]+" for p in key.split("."))
        out.append((re.compile(r"\.".join(parts) + r"\Z"), style))
    return out


def _style(patterns: list[tuple[re.Pattern[str], str]], name: str) -> str | None:
    return next((style for pattern, style in patterns if pattern.match(name)), None)


def _held(plan: list[tuple[re.Pattern[str], str]], name: str) -> str:
    """``"split"`` or ``"whole"``: how a rank holds the parameter ``name`` under ``plan``."""
    own = _style(plan, name)  # a plan entry naming the parameter (3-D expert weights)
    if own is not None:
        return "split" if own in SPLIT_PARAMETER else "whole"
    module, _, leaf = name.rpartition(".")
    style = _style(plan, module)
    if style in SPLIT_ALL or (style in SPLIT_WEIGHT and leaf == "weight"):
        return "split"
    return "whole"


def _part(name: str) -> str:
    """Which part of the model a parameter belongs to: ``"layer{i}"``, ``"embedding"`` (the input
    embedding, and the LM head tied to it) or ``"head"`` (the final norm, an untied LM head)."""
    parts = name.split(".")
    if "layers" in parts and parts.index("layers") + 1 < len(parts) and parts[parts.index("layers") + 1].isdigit():
        return f"layer{parts[parts.index('layers') + 1]}"
    return "embedding" if "embed_tokens" in parts else "head"


@functools.cache
def parameter_parts(shape: MoEShape) -> dict[str, ParameterSplit]:
    """Each part's :class:`ParameterSplit` (:func:`_part`'s names) of ``shape`` (its config as
    :func:`~.hf_config.hf_config` writes it, built on the meta device)."""
    import torch
    import transformers

    from .config import quiet_transformers
    from .families import FAMILY
    from .hf_config import hf_config

    attention = "eager" if FAMILY[shape.family].eager_only else "sdpa"
    with quiet_transformers(), torch.device("meta"):
        config = hf_config(shape, MoESetup(seq_len=1, attention=attention))
        model = transformers.AutoModelForCausalLM.from_config(config)
    tp_plan = dict(getattr(model, "tp_plan", None) or {})
    ep_plan = dict(getattr(model, "ep_plan", None) or {})
    dispatched = [k for k, s in ep_plan.items() if s == DISPATCH]
    kept = {k: s for k, s in tp_plan.items() if not any(k == d or k.startswith(d + ".") for d in dispatched)}
    plain, expert = _patterns(tp_plan), _patterns({**kept, **ep_plan})
    parts: dict[str, dict[str, int]] = {}
    for name, param in model.named_parameters():  # a tied LM head is the embedding's weight: once
        counts = parts.setdefault(_part(name), {"split": 0, "whole": 0, "experts_split": 0, "experts_whole": 0})
        held = _held(plain, name)
        counts[held] += param.numel()
        if ep_plan and _style(expert, name) == EXPERT_SLICE:
            counts[f"experts_{held}"] += param.numel()
    return {part: ParameterSplit(**counts) for part, counts in parts.items()}


def parameter_split(shape: MoEShape, parts: tuple[str, ...] | None = None) -> ParameterSplit:
    """:class:`ParameterSplit` of ``shape``, or of some of its parts (:func:`parameter_parts`)."""
    table = parameter_parts(shape)
    return sum((table.get(p, ParameterSplit()) for p in (table if parts is None else parts)), ParameterSplit())


__all__ = ["ParameterSplit", "parameter_parts", "parameter_split"]
