"""Pipeline parallelism on torch-xla (trn1) is refused, before anything is built.

A pipeline stage sends its activations to the next stage point to point. torch's
``torch.distributed.pipelining`` does that with ``dist.batch_isend_irecv``, and on Neuron
``send``/``recv`` fail when the runtime loads the graph (aws-neuron-sdk#1189, open); the hook
torch-xla would need to drive a stage (pytorch#161017) was closed unmerged and is not in torch
2.9, the last torch Neuron trains on with XLA. NxD moves stage boundaries with an all-gather over
two-rank groups instead, a schedule of its own that this library does not carry. So on XLA a
pipeline is refused in one line at set-up (``train.py --pp 2`` before the process group starts,
``LlamaPipeline`` at construction), never part-way through a step.
"""

from __future__ import annotations

XLA_REFUSAL = (
    "pipeline parallelism (pipeline_parallel_size > 1) does not run on XLA (trn1): torch.distributed.pipelining "
    "sends activations with send/recv, which fail on Neuron (aws-neuron-sdk#1189), and torch-xla has no stage hook "
    "(pytorch#161017 unmerged); on trn1 train with tensor x data parallel (pipeline_parallel_size 1), or use NxD's "
    "NxDPPModel for a model that needs pipeline stages"
)


def refuse_on_xla(xla: bool) -> None:
    """ValueError (one line, :data:`XLA_REFUSAL`) when ``xla`` (the backend is torch-xla)."""
    if xla:
        raise ValueError(XLA_REFUSAL)
