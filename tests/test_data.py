"""Specification of the tutorial data pipeline: packed files, the DP batch order, tokenisation."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save

from neuron_ckpt import data

from .helpers import run_prepare_data

VOCAB = 32000


def _write(path: Path, num_blocks: int = 10, block_len: int = 16, vocab: int = VOCAB) -> np.ndarray:
    """Write a packed file whose block i starts with token i (so batches show which blocks)."""
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, vocab, size=(num_blocks, block_len))
    blocks[:, 0] = np.arange(num_blocks)
    data.write_packed(path, blocks, vocab_size=vocab, tokenizer="test", eos_id=2)
    return blocks


def _forge_metadata(path: Path, **changes: str) -> None:
    """Rewrite a packed file's metadata, keeping its payload (and so its checksum)."""
    header_len = int.from_bytes(path.read_bytes()[:8], "little")
    meta = json.loads(path.read_bytes()[8 : 8 + header_len])["__metadata__"]
    path.write_bytes(save(load_file(path), metadata={**meta, **changes}))


@pytest.fixture(scope="module")
def tokenizer() -> data.TextTokenizer:
    return data.load_tokenizer()


# ----------------------------------------------------------------------------- file format


@pytest.mark.parametrize("vocab, dtype", [(VOCAB, "uint16"), (2**16, "uint16"), (10**5, "uint32")])
def test_round_trip_keeps_ids_and_picks_the_smallest_dtype(tmp_path, vocab, dtype):
    path = tmp_path / "train.bin"
    blocks = _write(path, vocab=vocab)
    ds = data.PackedDataset(path, expected_seq_len=16, expected_vocab_size=vocab)
    assert len(ds) == 10 and ds.block_len == 16 and ds.info.dtype == dtype
    assert ds.info.tokenizer == "test" and ds.info.eos_id == 2
    assert ds[3].dtype == torch.long and ds[3].shape == (16,)
    assert torch.equal(torch.stack([ds[i] for i in range(len(ds))]), torch.from_numpy(blocks))
    assert torch.equal(ds.get_blocks([7, 1]), torch.from_numpy(blocks[[7, 1]]))
    with pytest.raises(IndexError):
        ds[10]


def test_write_is_atomic_and_leaves_no_temp_files(tmp_path):
    _write(tmp_path / "train.bin", num_blocks=10)
    _write(tmp_path / "train.bin", num_blocks=4)  # overwrite in place
    assert [p.name for p in tmp_path.iterdir()] == ["train.bin"]
    assert len(data.PackedDataset(tmp_path / "train.bin")) == 4


def test_write_refuses_ids_outside_the_vocab(tmp_path):
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 100\)"):
        data.write_packed(tmp_path / "x.bin", np.full((2, 4), 100), vocab_size=100, tokenizer="t")


def test_missing_file_is_named(tmp_path):
    with pytest.raises(ValueError, match="nope.bin: packed token file does not exist"):
        data.PackedDataset(tmp_path / "nope.bin")


def test_truncated_file_is_rejected(tmp_path):
    path = tmp_path / "train.bin"
    _write(path)
    path.write_bytes(path.read_bytes()[:-5])
    with pytest.raises(ValueError, match=r"train.bin: truncated payload: file has \d+ bytes"):
        data.PackedDataset(path)


def test_flipped_payload_byte_fails_the_checksum(tmp_path):
    path = tmp_path / "train.bin"
    _write(path)
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0x01
    path.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match=r"train.bin: payload sha256 \(checksum\) is '[0-9a-f]+'"):
        data.PackedDataset(path)


