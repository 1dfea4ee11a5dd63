"""How a parameter says how it is laid out over the tensor-parallel group.

Parallel layers tag their parameters; optimizers and checkpoint code read the tags:

* ``param.tensor_parallel = True`` and ``param.partition_dim = d``: this rank holds a 1/t slice
  of the full tensor along dim ``d`` (column weight: dim 0, row weight: dim 1, embedding: 0).
* ``param.tensor_parallel_replicas = r`` (default 1): ``r`` ranks of the TP group hold the same
  slice (grouped-query key/value heads replicated when there are fewer heads than ranks).
* untagged: replicated on every TP rank (norm weights, row-parallel bias).
* ``param.expert_parallel = True``: this rank's share of a layer's experts under expert
  parallelism (:mod:`neuron_ckpt.parallel.experts`): whole experts, different on every rank of
  the EP group and the same on every rank of the expert data-parallel group (``ParallelState.edp``),
  over which ZeRO-1 reduces its gradient and shards its state.

Gradients of replicated parameters that see only a sequence-parallel slice of the input are
completed *inside* the layer (an all-reduce over TP in backward), so an optimizer never has to
all-reduce them again: doing both would double-count.
"""

from __future__ import annotations

import torch


def set_tensor_parallel_attributes(param: torch.Tensor, partition_dim: int, replicas: int = 1) -> None:
    # Attributes on the tensor itself, as Megatron and NxD mark theirs (torch declares none of them).
    param.tensor_parallel = True  # type: ignore[attr-defined]  # see above
    param.partition_dim = partition_dim  # type: ignore[attr-defined]  # see above
    param.tensor_parallel_replicas = replicas  # type: ignore[attr-defined]  # see above


def is_tensor_parallel(param: torch.Tensor) -> bool:
    return bool(getattr(param, "tensor_parallel", False))


def tensor_parallel_duplicates(param: torch.Tensor, tp_size: int) -> int:
    """How many ranks of the TP group hold exactly this parameter's values.

    Summing ``||g||^2 / duplicates`` over all TP ranks counts every distinct value once, which is
    what a global gradient norm needs: sharded parameters once per shard, replicated ones once.
    """
    if is_tensor_parallel(param):
        return int(getattr(param, "tensor_parallel_replicas", 1))
    return tp_size


def set_expert_parallel_attribute(param: torch.Tensor) -> None:
    param.expert_parallel = True  # type: ignore[attr-defined]  # a marker torch does not declare


def is_expert_parallel(param: torch.Tensor) -> bool:
    return bool(getattr(param, "expert_parallel", False))
