"""Load a ``transformers`` checkpoint from disk into a pipeline: each rank reads only its stages' slices.

What :func:`neuron_ckpt.models.load_hf_checkpoint` does for a whole model (``config.json``
compared, keys and full shapes checked from the file headers before any parameter is written,
each tensor's TP slice read through its own memory map; the same code,
:func:`~neuron_ckpt.models.hf_checkpoint.load_hf_slices`), for the stages one rank holds
(``train.py --init-hf`` with ``--pp > 1``). The keys are checked against the whole model, not only
the local stages: a checkpoint of another depth is refused on every rank, though each rank reads
only its own layers. A tied model's last stage reads its LM head from the embedding table's key
(:mod:`.hf_weights`).
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from ..models.hf_checkpoint import load_hf_slices
from ..models.hf_conversion import TIED_HEAD_KEY, TIED_TABLE_KEY
from .hf_weights import stage_hf_keys
from .llama_pipeline import LlamaPipeline

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def _whole_model_keys(pipe: LlamaPipeline, local: dict[str, torch.nn.Parameter]) -> set[str]:
    """Every key of the whole model, from this rank's stages (every stage holds a layer, and every
    layer has the same parameters)."""
    suffixes = {m.group(2) for m in map(_LAYER.match, local) if m}
    keys = {f"model.layers.{i}.{s}" for i in range(pipe.args.num_hidden_layers) for s in suffixes}
    keys |= {TIED_TABLE_KEY, "model.norm.weight"} | (set() if pipe.args.tie_word_embeddings else {TIED_HEAD_KEY})
    return keys


def load_pipeline_hf_checkpoint(pipe: LlamaPipeline, path: str | Path) -> None:
    """Copy this rank's slices of the checkpoint at ``path`` (a ``save_pretrained`` directory or one
    weights file) into the stages ``pipe`` holds. Not a collective. Raises before writing any
    parameter: ``ValueError`` (config.json or shapes), ``KeyError`` (missing / unexpected keys)."""
    local = {k: p for m in pipe.modules for k, p in stage_hf_keys(m).items()}
    load_hf_slices(pipe.args, pipe.parallel_state.tp, local, _whole_model_keys(pipe, local), path)
