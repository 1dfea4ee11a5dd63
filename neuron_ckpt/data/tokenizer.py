"""Tokenizers: a local sentencepiece model or `transformers` directory, or the offline default
(the Llama-style 32k sentencepiece model shipped in the mistral-common package).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

DEFAULT_TOKENIZER = "mistral-common:tokenizer.model.v1"


@dataclass(frozen=True)
class TextTokenizer:
    """The little the packer needs from a tokenizer, whatever library provides it."""

    name: str
    vocab_size: int
    eos_id: int
    bos_id: int | None
    encode_batch: Callable[[list[str]], list[list[int]]]


def default_tokenizer_path() -> Path:
    """The Llama-style 32000-token sentencepiece model shipped inside mistral-common."""
    spec = importlib.util.find_spec("mistral_common")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            "tokenizer: the default needs the mistral-common package "
            "(pip install --no-deps mistral-common==1.13.1) or pass a tokenizer path"
        )
    return Path(spec.submodule_search_locations[0]) / "data" / "tokenizer.model.v1"


def _sentencepiece(path: Path, name: str) -> TextTokenizer:
    """Plain sentencepiece: offline, no conversion step, and batch encoding uses every core."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(path))
    if sp.eos_id() < 0:
        raise ValueError(f"tokenizer {path}: sentencepiece model has no EOS id")
    threads = os.cpu_count() or 1
    return TextTokenizer(
        name=name,
        vocab_size=sp.vocab_size(),
        eos_id=sp.eos_id(),
        bos_id=sp.bos_id() if sp.bos_id() >= 0 else None,
        encode_batch=lambda texts: sp.encode(texts, num_threads=threads),
    )


def _transformers(name_or_path: str) -> TextTokenizer:
    from transformers import AutoTokenizer

    local = Path(name_or_path).exists()
    try:
        tok = AutoTokenizer.from_pretrained(name_or_path, local_files_only=local)
    except (OSError, ValueError) as e:
        raise ValueError(f"tokenizer {name_or_path!r}: transformers could not load it: {e}") from None
    if tok.eos_token_id is None:
        raise ValueError(f"tokenizer {name_or_path!r}: has no EOS token (eos_token_id is None)")
    return TextTokenizer(
        name=name_or_path,
        vocab_size=len(tok),
        eos_id=tok.eos_token_id,
        bos_id=tok.bos_token_id,
        encode_batch=lambda texts: tok(texts, add_special_tokens=False, verbose=False)["input_ids"],
    )


def load_tokenizer(name_or_path: str | os.PathLike | None = None) -> TextTokenizer:
    """Load a tokenizer from a local source, or the offline default when none is given.

    - None / "default": the mistral-common Llama-style sentencepiece model (32000 tokens);
    - a sentencepiece ``.model`` file, or a directory holding only ``tokenizer.model``;
    - a directory that ``transformers.AutoTokenizer`` can load (``tokenizer.json`` /
      ``tokenizer_config.json``), e.g. a downloaded Llama-2 checkpoint;
    - anything else is passed to ``AutoTokenizer`` as a hub name (needs network access).
    """
    if name_or_path is None or str(name_or_path) in ("default", DEFAULT_TOKENIZER):
        return _sentencepiece(default_tokenizer_path(), DEFAULT_TOKENIZER)
    path = Path(name_or_path)
    if path.is_file():
        if path.suffix == ".model" or path.name.startswith("tokenizer.model"):
            return _sentencepiece(path, str(name_or_path))
        raise ValueError(
            f"tokenizer {path}: a file must be a sentencepiece .model; for a tokenizer.json pass its directory"
        )
    hf_files = ("tokenizer.json", "tokenizer_config.json")
    sp_only = not any((path / f).exists() for f in hf_files) and (path / "tokenizer.model").exists()
    if path.is_dir() and sp_only:
        return _sentencepiece(path / "tokenizer.model", str(name_or_path))
    return _transformers(str(name_or_path))
