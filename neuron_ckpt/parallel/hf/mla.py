"""``mla_kv_a_proj``: multi-head latent attention (DeepSeek-V2) with its heads split.

The plan splits the heads' up projections (``q_b_proj``/``q_proj``, ``kv_b_proj``: colwise) and
``o_proj`` (rowwise) and keeps the down projection ``kv_a_proj_with_mqa`` whole. Its output is
``[latent | k_rot]``: the latent goes through ``kv_b_proj``, whose ``ColumnParallelLinear`` sums
its input gradient over the group, but ``k_rot`` (the key's rotary part, one head shared by all)
goes straight to this rank's heads, so its gradient is partial on each rank. The style enters it
with ``copy_to_tensor_parallel_region`` (identity, all-reduce of the gradient), as transformers'
``MlaKvAProjParallel`` does.
"""

from __future__ import annotations

import torch

from ...distributed.mappings import copy_to_tensor_parallel_region
from .style import Split, Style, Target


def _attention(model: torch.nn.Module, target: Target) -> torch.nn.Module:
    return model.get_submodule(target.name.rpartition(".")[0])


def _rope_dim(model: torch.nn.Module, target: Target) -> int | None:
    config = getattr(model, "config", None)
    text = config.get_text_config() if config is not None and hasattr(config, "get_text_config") else config
    return getattr(_attention(model, target), "qk_rope_head_dim", getattr(text, "qk_rope_head_dim", None))


def _check(model: torch.nn.Module, target: Target, t: int) -> None:
    module, where = target.module, target.where
    if type(module) is not torch.nn.Linear:
        raise ValueError(f"{where}: needs a torch.nn.Linear, got {type(module).__name__}")
    rope = _rope_dim(model, target)
    if not isinstance(rope, int) or not 0 < rope < module.out_features:
        raise ValueError(
            f"{where}: needs qk_rope_head_dim (the attention's or the config's) below out_features, got {rope}"
        )
    heads = getattr(_attention(model, target), "num_heads", None)
    if not isinstance(heads, int) or heads % t:
        raise ValueError(
            f"{where}: num_heads={heads} of its attention is not divisible by the tensor-parallel size {t}"
        )


def _apply(target: Target, split: Split) -> None:
    rope, group = _rope_dim(split.model, target), split.state.tp

    def leave(module, args, output):
        latent, k_rot = output.split([output.shape[-1] - rope, rope], dim=-1)
        return torch.cat([latent, copy_to_tensor_parallel_region(k_rot, group)], dim=-1)

    target.module.register_forward_hook(leave)


MLA_STYLES: dict[str, Style] = {"mla_kv_a_proj": Style(_check, _apply)}
