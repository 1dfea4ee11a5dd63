"""transformers checkpoint directories: per-rank sliced loading, layer-by-layer export, host memory.

* ``save_pretrained`` (tiny GQA Llama, 4 heads / 2 kv heads, untied, sharded small) loads into our
  model at TP 1, 2 and 4 and gives transformers' logits;
* our model exported at TP 2 and TP 4 (kv heads 2 < 4: replicated kv heads gathered once) loads
  with ``transformers.LlamaForCausalLM.from_pretrained`` and gives our logits; an export loaded at
  another TP degree gives back exactly the exporting model's parameters;
* a rank's peak host memory while loading a >= 200 MB checkpoint at TP 2, in fresh processes,
  against the old full-state-dict path;
* errors: missing/unexpected keys, shapes, config.json mismatch (all before a parameter is
  written), unwritable export directory (before any gather), a write failing on rank 0 (raised
  on every rank); a torch ``.bin`` file loads too; an export replaces an older one.

Tolerance (``TOL``, relative to the largest logit): fp32 and the same weights on both sides; the
only differences are the summation order of the row-parallel all-reduces and of the TP-split
matmuls (measured: 0 at TP 1, 2.7e-7 at TP 2 and 4, i.e. a few fp32 ulps through 2 layers).
``1e-5`` is ``tests/test_llama.py``'s bound for the same model: a wrong slice or kv-head mapping
gives errors of order 1.
"""

from __future__ import annotations

import gc
import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers

import neuron_ckpt as nc
from neuron_ckpt.distributed.local import run_local
from neuron_ckpt.models import (
    LlamaForCausalLM,
    check_writable,
    hf_config_for,
    load_hf_checkpoint,
    save_hf_checkpoint,
)

from .helpers import TINY, patched, rel_max, tiny_config

WORLD = 4
VOCAB, SEQ, BATCH = TINY["vocab_size"], 16, 2
TOL = 1e-5
SHARD = "40KB"  # the tiny model is ~310 KB: several shards


def ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))


def hf_logits(directory: Path) -> torch.Tensor:
    model = transformers.LlamaForCausalLM.from_pretrained(directory, attn_implementation="eager")
    with torch.no_grad():
        return model(input_ids=ids()).logits


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> tuple[Path, torch.Tensor]:
    """A ``save_pretrained`` directory of a random tiny Llama (non-trivial norms) and its logits."""
    path = tmp_path_factory.mktemp("hf") / "tiny"
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(tiny_config()).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
        logits = model(input_ids=ids()).logits
    model.save_pretrained(path, max_shard_size=SHARD)
    assert len(list(path.glob("model-*-of-*.safetensors"))) > 2
    return path, logits


# --- load / export / round trip, one worker call per TP degree ---------------------------------------


def _case(t: int, hf_dir: str, export_to: str | None, reload: str | None) -> dict:
    nc.initialize_model_parallel(t)
    config = hf_config_for(hf_dir)  # read from config.json
    torch.manual_seed(123)  # a different init: the load must overwrite every parameter
    model = LlamaForCausalLM(config)
    load_hf_checkpoint(model, hf_dir)
    out = {"loaded": model(ids(), return_logits="full").logits.detach()}
    if export_to:
        torch.manual_seed(7)
        mine = LlamaForCausalLM(config)  # our own weights, exported
        out["written"] = save_hf_checkpoint(mine, export_to, config, max_shard_size=SHARD)
        out["exported_logits"] = mine(ids(), return_logits="full").logits.detach()
        out["exported_sd"] = mine.hf_state_dict()
    if reload:
        model = LlamaForCausalLM(config)
        load_hf_checkpoint(model, reload)
        out["reloaded_sd"] = model.hf_state_dict()
    return out


@pytest.fixture(scope="module")
def results(world, hf_dir, tmp_path_factory) -> dict:
    src = str(hf_dir[0])
    out = tmp_path_factory.mktemp("export")
    exp = {t: str(out / f"tp{t}") for t in (2, 4)}
    return {
        "exports": exp,
        2: world(WORLD).run(_case, 2, src, exp[2], None),
        4: world(WORLD).run(_case, 4, src, exp[4], exp[2]),  # export at TP 2 -> load at TP 4
        1: world(WORLD).run(_case, 1, src, None, exp[4]),  # export at TP 4 -> load at TP 1
    }