def test_full_scans_run_once_per_version_of_the_file(tmp_path, monkeypatch):
    """The checksum and id-range scans read the whole corpus: once they pass, a stamp beside the
    file lets later opens (other ranks, later runs) skip them, until the file changes."""
    from neuron_ckpt.data import packed

    scans = []
    real = packed._sha256
    monkeypatch.setattr(packed, "_sha256", lambda rows: scans.append(1) or real(rows))
    path = tmp_path / "train.bin"
    _write(path)
    assert not (tmp_path / "train.bin.verified").exists()  # the writer leaves no stamp
    scans.clear()  # (the writer hashes what it writes)
    data.PackedDataset(path)
    assert len(scans) == 1 and (tmp_path / "train.bin.verified").is_file()
    data.PackedDataset(path)
    assert len(scans) == 1  # stamp matches: no second scan
    data.PackedDataset(path, verify_checksum=False)
    assert len(scans) == 1
    # A damaged copy with a later mtime (what any real rewrite has): scanned again, and refused.
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0x01
    before = path.stat().st_mtime_ns
    path.write_bytes(bytes(raw))
    os.utime(path, ns=(before + 10**9, before + 10**9))
    with pytest.raises(ValueError, match=r"payload sha256 \(checksum\)"):
        data.PackedDataset(path)
    assert len(scans) == 2
    # A new file at the same path (write_packed replaces the inode) is scanned once more.
    _write(path)
    del scans[2:]
    data.PackedDataset(path)
    data.PackedDataset(path)
    assert len(scans) == 3


def test_wrong_magic_is_rejected(tmp_path):
    path = tmp_path / "train.bin"
    _write(path)
    _forge_metadata(path, format="something.else")
    with pytest.raises(ValueError, match=r"'format' \(magic\) is 'something.else', expected"):
        data.PackedDataset(path)


def test_a_file_that_is_not_safetensors_is_rejected(tmp_path):
    path = tmp_path / "train.bin"
    path.write_bytes(b"\x89PNG not tokens at all" * 4)
    with pytest.raises(ValueError, match="train.bin: format: not a packed token file"):
        data.PackedDataset(path)


def test_ids_at_or_above_vocab_size_are_rejected(tmp_path):
    path = tmp_path / "train.bin"
    _write(path)  # ids up to VOCAB - 1
    _forge_metadata(path, vocab_size="1000")  # checksum still valid: only the range check fires
    with pytest.raises(ValueError, match=r"token id \d+ out of range: .* < vocab_size 1000$"):
        data.PackedDataset(path)


def test_seq_len_and_vocab_mismatch_name_both_values(tmp_path):
    path = tmp_path / "train.bin"
    _write(path, block_len=16)
    with pytest.raises(ValueError, match=r"block_len \(sequence length\) is 16, expected 128"):
        data.PackedDataset(path, expected_seq_len=128)
    with pytest.raises(ValueError, match="vocab_size is 32000, expected 50257"):
        data.PackedDataset(path, expected_vocab_size=50257)


# ----------------------------------------------------------------------------- batch order


@pytest.fixture
def hundred_blocks(tmp_path) -> data.PackedDataset:
    _write(tmp_path / "train.bin", num_blocks=100, block_len=8)
    return data.PackedDataset(tmp_path / "train.bin")


def _block_ids(step_batches: list[torch.Tensor]) -> list[int]:
    return [int(i) for mb in step_batches for i in mb[:, 0]]


def _run(ds, steps, dp_size=4, seed=0, **kw) -> list[list[list[int]]]:
    """[step][dp_rank] -> block ids that rank trains on in that step."""
    iters = [data.DataParallelBatches(ds, 2, r, dp_size, seed, grad_accum=3, **kw) for r in range(dp_size)]
    return [[_block_ids(next(it)) for it in iters] for _ in range(steps)]


def test_each_step_yields_grad_accum_micro_batches_of_input_ids(hundred_blocks):
    it = data.DataParallelBatches(hundred_blocks, 2, 0, 4, seed=0, grad_accum=3)
    step = next(it)
    assert len(step) == 3 and all(mb.shape == (2, 8) and mb.dtype == torch.long for mb in step)
    assert it.global_batch == 2 * 3 * 4  # micro_batch * grad_accum * dp_size
    assert it.steps_per_epoch == 100 // 24


def test_dp_ranks_get_disjoint_shards_covering_an_epoch(hundred_blocks):
    epoch = _run(hundred_blocks, steps=4)  # 4 steps of 24 blocks = one epoch of 100 blocks
    seen = [b for step in epoch for rank in step for b in rank]
    assert len(seen) == len(set(seen)) == 96  # disjoint; the 4 left over wait for next epoch
    for step in epoch:
        shards = [set(rank) for rank in step]
        assert all(len(s) == 6 for s in shards) and len(set().union(*shards)) == 24


