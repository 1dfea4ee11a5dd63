"""A stage's slice of a full ``transformers`` Llama state dict, in and out.

The names are :mod:`neuron_ckpt.models.hf_conversion`'s (``model.layers.N.self_attn.q_proj.weight``,
``lm_head.weight``...) and so is the sharding over TP (read off the parameter tags). One difference:
the LM head of a tied model on a last stage that does not hold the embedding is its own parameter,
read from and written as the table's key ``model.embed_tokens.weight`` (a tied checkpoint has no
``lm_head.weight``; when it does, it must equal the table, as for ``LlamaForCausalLM``).

Whole in-memory state dicts, as ``LlamaForCausalLM.load_hf_state_dict`` takes: parity tests and
small models. Sharded checkpoints of stages are a later piece of work.
"""

from __future__ import annotations

import torch

from ..models.hf_conversion import TIED_HEAD_KEY, TIED_TABLE_KEY, full_shape, gather, shard, to_hf_name
from .llama_stage import LlamaStage


def stage_hf_keys(stage: LlamaStage) -> dict[str, torch.nn.Parameter]:
    """``transformers`` key -> this stage's parameter (a shared tied parameter once)."""
    keys = {}
    for name, p in stage.named_parameters():
        key = to_hf_name(name)
        if key == TIED_HEAD_KEY and stage.args.tie_word_embeddings:
            key = TIED_TABLE_KEY
        keys[key] = p
    return keys


def load_stage_hf_state_dict(stage: LlamaStage, state_dict: dict[str, torch.Tensor]) -> None:
    """Copy this rank's shard of each of the stage's tensors out of a full state dict.

    Keys of other stages are ignored. Raises ``KeyError`` naming the stage's missing keys, then
    ``ValueError`` listing shape mismatches, before any parameter is written.
    """
    keys = stage_hf_keys(stage)
    missing = sorted(k for k in keys if k not in state_dict)
    if missing:
        raise KeyError(f"state dict lacks keys of stage {stage.stage_index}: {missing}")
    head = state_dict.get(TIED_HEAD_KEY) if stage.args.tie_word_embeddings else None
    if head is not None and not torch.equal(head, state_dict[TIED_TABLE_KEY]):
        raise ValueError(f"state dict: tie_word_embeddings is true but {TIED_HEAD_KEY} differs from {TIED_TABLE_KEY}")
    t = stage.parallel_state.tp
    wrong = [
        f"{k}: {tuple(state_dict[k].shape)}, stage expects {full_shape(p, t.size)}"
        for k, p in keys.items()
        if tuple(state_dict[k].shape) != full_shape(p, t.size)
    ]
    if wrong:
        raise ValueError("shape mismatch between the state dict and the stage: " + "; ".join(wrong))
    with torch.no_grad():
        for key, p in keys.items():
            p.copy_(shard(state_dict[key], p, t.rank, t.size).to(device=p.device, dtype=p.dtype))


def stage_hf_state_dict(stage: LlamaStage, grads: bool = False) -> dict[str, torch.Tensor]:
    """The stage's full tensors (or gradients; zeros where none) on CPU, gathered over TP."""
    t = stage.parallel_state.tp
    out = {}
    for key, p in stage_hf_keys(stage).items():
        local = p.detach() if not grads else (p.grad.detach() if p.grad is not None else torch.zeros_like(p))
        out[key] = gather(local, p, t).cpu().clone(memory_format=torch.contiguous_format)
    return out
