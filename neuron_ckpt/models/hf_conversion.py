"""``transformers`` Llama checkpoints <-> this rank's tensor-parallel shards.

Names: ours mirror ``transformers`` except the fused query/key/value projection, so the mapping
is ``model.`` + our name, with three renames (``lm_head`` has no ``model.`` prefix)::

    layers.N.self_attn.qkv.q_weight  <->  model.layers.N.self_attn.q_proj.weight   (k, v, biases alike)

Sharding is read off the parameter tags (:mod:`neuron_ckpt.parallel.params`), never off names:
a tagged parameter is split along ``partition_dim`` into ``t / replicas`` shards and rank ``r``
holds shard ``r // replicas``. That one rule covers column weights (dim 0), row weights (dim 1),
the vocab-parallel embedding and GQA key/value heads replicated on ``t / num_kv_heads`` ranks
(rank ``r`` holds kv head ``r // (t / num_kv_heads)``). Untagged parameters are replicated.

A tied model (``tie_word_embeddings``) has one parameter for the embedding and the LM head:
its state dict holds ``model.embed_tokens.weight`` and no ``lm_head.weight``, as ``save_pretrained``
writes it. A checkpoint that holds ``lm_head.weight`` as well (``transformers``' in-memory
``state_dict()`` does) loads when that tensor has the embedding's shape (and, in memory, its values).

These functions take whole in-memory state dicts. Checkpoint directories on disk:
:mod:`.hf_checkpoint` loads one with each rank reading only its slices, :mod:`.hf_export` writes
one gathering a layer at a time on rank 0.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..distributed import collectives as C
from ..parallel.params import is_tensor_parallel
from .parallel_model import ParallelModel

_RENAMES = (
    ("self_attn.qkv.q_weight", "self_attn.q_proj.weight"),
    ("self_attn.qkv.k_weight", "self_attn.k_proj.weight"),
    ("self_attn.qkv.v_weight", "self_attn.v_proj.weight"),
    ("self_attn.qkv.q_bias", "self_attn.q_proj.bias"),
    ("self_attn.qkv.k_bias", "self_attn.k_proj.bias"),
    ("self_attn.qkv.v_bias", "self_attn.v_proj.bias"),
)
# Buffers some transformers versions put in the state dict; derived from the config, not loaded.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def to_hf_name(name: str) -> str:
    """Our parameter name -> the ``transformers`` state-dict key."""
    for ours, theirs in _RENAMES:
        if name.endswith(ours):
            name = name[: -len(ours)] + theirs
            break
    return name if name.startswith("lm_head.") else "model." + name


def _layout(param: torch.Tensor, tp_size: int) -> tuple[int, int, int] | None:
    """``(partition_dim, shards, replicas)`` of a tagged parameter, None when replicated."""
    if not is_tensor_parallel(param):
        return None
    replicas = int(getattr(param, "tensor_parallel_replicas", 1))
    return param.partition_dim, tp_size // replicas, replicas  # type: ignore[attr-defined]  # a marker torch does not declare


def full_shape(param: torch.Tensor, tp_size: int) -> tuple[int, ...]:
    """The shape of the whole (unsharded) tensor this rank holds a piece of."""
    shape = list(param.shape)
    layout = _layout(param, tp_size)
    if layout is not None:
        dim, shards, _ = layout
        shape[dim] *= shards
    return tuple(shape)


def shard_range(param: torch.Tensor, tp_rank: int, tp_size: int) -> tuple[int, int, int] | None:
    """``(dim, start, stop)``: this rank's piece of the full tensor is ``[start:stop]`` along ``dim``.

    None when ``param`` is replicated (the whole tensor). The piece index is ``tp_rank // replicas``
    (GQA kv heads replicated on ``replicas`` consecutive ranks), as in :func:`shard`.
    """
    layout = _layout(param, tp_size)
    if layout is None:
        return None
    dim, _, replicas = layout
    size = param.shape[dim]
    index = tp_rank // replicas
    return dim, index * size, (index + 1) * size


def shard(full: torch.Tensor, param: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This rank's piece of ``full`` for ``param``."""
    layout = _layout(param, tp_size)
    if layout is None:
        return full
    dim, shards, replicas = layout
    return full.chunk(shards, dim=dim)[tp_rank // replicas]


def gather(local: torch.Tensor, param: torch.Tensor, tp) -> torch.Tensor:
    """The whole tensor from every TP rank's ``local`` piece (a collective: all ranks call it)."""
    layout = _layout(param, tp.size)
    if layout is None or tp.size == 1:
        return local
    dim, _, replicas = layout
    gathered = C.all_gather(local.contiguous(), dim, tp)
    if replicas == 1:
        return gathered
    pieces = gathered.chunk(tp.size, dim=dim)
    return torch.cat(pieces[::replicas], dim=dim)  # one copy of each replicated kv head


TIED_HEAD_KEY = "lm_head.weight"
TIED_TABLE_KEY = "model.embed_tokens.weight"


def expected_hf_keys(model: ParallelModel) -> dict[str, tuple[str, torch.nn.Parameter]]:
    """``transformers`` key -> (our name, parameter); a tied head's weight once, as the embedding."""
    return {to_hf_name(name): (name, p) for name, p in model.named_parameters()}


def _tied(model: ParallelModel) -> bool:
    return bool(getattr(getattr(model, "args", None), "tie_word_embeddings", False))


def check_hf_shapes(
    model: ParallelModel, shapes: Mapping[str, tuple[int, ...]], what: str = "state dict"
) -> dict[str, tuple[str, torch.nn.Parameter]]:
    """Check a checkpoint's keys and full shapes against ``model``; returns :func:`expected_hf_keys`.

    ``shapes``: ``transformers`` key -> full shape (``rotary_emb.inv_freq`` buffers are ignored).
    Raises ``KeyError`` listing every missing and unexpected key, then ``ValueError`` listing
    every shape mismatch: the caller writes no parameter before this returns.
    """
    expected = expected_hf_keys(model)
    local = {key: p for key, (_, p) in expected.items()}
    check_keys_and_shapes(local, set(local), model.args, model.parallel_state.tp.size, shapes, what)
    return expected


def check_keys_and_shapes(
    local: Mapping[str, torch.nn.Parameter],
    whole: set[str],
    args: Any,
    tp_size: int,
    shapes: Mapping[str, tuple[int, ...]],
    what: str,
) -> None:
    """:func:`check_hf_shapes` for a rank that holds part of the model: the checkpoint's keys
    against ``whole`` (every key of the model, a pipeline's other stages included), the shapes of
    ``local`` (key -> this rank's parameter) against its full shapes. Raises as
    :func:`check_hf_shapes` does."""
    given = {k for k in shapes if not k.endswith(_IGNORED_SUFFIXES)}
    if (
        getattr(args, "tie_word_embeddings", False) and TIED_HEAD_KEY in given
    ):  # the table's values: checked, not loaded
        given.discard(TIED_HEAD_KEY)
        if TIED_TABLE_KEY in shapes and tuple(shapes[TIED_HEAD_KEY]) != tuple(shapes[TIED_TABLE_KEY]):
            raise ValueError(
                f"{what}: tie_word_embeddings is true but {TIED_HEAD_KEY} {tuple(shapes[TIED_HEAD_KEY])} "
                f"has not the shape of {TIED_TABLE_KEY} {tuple(shapes[TIED_TABLE_KEY])}"
            )
    missing, unexpected = sorted(whole - given), sorted(given - whole)
    if missing or unexpected:
        raise KeyError(
            f"{what} does not match the model ({args.num_hidden_layers} layers): "
            f"missing keys {missing or 'none'}; unexpected keys {unexpected or 'none'}"
        )
    wrong = []
    for key, p in local.items():
        want = full_shape(p, tp_size)
        if tuple(shapes[key]) != want:
            wrong.append(f"{key}: checkpoint {tuple(shapes[key])}, model expects {want}")
    if wrong:
        raise ValueError(f"shape mismatch between the {what} and the model config:\n  " + "\n  ".join(wrong))


def load_hf_state_dict(model: ParallelModel, state_dict: dict[str, torch.Tensor]) -> None:
    """Copy each rank's shard of a full ``transformers`` state dict into ``model``.

    Raises ``KeyError`` listing missing and unexpected keys, ``ValueError`` listing every shape
    mismatch, before any parameter is written.
    """
    tp = model.parallel_state.tp
    expected = check_hf_shapes(model, {k: tuple(v.shape) for k, v in state_dict.items()}, "state dict")
    head = state_dict.get(TIED_HEAD_KEY) if _tied(model) else None
    if head is not None and not torch.equal(head, state_dict[TIED_TABLE_KEY]):
        raise ValueError(
            f"state dict: tie_word_embeddings is true but {TIED_HEAD_KEY} differs from "
            f"{TIED_TABLE_KEY} (an untied checkpoint? set tie_word_embeddings false)"
        )
    with torch.no_grad():
        for key, (_, p) in expected.items():
            p.copy_(shard(state_dict[key], p, tp.rank, tp.size).to(device=p.device, dtype=p.dtype))


def hf_state_dict(model: ParallelModel, grads: bool = False) -> dict[str, torch.Tensor]:
    """The full ``transformers`` state dict (or gradients) on CPU, gathered over TP on every rank.

    Holds the whole model on every rank's host: for checkpoints of real models use
    :func:`neuron_ckpt.models.hf_export.save_hf_checkpoint` (one layer at a time, rank 0 only).
    """
    tp = model.parallel_state.tp
    out = {}
    for name, p in model.named_parameters():
        local = p.detach()
        if grads:
            local = p.grad.detach() if p.grad is not None else torch.zeros_like(local)
        out[to_hf_name(name)] = gather(local, p, tp).cpu().clone(memory_format=torch.contiguous_format)
    return out