def test_order_is_deterministic_and_reshuffled_every_epoch(hundred_blocks):
    assert _run(hundred_blocks, 8) == _run(hundred_blocks, 8)
    assert _run(hundred_blocks, 4) != _run(hundred_blocks, 4, seed=1)
    rank0 = [step[0] for step in _run(hundred_blocks, 8)]
    assert rank0[:4] != rank0[4:]  # epoch 1 is a new permutation


@pytest.mark.parametrize("k", [1, 4, 6])  # 4 = an epoch boundary, 6 = inside epoch 1
def test_start_step_k_equals_skipping_k_steps(hundred_blocks, k):
    assert _run(hundred_blocks, 10)[k:] == _run(hundred_blocks, 10 - k, start_step=k)


def test_same_global_batch_gives_the_same_blocks_whatever_the_dp_split(hundred_blocks):
    def step_sets(dp_size: int, grad_accum: int) -> list[set[int]]:
        its = [data.DataParallelBatches(hundred_blocks, 2, r, dp_size, 0, grad_accum=grad_accum)
               for r in range(dp_size)]  # fmt: skip
        return [set().union(*(_block_ids(next(it)) for it in its)) for _ in range(6)]

    assert step_sets(dp_size=4, grad_accum=3) == step_sets(dp_size=2, grad_accum=6)


def test_state_dict_resumes_and_refuses_a_changed_config(hundred_blocks):
    it = data.DataParallelBatches(hundred_blocks, 2, 1, 4, seed=5, grad_accum=3)
    for _ in range(5):
        next(it)
    resumed = data.DataParallelBatches(hundred_blocks, 2, 1, 4, seed=5, grad_accum=3)
    resumed.load_state_dict(it.state_dict())
    assert _block_ids(next(resumed)) == _block_ids(next(it))
    other_seed = data.DataParallelBatches(hundred_blocks, 2, 1, 4, seed=6, grad_accum=3)
    with pytest.raises(ValueError, match="seed is 6 now, checkpoint has 5"):
        other_seed.load_state_dict(it.state_dict())


def test_bad_iterator_arguments_name_the_field(hundred_blocks):
    with pytest.raises(ValueError, match=r"dp_rank must be in \[0, 4\), got 4"):
        data.DataParallelBatches(hundred_blocks, 2, 4, 4, seed=0)
    with pytest.raises(ValueError, match="micro_batch_size must be >= 1, got 0"):
        data.DataParallelBatches(hundred_blocks, 0, 0, 4, seed=0)
    with pytest.raises(ValueError, match="fewer than one global batch of 128"):
        data.DataParallelBatches(hundred_blocks, 8, 0, 4, seed=0, grad_accum=4)


# ----------------------------------------------------------------------------- tokenisation


DOCS = ["To be, or not to be, that is the question.", "Friends, Romans, countrymen.", "Exit"]


def test_default_tokenizer_is_the_llama_style_32k_model(tokenizer):
    assert (tokenizer.vocab_size, tokenizer.eos_id, tokenizer.bos_id) == (32000, 2, 1)
    assert tokenizer.name == data.DEFAULT_TOKENIZER


