"""Query/key/value column projection aware of grouped-query attention (GQA).

Query heads are split over the TP group (``num_heads % t == 0``). Key/value heads are split too
when there are at least ``t`` of them (``num_kv_heads % t == 0``); when there are fewer
(``t % num_kv_heads == 0``), each kv head is replicated on ``t / num_kv_heads`` consecutive
ranks, which is exactly the set of ranks whose query heads attend to it. The replicas start
equal (same slice of the same full weight) and stay equal because their gradients are summed
over the replicas inside backward.

Weights keep the ``transformers`` layout: ``q`` is ``(num_heads * head_dim, hidden)`` and ``k``,
``v`` are ``(num_kv_heads * head_dim, hidden)``, split by rows.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from ..distributed import collectives as C
from ..distributed.parallel_state import Group, ParallelState
from .init import InitMethod, check_divisible, default_init, shard_of_full
from .layer_args import check_sizes, resolve_parallel_state
from .linear import parallel_linear
from .params import set_tensor_parallel_attributes


class _SumOverReplicas(torch.autograd.Function):
    """Identity forward; backward sums the gradient over the ranks holding the same kv head.

    Each rank places its gradient in its head's slot of a zero ``[num_kv_heads, ...]`` buffer and
    all-reduces over TP: replicas add into the same slot. It moves ``num_kv_heads`` heads
    instead of one, but needs no extra process groups (replication only happens when
    ``num_kv_heads < t``, so the buffer is at most ``t`` heads).
    """

    @staticmethod
    def forward(ctx, w, head: int, num_kv_heads: int, group: Group):
        ctx.head, ctx.num_kv_heads, ctx.group = head, num_kv_heads, group
        return w.view_as(w)

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        slots = g.new_zeros((ctx.num_kv_heads,) + tuple(g.shape))
        slots[ctx.head] = g
        return C.all_reduce(slots, ctx.group)[ctx.head], None, None, None


class QKVParallelLinear(torch.nn.Module):
    """``x -> (q, k, v)`` with local heads: ``[..., heads/t * d]``, ``[..., kv_local * d]`` twice.

    Input ``[s, b, h]`` replicated, or ``[s/t, b, h]`` with ``sequence_parallel`` (gathered once
    for all three projections).
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        bias: bool = False,
        sequence_parallel: bool = False,
        init_method: InitMethod = default_init,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        parallel_state: ParallelState | None = None,
    ):
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        check_sizes(hidden_size=hidden_size, num_heads=num_heads, num_kv_heads=num_kv_heads)
        if head_dim is None:
            if hidden_size % num_heads:
                raise ValueError(
                    f"hidden_size={hidden_size} is not divisible by num_heads={num_heads}; pass head_dim explicitly"
                )
            head_dim = hidden_size // num_heads
        check_sizes(head_dim=head_dim)
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}")
        self.parallel_state = resolve_parallel_state(parallel_state)
        t, r = self.parallel_state.tp_size, self.parallel_state.tp_rank
        check_divisible(num_heads, "num_heads", t)
        if num_kv_heads >= t:
            check_divisible(num_kv_heads, "num_kv_heads", t)
            self.replicas, kv_shards, kv_index = 1, t, r
        else:
            if t % num_kv_heads:
                raise ValueError(
                    f"num_kv_heads={num_kv_heads} must divide the tensor-parallel size {t} when it is "
                    f"smaller than it (each kv head is then replicated on t/num_kv_heads ranks)"
                )
            self.replicas = t // num_kv_heads
            kv_shards, kv_index = num_kv_heads, r // self.replicas
        self.hidden_size, self.head_dim = hidden_size, head_dim
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.local_heads, self.local_kv_heads = num_heads // t, max(num_kv_heads // t, 1)
        self.kv_index, self.sequence_parallel = kv_index, sequence_parallel

        def make(rows: int, shards: int, index: int, replicas: int) -> torch.nn.Parameter:
            p = torch.nn.Parameter(shard_of_full((rows, hidden_size), 0, index, shards, init_method, dtype, device))
            set_tensor_parallel_attributes(p, partition_dim=0, replicas=replicas)
            return p

        def make_bias(rows: int, replicas: int) -> torch.nn.Parameter | None:
            if not bias:
                return None
            p = torch.nn.Parameter(torch.zeros(rows, dtype=dtype, device=device))
            set_tensor_parallel_attributes(p, partition_dim=0, replicas=replicas)
            return p

        kv_rows = num_kv_heads * head_dim
        self.q_weight = make(num_heads * head_dim, t, r, 1)
        self.k_weight = make(kv_rows, kv_shards, kv_index, self.replicas)
        self.v_weight = make(kv_rows, kv_shards, kv_index, self.replicas)
        self.q_bias = make_bias(self.local_heads * head_dim, 1)
        self.k_bias = make_bias(self.local_kv_heads * head_dim, self.replicas)
        self.v_bias = make_bias(self.local_kv_heads * head_dim, self.replicas)

    def _kv(self, p: torch.Tensor | None) -> torch.Tensor | None:
        if p is None or self.replicas == 1:
            return p
        return _SumOverReplicas.apply(p, self.kv_index, self.num_kv_heads, self.parallel_state.tp)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        weights = [self.q_weight, self._kv(self.k_weight), self._kv(self.v_weight)]
        biases = [self.q_bias, self._kv(self.k_bias), self._kv(self.v_bias)]
        q, k, v = parallel_linear(x, weights, biases, self.parallel_state.tp, self.sequence_parallel)  # type: ignore[arg-type]  # weights are never None
        return q, k, v

    def extra_repr(self) -> str:
        return (
            f"hidden={self.hidden_size}, heads={self.num_heads} (local {self.local_heads}), kv_heads="
            f"{self.num_kv_heads} (local {self.local_kv_heads}, replicas {self.replicas}), head_dim="
            f"{self.head_dim}, sequence_parallel={self.sequence_parallel}"
        )
