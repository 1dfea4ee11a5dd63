"""Load a ``transformers`` checkpoint from disk into a pipeline: each rank reads only its stages' slices.

What :func:`neuron_ckpt.models.load_hf_checkpoint` does for a whole model (``config.json``
compared, keys and full shapes checked from the file headers before any parameter is written,
each tensor's TP slice read through its own memory map), for the stages one rank holds
(``train.py --init-hf`` with ``--pp > 1``). The keys are checked against the whole model, not only
the local stages: a checkpoint of another depth is refused on every rank, though each rank reads
only its own layers. A tied model's last stage reads its LM head from the embedding table's key
(:mod:`.hf_weights`).
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from ..models import hf_checkpoint as hfc
from ..models.hf_conversion import TIED_HEAD_KEY, TIED_TABLE_KEY, full_shape, shard_range
from .hf_weights import stage_hf_keys
from .llama_pipeline import LlamaPipeline

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # as hf_conversion: derived from the config, not loaded


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
    hf_config = hfc.read_hf_config(path, notices=[])
    if hf_config is not None:
        hfc.check_hf_config(pipe.args, hf_config, str(Path(path) / hfc.CONFIG_NAME))
    # The header scan and the per-tensor read are load_hf_checkpoint's own (private) steps: the
    # same files, the same checks, a stage's subset of the keys.
    entries, loaded = hfc._scan(hfc.weight_files(path))
    local = {k: p for m in pipe.modules for k, p in stage_hf_keys(m).items()}
    given = {k for k in entries if not k.endswith(_IGNORED_SUFFIXES)}
    if pipe.args.tie_word_embeddings:
        given.discard(TIED_HEAD_KEY)  # the table's values: checked by shape, not loaded
        head, table = entries.get(TIED_HEAD_KEY), entries.get(TIED_TABLE_KEY)
        if head is not None and table is not None and head.shape != table.shape:
            raise ValueError(
                f"checkpoint {path}: tie_word_embeddings is true but {TIED_HEAD_KEY} {head.shape} "
                f"has not the shape of {TIED_TABLE_KEY} {table.shape}"
            )
    whole = _whole_model_keys(pipe, local)
    missing, unexpected = sorted(whole - given), sorted(given - whole)
    if missing or unexpected:
        raise KeyError(
            f"checkpoint {path} does not match the model ({pipe.args.num_hidden_layers} layers): "
            f"missing keys {missing or 'none'}; unexpected keys {unexpected or 'none'}"
        )
    tp = pipe.parallel_state.tp
    wrong = [
        f"{k}: checkpoint {entries[k].shape}, model expects {full_shape(p, tp.size)}"
        for k, p in local.items()
        if tuple(entries[k].shape) != full_shape(p, tp.size)
    ]
    if wrong:
        raise ValueError(f"shape mismatch between checkpoint {path} and the model config: " + "; ".join(wrong))
    with torch.no_grad():
        for key, p in local.items():
            piece = hfc._read(entries[key].file, key, hfc._index(shard_range(p, tp.rank, tp.size)), loaded)
            p.copy_(piece.to(dtype=p.dtype).to(device=p.device))
            del piece