def test_pack_puts_eos_after_every_document_and_drops_the_remainder(tokenizer):
    packed = data.tokenize_and_pack(DOCS, tokenizer, seq_len=8, progress=False)
    stream = [t for ids in tokenizer.encode_batch(DOCS) for t in ids + [tokenizer.eos_id]]
    assert packed.blocks.shape == (len(stream) // 8, 8)
    assert packed.blocks.ravel().tolist() == stream[: packed.blocks.size]
    assert (packed.num_documents, packed.num_tokens) == (3, len(stream))
    assert packed.num_dropped == len(stream) % 8
    doc_ends = np.cumsum([len(ids) + 1 for ids in tokenizer.encode_batch(DOCS)]) - 1
    assert [i for i, t in enumerate(stream) if t == tokenizer.eos_id] == doc_ends.tolist()


def test_pack_can_add_bos_and_rejects_useless_lengths(tokenizer):
    packed = data.tokenize_and_pack(DOCS, tokenizer, seq_len=4, add_bos=True, progress=False)
    assert packed.blocks[0, 0] == tokenizer.bos_id
    with pytest.raises(ValueError, match="seq_len must be >= 2"):
        data.tokenize_and_pack(DOCS, tokenizer, seq_len=1, progress=False)
    with pytest.raises(ValueError, match="fewer than one block of seq_len 4096"):
        data.tokenize_and_pack(DOCS, tokenizer, seq_len=4096, progress=False)


def test_tokenizer_sources(tmp_path, tokenizer):
    sp_dir = tmp_path / "sp"
    sp_dir.mkdir()
    shutil.copy(data.default_tokenizer_path(), sp_dir / "tokenizer.model")
    assert data.load_tokenizer(sp_dir).encode_batch(DOCS) == tokenizer.encode_batch(DOCS)

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    word_level = Tokenizer(models.WordLevel({"<unk>": 0, "</s>": 1, "Exit": 2}, unk_token="<unk>"))
    word_level.pre_tokenizer = pre_tokenizers.Whitespace()
    hf = PreTrainedTokenizerFast(tokenizer_object=word_level, eos_token="</s>", unk_token="<unk>")
    hf.save_pretrained(tmp_path / "hf")
    loaded = data.load_tokenizer(tmp_path / "hf")
    assert (loaded.vocab_size, loaded.eos_id, loaded.encode_batch(["Exit x"])) == (3, 1, [[2, 0]])

    (tmp_path / "notes.txt").write_text("not a tokenizer")
    with pytest.raises(ValueError, match="a file must be a sentencepiece .model"):
        data.load_tokenizer(tmp_path / "notes.txt")


# ----------------------------------------------------------------------------- corpus + CLI


def test_inputs_text_dirs_and_jsonl(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.txt").write_text("alpha")
    (tmp_path / "d" / "b.md").write_text("beta")
    (tmp_path / "d" / "skip.bin").write_bytes(b"\0")
    (tmp_path / "c.jsonl").write_text('{"text": "gamma"}\n\n{"text": "delta"}\n')
    files = data.expand_inputs([tmp_path / "d", tmp_path / "c.jsonl"])
    assert list(data.iter_documents(files)) == ["alpha", "beta", "gamma", "delta"]
    (tmp_path / "bad.jsonl").write_text('{"body": "x"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:1: expected an object with a string field"):
        list(data.iter_documents([tmp_path / "bad.jsonl"]))
    with pytest.raises(ValueError, match="no such file or directory"):
        data.expand_inputs([tmp_path / "missing"])


def test_a_saved_hf_dataset_needs_the_optional_datasets_package(tmp_path, monkeypatch):
    find_spec = importlib.util.find_spec  # as on a machine without it
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "datasets" else find_spec(name, *a)
    )
    (tmp_path / "dataset_info.json").write_text("{}")
    with pytest.raises(ValueError, match="needs the `datasets` package"):
        list(data.iter_documents(data.expand_inputs([tmp_path])))


def test_default_corpus_is_the_38_plays():
    files = data.default_corpus_files()
    assert len(files) == 38 and all(f.suffix == ".md" for f in files)


def test_split_holds_out_seeded_random_blocks():
    blocks = np.arange(200).reshape(100, 2)
    train, val = data.split_blocks(blocks, 0.1, seed=0)
    assert (len(train), len(val)) == (90, 10)
    assert sorted(np.concatenate([train, val])[:, 0].tolist()) == blocks[:, 0].tolist()
    assert data.val_path_for("out/train.bin") == Path("out/train.val.bin")


def test_cli_packs_one_play_end_to_end(tmp_path):
    play = next(f for f in data.default_corpus_files() if f.name == "macbeth.md")
    out = tmp_path / "train.bin"
    done = run_prepare_data("--input", str(play), "--seq-len", "64", "--val-fraction", "0.1", "--output", out)
    assert done.returncode == 0, done.stderr
    assert "documents 1 |" in done.stdout
    train = data.PackedDataset(out, expected_seq_len=64, expected_vocab_size=32000)
    val = data.PackedDataset(tmp_path / "train.val.bin", expected_seq_len=64)
    assert len(val) == round(0.1 * (len(train) + len(val)))


def test_cli_rejects_a_zero_seq_len_with_exit_code_2(tmp_path):
    done = run_prepare_data("--seq-len", "0", "--output", str(tmp_path / "x.bin"))
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "prepare_data.py: error: argument --seq-len: must be an integer >= 2, got '0'"
    ]


# ----------------------------------------------------------------------------- NxD's way


def test_sequential_order_deals_blocks_as_distributed_sampler_does(hundred_blocks):
    """shuffle=False: rank r's micro-batches in the first epoch are DistributedSampler(shuffle=
    False, drop_last=True)'s list for rank r, cut into micro-batches of 2; the step takes blocks
    [24 s, 24 (s + 1)) of the file, and the next epoch starts over at block 0."""
    from torch.utils.data.distributed import DistributedSampler

    steps = _run(hundred_blocks, steps=5, shuffle=False)  # 4 steps per epoch of 100 blocks
    for rank in range(4):
        sampler = list(DistributedSampler(range(100), num_replicas=4, rank=rank, shuffle=False, drop_last=True))
        assert [b for step in steps[:4] for b in step[rank]] == sampler[: 4 * 6]
    assert sorted(b for rank in steps[1] for b in rank) == list(range(24, 48))
    assert steps[4] == steps[0]  # epoch 2 = epoch 1
    it = data.DataParallelBatches(hundred_blocks, 2, 0, 4, seed=0, grad_accum=3, shuffle=False)
    shuffled = data.DataParallelBatches(hundred_blocks, 2, 0, 4, seed=0, grad_accum=3)
    with pytest.raises(ValueError, match="shuffle is 1 now, checkpoint has 0"):
        shuffled.load_state_dict(it.state_dict())


def test_pack_with_bos_separator_puts_bos_before_each_document_and_no_eos(tokenizer):
    """NxD's (the HF Llama tokenizer's) packing: <s> doc1 <s> doc2 ..., no </s> anywhere."""
    packed = data.tokenize_and_pack(DOCS, tokenizer, seq_len=8, separator="bos", progress=False)
    stream = [t for ids in tokenizer.encode_batch(DOCS) for t in [tokenizer.bos_id] + ids]
    assert packed.blocks.ravel().tolist() == stream[: packed.blocks.size]
    assert packed.num_tokens == len(stream) and tokenizer.eos_id not in stream
    doc_starts = np.cumsum([0] + [len(ids) + 1 for ids in tokenizer.encode_batch(DOCS)])[:-1]
    assert [i for i, t in enumerate(stream) if t == tokenizer.bos_id] == doc_starts.tolist()
    with pytest.raises(ValueError, match="separator must be one of"):
        data.tokenize_and_pack(DOCS, tokenizer, seq_len=8, separator="newline", progress=False)


def _tokenized_dataset(path: Path, rows: list[list[int]]) -> Path:
    """A saved dataset shaped like NxD's wikicorpus_llama2_tokenized_4k (input_ids, attention_mask, labels)."""
    import datasets

    masks = [[1] * len(r) for r in rows]
    datasets.Dataset.from_dict({"input_ids": rows, "attention_mask": masks, "labels": rows}).save_to_disk(str(path))
    return path


def test_cli_packs_an_already_tokenized_dataset_as_it_is(tmp_path):
    rows = np.random.default_rng(0).integers(0, 100, size=(6, 8)).tolist()
    src = _tokenized_dataset(tmp_path / "tok", rows)
    done = run_prepare_data("--input", src, "--seq-len", "8", "--vocab-size", "100", "--output", tmp_path / "train.bin")
    assert done.returncode == 0, done.stderr
    packed = data.PackedDataset(tmp_path / "train.bin", expected_seq_len=8, expected_vocab_size=100)
    assert packed.get_blocks(list(range(6))).tolist() == rows  # same ids, same order, no separators


def test_cli_refuses_tokenized_rows_of_another_length_or_outside_the_vocab(tmp_path):
    src = _tokenized_dataset(tmp_path / "tok", [[1, 2, 3, 4], [5, 6, 7, 99]])
    out = ["--output", tmp_path / "train.bin"]
    cases = {
        ("--seq-len", "8", "--vocab-size", "100"): "row 0 has 4 tokens, not --seq-len 8",
        ("--seq-len", "4", "--vocab-size", "99"): "row 1 has id 99 outside the vocabulary [0, 99)",
        ("--seq-len", "4"): "already tokenized: pass --vocab-size",
    }
    for args, message in cases.items():
        done = run_prepare_data("--input", src, *args, *out)
        assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
        assert message in done.stderr, done.stderr
    assert not (tmp_path / "train.bin").exists()
