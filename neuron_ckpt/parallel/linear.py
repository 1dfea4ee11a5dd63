"""Column- and row-parallel linear layers (Megatron shapes), with optional sequence parallelism.

``ColumnParallelLinear(in, out)`` holds weight ``(out/t, in)``: every rank computes a slice of
the output features. ``RowParallelLinear(in, out)`` holds weight ``(out, in/t)``: every rank
computes a partial sum over its slice of the input features. A column layer followed by a row
layer (MLP, attention) needs one collective each way:

=====================  ===========================  ==============================
                       tensor parallel              + sequence parallel
=====================  ===========================  ==============================
column input           replicated ``[s, b, h]``     ``[s/t, b, h]``, all-gathered
row output             all-reduce -> ``[s, b, h]``  reduce-scatter -> ``[s/t, b, h]``
=====================  ===========================  ==============================

Under sequence parallelism the column layer saves only its local ``[s/t, b, h]`` input for
backward and all-gathers it again there (Megatron does the same): saving the gathered input
would cost ``2sbh(1 - 1/t)`` more bytes per layer in 16-bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from ..distributed import collectives as C
from ..distributed.mappings import (
    copy_to_tensor_parallel_region,
    gather_from_tensor_parallel_region,
    reduce_from_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_parallel_region,
)
from ..distributed.parallel_state import Group, ParallelState
from .init import InitMethod, check_divisible, default_init, shard_of_full
from .layer_args import check_sizes, resolve_parallel_state
from .params import set_tensor_parallel_attributes


def check_sequence_divisible(x: torch.Tensor, tp_size: int, where: str) -> None:
    """Sequence parallel splits dim 0 (the sequence) into ``tp_size`` chunks."""
    if x.shape[0] % tp_size:
        raise ValueError(
            f"{where}: sequence length {x.shape[0]} (dim 0 of a [s, b, h] input) is not divisible "
            f"by the tensor-parallel size {tp_size}, which sequence_parallel=True requires"
        )


class _SequenceParallelLinear(torch.autograd.Function):
    """``y_i = all_gather_seq(x) @ W_i^T + b_i`` for one or more weights sharing one input.

    Saves the local ``x`` (not the gathered one) and gathers it again in backward. Several
    weights (query, key, value) share one gather each way.
    """

    @staticmethod
    def forward(ctx, x_local, group: Group, *params):
        total = C.all_gather(x_local, 0, group)
        weights, biases = params[0::2], params[1::2]
        ctx.save_for_backward(x_local, *weights)
        ctx.group, ctx.has_bias = group, [b is not None for b in biases]
        return tuple(F.linear(total, w, b) for w, b in zip(weights, biases))

    @staticmethod
    @once_differentiable  # the gathers here carry no history: a second derivative would be wrong
    def backward(ctx, *grad_outs):
        x_local, *weights = ctx.saved_tensors
        needs = ctx.needs_input_grad
        live = [i for i, g in enumerate(grad_outs) if g is not None]
        # Overlap, as Megatron does: re-gather the input while computing the input gradient,
        # then reduce-scatter the input gradient while computing the weight gradients.
        need_w = any(needs[2 + 2 * i] for i in live)
        gathering = C.all_gather_start(x_local, ctx.group) if need_w else None
        scattering = None
        if needs[0] and live:
            grad_x = sum(grad_outs[i].matmul(weights[i]) for i in live)
            scattering = C.reduce_scatter_start(grad_x, ctx.group)
        total = gathering.wait() if gathering is not None else None
        grads: list[torch.Tensor | None] = [None] * (2 * len(weights))
        for i in live:
            g2 = grad_outs[i].reshape(-1, grad_outs[i].shape[-1])
            if needs[2 + 2 * i]:
                assert total is not None  # gathered: a weight needs its gradient (need_w)
                grads[2 * i] = g2.t().matmul(total.reshape(-1, total.shape[-1]))
            if ctx.has_bias[i] and needs[3 + 2 * i]:
                grads[2 * i + 1] = g2.sum(0)
        grad_x = scattering.wait() if scattering is not None else None
        return (grad_x, None, *grads)


def parallel_linear(
    x: torch.Tensor,
    weights: list[torch.Tensor],
    biases: list[torch.Tensor | None],
    tp: Group,
    sequence_parallel: bool,
) -> tuple[torch.Tensor, ...]:
    """The column-parallel matmuls of several weights on one input, entering the TP region once.

    With sequence parallel the ``[s/t, b, h]`` input is all-gathered once (and its gradient
    reduce-scattered once); otherwise the replicated input's gradient is all-reduced once.
    """
    if sequence_parallel and tp.size > 1:
        params = [p for pair in zip(weights, biases) for p in pair]
        return _SequenceParallelLinear.apply(x, tp, *params)
    x = copy_to_tensor_parallel_region(x, tp)
    return tuple(F.linear(x, w, b) for w, b in zip(weights, biases))


class ColumnParallelLinear(torch.nn.Module):
    """``Y = X A^T + b`` with ``A`` split by rows (output features) over the TP group.

    Input: ``[..., in]`` replicated, or ``[s/t, b, in]`` with ``sequence_parallel``.
    Output: ``[..., out/t]`` (``[s, b, out/t]`` with sequence parallel), or ``[..., out]`` with
    ``gather_output``.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        gather_output: bool = False,
        sequence_parallel: bool = False,
        init_method: InitMethod = default_init,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        parallel_state: ParallelState | None = None,
    ):
        super().__init__()
        check_sizes(in_features=in_features, out_features=out_features)
        self.parallel_state = resolve_parallel_state(parallel_state)
        t = self.parallel_state.tp_size
        check_divisible(out_features, "out_features", t)
        self.in_features, self.out_features = in_features, out_features
        self.gather_output, self.sequence_parallel = gather_output, sequence_parallel
        self.weight = torch.nn.Parameter(
            shard_of_full((out_features, in_features), 0, self.parallel_state.tp_rank, t, init_method, dtype, device)
        )
        set_tensor_parallel_attributes(self.weight, partition_dim=0)
        if bias:
            self.bias = torch.nn.Parameter(torch.zeros(out_features // t, dtype=dtype, device=device))
            set_tensor_parallel_attributes(self.bias, partition_dim=0)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tp = self.parallel_state.tp
        (y,) = parallel_linear(x, [self.weight], [self.bias], tp, self.sequence_parallel)
        return gather_from_tensor_parallel_region(y, tp) if self.gather_output else y

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features} (local "
            f"{self.weight.shape[0]}), bias={self.bias is not None}, sequence_parallel={self.sequence_parallel}"
        )


class RowParallelLinear(torch.nn.Module):
    """``Y = X A^T + b`` with ``A`` split by columns (input features) over the TP group.

    Input: ``[..., in/t]`` with ``input_is_parallel`` (the output of a column layer), else
    ``[..., in]`` replicated and split here. Output: ``[..., out]`` all-reduced, or
    ``[s/t, b, out]`` reduce-scattered along the sequence with ``sequence_parallel``.

    The bias is replicated; under sequence parallel each rank adds it to its own sequence chunk,
    so its gradient is all-reduced over TP inside backward (see :mod:`.params`).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        input_is_parallel: bool = True,
        sequence_parallel: bool = False,
        init_method: InitMethod = default_init,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        parallel_state: ParallelState | None = None,
    ):
        super().__init__()
        check_sizes(in_features=in_features, out_features=out_features)
        if sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear: sequence_parallel=True requires input_is_parallel=True")
        self.parallel_state = resolve_parallel_state(parallel_state)
        t = self.parallel_state.tp_size
        check_divisible(in_features, "in_features", t)
        self.in_features, self.out_features = in_features, out_features
        self.input_is_parallel, self.sequence_parallel = input_is_parallel, sequence_parallel
        self.weight = torch.nn.Parameter(
            shard_of_full((out_features, in_features), 1, self.parallel_state.tp_rank, t, init_method, dtype, device)
        )
        set_tensor_parallel_attributes(self.weight, partition_dim=1)
        if bias:
            self.bias = torch.nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device))
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tp = self.parallel_state.tp
        if not self.input_is_parallel:
            x = scatter_to_tensor_parallel_region(x, tp)
        y = F.linear(x, self.weight)
        if self.sequence_parallel:
            check_sequence_divisible(y, tp.size, "RowParallelLinear")
            y = reduce_scatter_to_sequence_parallel_region(y, tp)
            bias = copy_to_tensor_parallel_region(self.bias, tp) if self.bias is not None else None
        else:
            y = reduce_from_tensor_parallel_region(y, tp)
            bias = self.bias
        return y + bias if bias is not None else y

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features} (local {self.weight.shape[1]}), out_features="
            f"{self.out_features}, bias={self.bias is not None}, sequence_parallel={self.sequence_parallel}"
        )
