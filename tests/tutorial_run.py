"""What the tests that run the tutorial's ``train.py`` share: the tiny model config and corpus
files, and ``main(argv)`` wrapped as module-level functions (LocalWorld pickles them to its
workers)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from .helpers import TINY

TUTORIAL = Path(__file__).resolve().parents[1] / "tutorials" / "llama2_7b_tp_zero1"


def tiny_run_files(root: Path, blocks: np.ndarray | None = None) -> list[str]:
    """Write the tiny config and a packed token file under ``root``; the ``--model-config`` and
    ``--data`` arguments that name them. ``blocks``: the token blocks (default: 64 blocks of 16
    consecutive ids from random starts, so the loss can fall)."""
    if blocks is None:
        blocks = (np.random.default_rng(0).integers(0, 128, size=(64, 1)) + np.arange(16)) % 128
    from neuron_ckpt.data import write_packed

    (root / "tiny.json").write_text(json.dumps(TINY))
    write_packed(root / "train.safetensors", blocks, vocab_size=128, tokenizer="random")
    return ["--model-config", str(root / "tiny.json"), "--data", str(root / "train.safetensors")]


def train_module():
    """The tutorial's ``train`` module (its directory goes on ``sys.path`` once)."""
    if str(TUTORIAL) not in sys.path:
        sys.path.insert(0, str(TUTORIAL))
    import train

    return train


def train(argv: list[str]) -> dict:
    return train_module().main(argv)


def train_error(argv: list[str], kind: type[BaseException] = ValueError) -> str:
    """The message of the ``kind`` error ``main(argv)`` raises ("" when it raises none)."""
    try:
        train(argv)
    except kind as e:
        return str(e)
    return ""