@pytest.mark.parametrize("t", [1, 2, 4])
def test_save_pretrained_loads_at_any_tp(results, hf_dir, t):
    for rank_out in results[t]:
        assert rel_max(rank_out["loaded"], hf_dir[1]) < TOL


@pytest.mark.parametrize("t", [2, 4])
def test_export_loads_in_transformers(results, t):
    directory = Path(results["exports"][t])
    assert [r["written"] for r in results[t]] == [directory] + [None] * (WORLD - 1)  # rank 0 writes
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in directory.glob("model-*-of-*.safetensors"))
    assert len(shards) > 2 and sorted(set(index["weight_map"].values())) == shards
    sd = results[t][0]["exported_sd"]
    assert set(index["weight_map"]) == set(sd)
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in sd.values())
    assert json.loads((directory / "config.json").read_text())["dtype"] == "float32"
    assert not [p for p in directory.parent.iterdir() if p.name.startswith(".")]  # no temp dirs left
    assert rel_max(hf_logits(directory), results[t][0]["exported_logits"]) < TOL


@pytest.mark.parametrize("t, source", [(4, 2), (1, 4)])
def test_export_round_trips_at_another_tp(results, t, source):
    exported = results[source][0]["exported_sd"]
    for rank_out in results[t]:
        got = rank_out["reloaded_sd"]
        assert set(got) == set(exported) and all(torch.equal(got[k], exported[k]) for k in exported)


# --- errors --------------------------------------------------------------------------------------------


def _errors(files: dict[str, str]) -> dict:
    from neuron_ckpt.models import hf_conversion

    nc.initialize_model_parallel(2)
    model = LlamaForCausalLM(tiny_config())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    out = {}
    for case in ("missing", "shape", "config"):
        try:
            load_hf_checkpoint(model, files[case])
            out[case] = None
        except (KeyError, ValueError) as e:
            out[case] = f"{type(e).__name__}: {e}"
    try:
        hf_config_for(files["config"], tiny_config())
    except ValueError as e:
        out["config_for"] = str(e)
    out["untouched"] = all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    load_hf_checkpoint(model, files["bin"])  # a torch file (memory-mapped) loads like safetensors
    from_bin = model.hf_state_dict()
    load_hf_checkpoint(model, files["dir"])
    out["bin_equal"] = all(torch.equal(v, from_bin[k]) for k, v in model.hf_state_dict().items())

    gathers = []
    real_gather = hf_conversion.gather
    with patched(hf_conversion, "gather", lambda *a: gathers.append(1) or real_gather(*a)):
        try:
            save_hf_checkpoint(model, files["unwritable"])
        except OSError as e:
            out["unwritable"] = str(e)
    out["gathers"] = len(gathers)
    try:
        check_writable(files["unwritable"])
    except OSError as e:
        out["check_writable"] = str(e)

    from neuron_ckpt.models import hf_export

    with patched(hf_export, "_save_shard", lambda *a: (_ for _ in ()).throw(OSError(28, "No space left on device"))):
        try:
            save_hf_checkpoint(model, files["export"])  # rank 0 fails mid-way: every rank raises, none hangs
        except OSError as e:
            out["write_failed"] = str(e)
    for _ in range(2):  # written, then replaced
        save_hf_checkpoint(model, files["export"], max_shard_size=SHARD)
    return out


