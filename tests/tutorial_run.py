"""What the tests that run the tutorial's ``train.py`` share: the tiny model config, and
``main(argv)`` wrapped as module-level functions (LocalWorld pickles them to its workers)."""

from __future__ import annotations

import sys
from pathlib import Path

TUTORIAL = Path(__file__).resolve().parents[1] / "tutorials" / "llama2_7b_tp_zero1"
TINY = {
    "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
    "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
}  # fmt: skip


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
