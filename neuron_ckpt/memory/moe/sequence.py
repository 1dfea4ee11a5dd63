"""Sequence parallel in the transformers-layer memory model: what ``apply_tensor_parallel(model,
sequence_parallel=True)`` (:mod:`neuron_ckpt.parallel.hf.sequence`) changes in what a
transformers layer keeps.

The token-wise parts of a layer, its input, its RMSNorms and the residual, run on this rank's
s/t tokens: their storages hold T/t rows (:attr:`~.shape.MoESetup.local_tokens`). Each region
(the attention; the MoE block, or the dense MLP) all-gathers its input on entry through
output-discarding recompute: the gather keeps the norm's s/t-token output as its input, and
every op in the region that reads the gathered ``[b, s, h]`` copy keeps a note of it. So a
region's entry is one more output-discarding unit (:data:`SEQUENCE_PARALLEL`, on in every
layer), and the rule of :mod:`.rules` prices how it meets each recompute module:

* ``norm``: the norm's output is discarded as well, so the gather's kept input is a note too;
  the norm's input (the layer's input, the residual: s/t tokens) is all that stays.
* ``moe``, ``mlp``, ``shared_experts``: the checkpoint's input is the gathered copy, a note;
  the entry's s/t-token chunk is what stays.
* ``full``: the layer keeps its input, this rank's s/t tokens (the first layer keeps a copy of
  its chunk of the embedding's output); the entries sit inside the checkpoint.
* inside a region nothing changes from tensor parallel alone: the whole sequence on every rank.
  Core attention; DeepSeek-V3's MLA, which its plan leaves whole (its latents, q, k, v, the
  o_proj input for all s tokens); the router and the routed experts (every token, F/t wide);
  the shared experts.

A region leaves by its row-parallel child's reduce-scatter (the GQA attention's ``o_proj``, the
dense MLP's ``down_proj``) or by a split of its output (the MoE block, MLA); neither keeps anything.
"""

from __future__ import annotations

from .rules import LayerTensors
from .shape import MoESetup

SEQUENCE_PARALLEL = "sequence_parallel"  # the entries' unit: not a recompute module, on with the setup


def enter_region(layer: LayerTensors, region: str, local: str, hidden: int, setup: MoESetup) -> str:
    """The storage the ops of ``region`` read as their input: the norm's output ``local`` itself,
    or under sequence parallel its all-gathered copy, discarded (an entry unit keeps ``local``)."""
    if not setup.sequence_parallel:
        return local
    gathered = layer.save(f"{region}.gathered_input", setup.width * setup.tokens * hidden, False)
    layer.unit(SEQUENCE_PARALLEL, [f"{SEQUENCE_PARALLEL}.{region}"], [local], discards=[gathered])
    return gathered


def always_on(setup: MoESetup) -> tuple[str, ...]:
    """The units a setup adds to every recompute choice."""
    return (SEQUENCE_PARALLEL,) if setup.sequence_parallel else ()


__all__ = ["SEQUENCE_PARALLEL", "always_on", "enter_region"]