def test_clear_errors_before_anything_is_written(world, hf_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    src = hf_dir[0]
    sd = {}
    for f in sorted(src.glob("*.safetensors")):
        sd.update(load_file(f))
    missing = dict(sd, **{"model.layers.2.mlp.down_proj.weight": torch.zeros(1)})
    del missing["model.layers.1.mlp.down_proj.weight"]
    save_file(missing, tmp_path / "missing.safetensors")
    bad_shape = dict(sd, **{"model.layers.0.self_attn.k_proj.weight": torch.zeros(64, 64)})
    save_file(bad_shape, tmp_path / "shape.safetensors")
    shutil.copytree(src, tmp_path / "config")
    config = json.loads((src / "config.json").read_text())
    config.update(rms_norm_eps=1e-6, rope_parameters={"rope_theta": 500000.0, "rope_type": "default"})
    (tmp_path / "config" / "config.json").write_text(json.dumps(config))
    (tmp_path / "a_file").write_text("not a directory")
    files = {case: str(tmp_path / f"{case}.safetensors") for case in ("missing", "shape")}
    files.update(config=str(tmp_path / "config"), unwritable=str(tmp_path / "a_file" / "export"))
    torch.save(sd, tmp_path / "pytorch_model.bin")
    files.update(bin=str(tmp_path / "pytorch_model.bin"), dir=str(src), export=str(tmp_path / "out" / "export"))

    for out in world(2).run(_errors, files):
        assert out["missing"].startswith("KeyError")
        assert "model.layers.1.mlp.down_proj.weight" in out["missing"]  # missing
        assert "model.layers.2.mlp.down_proj.weight" in out["missing"]  # unexpected
        assert "k_proj.weight" in out["shape"] and "(64, 64)" in out["shape"] and "(32, 64)" in out["shape"]
        for message in (out["config"], out["config_for"]):
            assert "rms_norm_eps: model config 1e-05" in message and "1e-06" in message
            assert "rope_parameters: model config {'rope_theta': 10000.0}" in message  # the entries that differ
            assert "{'rope_theta': 500000.0}" in message and "rope_type" not in message
            assert "hidden_size" not in message
        assert out["untouched"] and out["bin_equal"]
        assert "a_file" in out["unwritable"] and out["gathers"] == 0  # refused before any gather
        assert "a_file" in out["check_writable"]
        assert "No space left on device" in out["write_failed"]
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["export"]  # no temp or old directories left
    assert (tmp_path / "out" / "export" / "model.safetensors.index.json").is_file()


# --- host memory -------------------------------------------------------------------------------------

BIG = dict(
    vocab_size=8192, hidden_size=1024, intermediate_size=2816, num_hidden_layers=6,
    num_attention_heads=16, num_key_value_heads=4, tie_word_embeddings=False, max_position_embeddings=256,
)  # fmt: skip
MIB = 2**20
EXPORT_SHARD = 64 * MIB  # the export's max_shard_size in the memory test
SLACK = 24 * MIB  # allocator and interpreter noise around a measured window (observed: < 4 MiB)


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _peak_delta(fn) -> int:
    """Peak resident bytes (anonymous + mapped file pages: VmHWM) during ``fn()`` above the RSS
    before it. The high-water mark is reset first (``/proc/self/clear_refs`` 5), so what the
    process allocated earlier (model init draws full tensors) does not hide the window."""
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")
    base = _status("VmRSS")
    fn()
    return _status("VmHWM") - base


def _measure(directory: str) -> dict:
    from safetensors.torch import load_file

    state = nc.initialize_model_parallel(2)
    config = transformers.LlamaConfig(**BIG)
    model = LlamaForCausalLM(config, parallel_state=state)
    new = _peak_delta(lambda: load_hf_checkpoint(model, directory))
    check = model.lm_head.weight[0, :4].detach().clone()

    def old():
        sd = load_file(str(Path(directory) / "model.safetensors"))
        model.load_hf_state_dict(sd)
        del sd

    old_peak = _peak_delta(old)
    export = _peak_delta(
        lambda: save_hf_checkpoint(model, Path(directory).parent / "export", max_shard_size=EXPORT_SHARD)
    )
    shard = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"new": new, "old": old_peak, "export": export, "shard": shard, "check": check}


