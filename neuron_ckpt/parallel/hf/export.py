"""A transformers model split by :func:`~.plan.apply_tensor_parallel`, written whole: what
``from_pretrained`` loads.

:func:`gather_state_dict` rebuilds each parameter from the tags its split left on it: a
tensor-parallel slice is all-gathered over TP along its ``partition_dim`` (each of its
``partition_stride`` packed parts on its own: an experts' gate and up halves), this EP rank's
experts (``expert_parallel``) are all-gathered over EP along dim 0; anything else is whole already.
:func:`save_pretrained` writes that with the model's own ``save_pretrained`` on global rank 0, so
config, shards and key names are transformers' (the config was never changed: only the experts
module's ``num_experts`` attribute holds the local count).

A collective: every rank calls it (every TP and EP group gathers at once; the other DP replicas
gather the same values and drop them). Memory: rank 0 holds the whole state dict on the host (a
debugging and small-model path; a model of many GB wants the layer-by-layer writer of
:func:`neuron_ckpt.models.save_hf_checkpoint`, which exports our own Llama).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ...distributed import collectives as C
from ...distributed.host import first_problem, rank
from ...distributed.parallel_state import ParallelState
from ..layer_args import resolve_parallel_state
from ..params import is_expert_parallel, is_tensor_parallel


def _whole(tensor: torch.Tensor, param: torch.Tensor | None, state: ParallelState) -> torch.Tensor:
    if param is None:
        return tensor
    if is_tensor_parallel(param) and state.tp_size > 1:
        dim, parts = param.partition_dim, getattr(param, "partition_stride", 1)  # type: ignore[attr-defined]  # our tags
        tensor = torch.cat([C.all_gather(p.contiguous(), dim, state.tp) for p in tensor.chunk(parts, dim)], dim)
    if is_expert_parallel(param) and state.ep is not None:
        tensor = C.all_gather(tensor.contiguous(), 0, state.ep)
    return tensor


@torch.no_grad()
def gather_state_dict(model: torch.nn.Module, parallel_state: ParallelState | None = None) -> dict[str, Any] | None:
    """The model's whole state dict on global rank 0 (on the host), None elsewhere; a collective."""
    state = resolve_parallel_state(parallel_state)
    params = dict(model.named_parameters())
    out = {}
    for name, tensor in model.state_dict().items():
        whole = _whole(tensor, params.get(name), state)
        if rank() == 0:
            out[name] = whole.cpu()
    return out if rank() == 0 else None


def save_pretrained(
    model: Any, directory: str | Path, parallel_state: ParallelState | None = None, **kwargs: Any
) -> Path | None:
    """``model.save_pretrained(directory, state_dict=<the whole model>, **kwargs)`` on global rank 0
    (a collective). Returns the directory on rank 0, None elsewhere; a write error on rank 0 is
    raised on every rank."""
    whole = gather_state_dict(model, parallel_state)
    problem = None
    if whole is not None:
        try:
            model.save_pretrained(directory, state_dict=whole, **kwargs)
        except Exception as e:  # noqa: BLE001  raised on every rank below
            problem = f"{type(e).__name__}: {e}"
    problem = first_problem(problem)
    if problem:
        raise OSError(f"save_pretrained to {directory} failed on rank 0: {problem}")
    return Path(directory) if whole is not None else None
