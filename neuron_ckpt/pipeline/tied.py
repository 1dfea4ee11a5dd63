"""Tied embeddings across the first and last stage: two parameters that stay one value.

With ``tie_word_embeddings`` and more than one stage, the first stage holds the embedding table
and the last stage the LM head, each its own parameter (same ``[v/t, h]`` shard layout, equal
initial values: :mod:`.llama_stage`). Their gradients are summed over the embedding group (the
first and last rank of each pipeline column, :func:`~neuron_ckpt.distributed.parallel_state.parallel_layout`),
as Megatron does, so both hold the gradient the single tied parameter of ``LlamaForCausalLM`` would
have; an optimizer stepping both the same way keeps them equal.

Where: :func:`all_reduce_tied_gradients` once per optimizer step, after every backward of the
step (``LlamaPipeline.step`` calls it unless told not to; with gradient accumulation over several
steps call ``LlamaPipeline.finish_gradients()`` once, after the last) and BEFORE any data-parallel
reduction or ZeRO-1 reduce-scatter: Megatron#844 shipped wrong gradients by reduce-scattering first.
Both replicas must then get the same update: the same optimizer, the same hyperparameters, the
same gradient clipping (a gradient norm over the pipeline counts the tied gradient once: both ends
carry ``pipeline_replicas = 2``, and ``Zero1Optimizer`` weighs each end's squares by 1/2;
Megatron#4641 is replicas that drifted under different optimizers). With ``Zero1Optimizer``'s
fp32 gradient accumulation the sum is taken in its buffer (``p.grad`` is None there), before its
DP reduce-scatter.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..distributed import collectives as C
from ..distributed.parallel_state import ParallelState
from ..optim.grad_buffer import gradient_holder
from .llama_stage import LlamaStage


def tied_parameters(stages: Sequence[LlamaStage]) -> list[torch.nn.Parameter]:
    """The tied parameters this rank holds that are replicated on another stage (none when a
    single stage holds both ends as one parameter)."""
    params = []
    for stage in stages:
        if stage.is_first and stage.is_last:
            continue
        weight = stage.tied_weight
        if weight is not None:
            params.append(weight)
    return params


def all_reduce_tied_gradients(stages: Sequence[LlamaStage], parallel_state: ParallelState) -> int:
    """Sum the tied parameters' gradients over the embedding group; returns how many were summed.

    A rank whose stages hold neither end does nothing. A parameter with no gradient yet (a step
    that did not reach it) counts as zeros, so both ends always take part in the collective.
    """
    params = tied_parameters(stages)
    if not params:
        return 0
    group = parallel_state.embedding
    if group is None:
        raise ValueError(
            "tied embeddings across stages need the embedding group: initialize_model_parallel("
            "pipeline_parallel_size=...) creates it"
        )
    for p in params:
        # A ZeRO-1 optimizer's fp32 buffer when it accumulates p's gradient (p.grad is None then).
        grad = gradient_holder(p)
        if grad is None:
            p.grad = grad = torch.zeros_like(p)
        grad.copy_(C.all_reduce(grad, group))
    return len(params)


def check_tied_weights(stages: Sequence[LlamaStage], parallel_state: ParallelState) -> float:
    """The largest difference between the two ends' values (0.0 when equal), the same on both
    ends of the group; a collective over the embedding group, 0.0 on ranks holding neither."""
    params = tied_parameters(stages)
    if not params:
        return 0.0
    (p,) = params  # one end per rank: the first and last stage share a rank only when p = 1
    assert parallel_state.embedding is not None  # this rank holds an end
    both = C.all_gather(p.detach().unsqueeze(0).contiguous(), 0, parallel_state.embedding)
    return float((both[0] - both[-1]).abs().max())