def test_loading_peak_host_memory_is_one_tensor_not_the_checkpoint(tmp_path, monkeypatch):
    """Peak host bytes of a TP-2 rank while loading (and exporting) a 320 MiB fp32 checkpoint.

    The workers run with a fixed glibc mmap threshold (1 MiB): by default glibc raises it up to
    32 MiB after large frees and keeps freed heap chunks resident, so the high-water mark would
    also count memory this code already freed (the export's per-layer tensors of 4-11 MiB here;
    a 7B model's are >= 32 MiB and mmapped anyway). The measure then is live bytes.
    """
    from safetensors.torch import save_file

    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError as e:
        pytest.skip(f"cannot reset the peak RSS on this system ({e})")
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", str(2**20))  # read by the spawned workers' glibc

    config = transformers.LlamaConfig(**BIG)
    torch.manual_seed(0)
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in transformers.LlamaForCausalLM(config).state_dict().items()}
    sd = {k: torch.randn(s) for k, s in shapes.items()}
    full = sum(v.numel() * 4 for v in sd.values())
    largest = max(v.numel() * 4 for v in sd.values())
    layer = sum(v.numel() * 4 for k, v in sd.items() if k.startswith("model.layers.0."))
    assert full >= 200e6
    directory = tmp_path / "big"
    directory.mkdir()
    save_file(sd, directory / "model.safetensors", metadata={"format": "pt"})
    config.save_pretrained(directory)
    lm_head = sd["lm_head.weight"]
    del sd
    gc.collect()

    r0, r1 = run_local(_measure, 2, str(directory))  # fresh processes: nothing else in them
    assert torch.equal(r0["check"], lm_head[0, :4]) and torch.equal(r1["check"], lm_head[BIG["vocab_size"] // 2, :4])
    print(
        f"\nTP 2 load of a {full / MIB:.0f} MiB checkpoint (largest tensor {largest / MIB:.0f} MiB, a layer "
        f"{layer / MIB:.0f} MiB, rank shard {r0['shard'] / MIB:.0f} MiB), peak host bytes above the "
        f"baseline, ranks 0/1: load_hf_checkpoint {r0['new'] / MIB:.0f}/{r1['new'] / MIB:.0f} MiB; old "
        f"load_file + load_hf_state_dict {r0['old'] / MIB:.0f}/{r1['old'] / MIB:.0f} MiB (mapped file pages); "
        f"save_hf_checkpoint {r0['export'] / MIB:.0f}/{r1['export'] / MIB:.0f} MiB"
    )
    for r in (r0, r1):
        # One tensor's file pages (a row-parallel slice maps all of its tensor) + at most one slice copy.
        assert r["new"] <= r["shard"] + largest + SLACK
        assert r["new"] <= 2 * largest + SLACK
        assert r["new"] < full / 4
    # Rank 0 collects one shard on the host before writing it, beside one gathered layer (or the
    # embedding / LM head); rank 1 is in rank 0's TP group here, so it gathers too and drops the
    # result. The old hf_state_dict held the whole model on every rank.
    assert r0["export"] <= EXPORT_SHARD + layer + largest + SLACK
    assert r1["export"] <= layer + largest + SLACK
    assert r0["export"] < full / 2


# --- tied embeddings (Llama-3.2 style): saved and loaded as transformers does --------------------


def _tied_export(t: int, src: str, dst: str) -> dict:
    nc.initialize_model_parallel(t)
    config = hf_config_for(src)
    model = LlamaForCausalLM(config)
    load_hf_checkpoint(model, src)  # a save_pretrained file without lm_head.weight
    out = {
        "loaded": model(ids(), return_logits="full").logits.detach(),
        "tied": model.lm_head.weight is model.embed_tokens.weight,
    }
    with torch.no_grad():
        model.embed_tokens.weight.add_(0.01)  # our own weights now: the export must carry them
    out["ours"] = model(ids(), return_logits="full").logits.detach()
    save_hf_checkpoint(model, dst, config, max_shard_size=SHARD)
    return out


def test_tied_checkpoint_round_trips_through_transformers(world, tmp_path):
    """A tied save_pretrained directory (no lm_head.weight) loads at TP 1 and 2 with transformers'
    logits; our export writes no lm_head.weight either, and from_pretrained gives our logits."""
    from safetensors import safe_open

    config = tiny_config(tie_word_embeddings=True)
    torch.manual_seed(0)
    ref = transformers.LlamaForCausalLM(config).float()
    src = tmp_path / "tied"
    ref.save_pretrained(src)
    keys = set(safe_open(str(src / "model.safetensors"), framework="pt").keys())
    assert "lm_head.weight" not in keys and "model.embed_tokens.weight" in keys  # transformers' layout
    with torch.no_grad():
        want = ref(input_ids=ids()).logits
    for t in (1, 2):
        dst = tmp_path / f"export{t}"
        for r in world(2).run(_tied_export, t, str(src), str(dst)):
            assert r["tied"] and rel_max(r["loaded"], want) < TOL
        written = set().union(*(safe_open(str(f), framework="pt").keys() for f in dst.glob("*.safetensors")))
        assert written == keys, written ^ keys
        assert json.loads((dst / "config.json").read_text())["tie_word_embeddings"] is True
        back = transformers.LlamaForCausalLM.from_pretrained(dst, attn_implementation="eager")
        assert back.lm_head.weight.data_ptr() == back.model.embed_tokens.weight.data_ptr()
        with torch.no_grad():
            assert rel_max(back(input_ids=ids()).logits, r["ours"]) < TOL


def test_tied_and_untied_checkpoints_do_not_mix(tmp_path):
    """The model config and config.json must agree on tie_word_embeddings (it changes the model)."""
    from neuron_ckpt.models import check_hf_config

    tied = tiny_config(tie_word_embeddings=True)
    with pytest.raises(ValueError, match="tie_word_embeddings: model config True"):
        check_hf_config(tied, tiny_config())
