"""Pretraining data: packed token files, a resumable data-parallel batch order, tokenisation.

The pipeline is: documents -> token ids -> one stream with EOS after every document (or BOS
before it) -> fixed length blocks (the remainder is dropped) -> one packed file (:mod:`.packed`) ->
`PackedDataset` -> the `DataParallelBatches` order (:mod:`.batches`) that every DP rank
computes for itself. Tokenizers are in :mod:`.tokenizer`, documents and packing in
:mod:`.corpus`; already tokenized datasets (rows of ``input_ids``) in :mod:`.pretokenized`.

Heavy or optional libraries (sentencepiece, transformers, datasets) are imported only by the
functions that need them: reading packed files needs numpy, safetensors and torch only.
"""

from .batches import DataParallelBatches
from .corpus import (
    JSONL_SUFFIXES,
    SEPARATORS,
    TEXT_SUFFIXES,
    PackResult,
    default_corpus_files,
    expand_inputs,
    iter_documents,
    split_blocks,
    tokenize_and_pack,
    val_path_for,
)
from .packed import (
    FORMAT_MAGIC,
    FORMAT_VERSION,
    PackedDataset,
    PackedInfo,
    token_dtype,
    write_packed,
)
from .pretokenized import is_tokenized_dataset, pack_tokenized_dataset
from .tokenizer import (
    DEFAULT_TOKENIZER,
    TextTokenizer,
    default_tokenizer_path,
    load_tokenizer,
)

__all__ = [
    "DEFAULT_TOKENIZER",
    "FORMAT_MAGIC",
    "FORMAT_VERSION",
    "JSONL_SUFFIXES",
    "TEXT_SUFFIXES",
    "DataParallelBatches",
    "PackResult",
    "PackedDataset",
    "PackedInfo",
    "SEPARATORS",
    "TextTokenizer",
    "default_corpus_files",
    "default_tokenizer_path",
    "expand_inputs",
    "is_tokenized_dataset",
    "iter_documents",
    "load_tokenizer",
    "pack_tokenized_dataset",
    "split_blocks",
    "token_dtype",
    "tokenize_and_pack",
    "val_path_for",
    "write_packed",
]
