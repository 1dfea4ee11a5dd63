"""Activation offload (issue 48): ``RecomputeConfig(offload_modules=[...])`` sends what those modules
keep for backward to host and brings it back, and the gradients are those without offload, bit for
bit, whatever the copies' timing.

The copies run on :class:`tests.deferred_copies.DeferredCopies`: nothing is copied until something
waits for it, and whatever is read too early (a host buffer before its copy, a reload before it
ran, a source the engine let go) reads 0xFF bytes, NaN. A missing ordering edge therefore fails
these tests every time, not once in a while on a GPU; ``MissingEdge`` drops each edge to show it.
"""

from __future__ import annotations

import sys

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

import neuron_ckpt as nc
from neuron_ckpt.memory import SavedTensorRecorder
from neuron_ckpt.models.llama import LlamaForCausalLM
from neuron_ckpt.models.llama_args import LlamaArgs
from neuron_ckpt.recompute import RecomputeConfig, apply_recompute, remove_recompute
from neuron_ckpt.recompute.offload import SyncCopies, copies_override, offload_stats
from neuron_ckpt.recompute.offload.engine import HostCopy, LayerRun, Offloader

from .deferred_copies import DeferredCopies, MissingEdge

H, F, HEADS, S, LAYERS = 32, 48, 4, 16, 3


def _args(dropout: float = 0.1) -> LlamaArgs:
    return LlamaArgs(vocab_size=64, hidden_size=H, intermediate_size=F, num_hidden_layers=LAYERS,
                     num_attention_heads=HEADS, num_key_value_heads=2, max_position_embeddings=S,
                     attention_dropout=dropout)  # fmt: skip


def _model(config, t: int = 1, sp: bool = False) -> LlamaForCausalLM:
    state = nc.initialize_model_parallel(t)
    torch.manual_seed(0)
    model = LlamaForCausalLM(_args(), sequence_parallel=sp, parallel_state=state)
    if config is not None:
        apply_recompute(model, config)
    return model


def _step(model, copies=None, seed: int = 3, backwards: int = 1):
    """Loss and every gradient of one step (attention dropout on: the masks must come back too)."""
    ids = torch.randint(0, 64, (2, S), generator=torch.Generator().manual_seed(1))
    nc.model_parallel_manual_seed(seed)
    with copies_override(copies) if copies is not None else _nothing():
        loss = model(ids, labels=ids).loss
    for i in range(backwards):
        loss.backward(retain_graph=i < backwards - 1)
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return None


def _identical(a, b, label: str = "") -> None:
    assert torch.equal(a[0], b[0]), f"{label}: loss {a[0]} != {b[0]}"
    for i, (x, y) in enumerate(zip(a[1], b[1])):
        assert torch.equal(x, y), f"{label}: gradient {i} differs (nan: {y.isnan().any().item()})"


SELECTIVE = dict(granularity="selective", modules=["core_attn", "mlp_act", "norm"])
FULL = dict(granularity="full", method="uniform", num_layers=1)
CASES = {  # name: (recompute, offload_modules)
    "mlp, no recompute": ({}, ["mlp"]),
    "core_attn + norm, no recompute": ({}, ["core_attn", "norm"]),
    "layer, no recompute": ({}, ["layer"]),
    "selective (discarding), offload core_attn + mlp + norm": (SELECTIVE, ["core_attn", "mlp", "norm"]),
    "selective (discarding), offload layer": (SELECTIVE, ["layer"]),
    "selective mlp, offload mlp (its checkpoint's input)": (dict(granularity="selective", modules=["mlp"]), ["mlp"]),
    "full, offload layer (its input)": (FULL, ["layer"]),
    "full reentrant, offload layer": (dict(FULL, use_reentrant=True), ["layer"]),
}


# ---------------------------------------------------------------------------------------------
# The vocabulary: what RecomputeConfig takes and refuses.


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(offload_modules="mlp"), "got the string"),
        (dict(offload_modules=["attention"]), "unknown module 'attention'; offloadable modules"),
        (dict(offload_modules=["moe_act"]), "'moe_act' is a function inside a module"),
        (dict(offload_modules=["layer", "mlp"]), "list it alone"),
        (dict(FULL, offload_modules=["core_attn"]), "only 'layer'"),
        (dict(granularity="full", method="uniform", num_layers=2, offload_modules=["layer"]), "one layer per"),
    ],
)
def test_config_refuses_in_one_line(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RecomputeConfig(**kwargs)


def test_config_names_are_canonical_and_offload_alone_is_not_recompute():
    config = RecomputeConfig(offload_modules=["layernorm", "mlp", "mlp"])
    assert config.offload_modules == ("norm", "mlp") and not config.enabled
    assert RecomputeConfig("selective", offload_modules=["core_attn"]).preset_name == "selective"


def test_refused_on_xla(monkeypatch):
    monkeypatch.setattr("neuron_ckpt.distributed.runtime.is_xla", lambda: True)
    with pytest.raises(ValueError, match="not supported on XLA"):
        RecomputeConfig(offload_modules=["mlp"]).validate(2)


def test_a_module_inside_a_recomputed_one_is_refused_before_the_model_changes():
    model = _model(None)
    before = repr(model)
    inside = r"'mlp_act' \('mlp.act_fn' in layer 0\) lies inside 'mlp', which is recomputed"
    with pytest.raises(ValueError, match=inside):
        apply_recompute(model, RecomputeConfig("selective", modules=["mlp"], offload_modules=["mlp_act"]))
    with pytest.raises(ValueError, match="offload_modules: 'moe' matched no submodule"):
        apply_recompute(model, RecomputeConfig(offload_modules=["moe"]))
    assert repr(model) == before


# ---------------------------------------------------------------------------------------------
# The engine: one copy per storage, views restored, what stays on the device.


def test_views_and_a_storage_saved_twice_cross_once_and_return_as_views_of_one_storage():
    offloader = Offloader(lambda device: SyncCopies())
    run = LayerRun(0, None, set())
    base = torch.randn(6, 8)
    views = [base, base[1:4, ::2], base.t(), base.view(48)[5:20]]
    handles = [offloader.pack(v, run, "0.x") for v in views]
    assert offloader.stats.copies == 1 and offloader.stats.bytes == {"0.x": 6 * 8 * 4}
    back = [h.tensor() for h in handles]
    for v, b in zip(views, back):
        assert torch.equal(v, b) and b.stride() == v.stride() and b.storage_offset() == v.storage_offset()
    assert len({b.untyped_storage().data_ptr() for b in back}) == 1
    assert offloader.stats.reloads == 1
    base.add_(1)  # written in place, then saved again: a new copy (the old one is what autograd saw)
    assert torch.equal(offloader.pack(base, run, "0.x").tensor(), base) and offloader.stats.copies == 2


def test_parameters_leaves_buffers_and_empty_tensors_stay_where_they_are():
    offloader = Offloader(lambda device: SyncCopies())
    weight = torch.nn.Parameter(torch.randn(4, 4))
    buffer = torch.randn(4)
    run = LayerRun(0, None, {buffer.untyped_storage().data_ptr()})
    for t in (weight, weight.t(), torch.randn(3, requires_grad=True), buffer, buffer[1:], torch.empty(0)):
        assert offloader.pack(t, run, "0.x") is None
    assert offloader.pack(torch.randn(3), run, "0.x") is not None


# ---------------------------------------------------------------------------------------------
# Our Llama: bit-identical gradients whatever the copies' timing.


@pytest.mark.parametrize("case", list(CASES))
def test_llama_gradients_are_bit_identical_with_offload(case):
    recompute, offloaded = CASES[case]
    reference = _step(_model(RecomputeConfig(**recompute)))
    model = _model(RecomputeConfig(**recompute, offload_modules=offloaded))
    copies = DeferredCopies()
    _identical(reference, _step(model, copies), case)
    stats = offload_stats(model)
    assert stats.copies > 0 and stats.reloads == stats.copies and copies.freed_reads == 0
    assert stats.prefetched == stats.reloads  # every layer's reloads started before its backward


@pytest.mark.parametrize("edge", ["b", "c", "d"])
def test_each_missing_ordering_edge_gives_wrong_gradients(edge, monkeypatch):
    recompute, offloaded = CASES["selective (discarding), offload core_attn + mlp + norm"]
    reference = _step(_model(RecomputeConfig(**recompute)))
    config = RecomputeConfig(**recompute, offload_modules=offloaded)
    if edge == "b":
        # Edge b holds twice: before a reload the engine lets go of the device storage, which waits
        # for its copy to host. With that taken away, the reload's own edge alone keeps it right...
        monkeypatch.setattr(HostCopy, "release", lambda self, stats, force: False)
        _identical(reference, _step(_model(config), DeferredCopies()))
    got = _step(_model(config), MissingEdge(edge))  # ... and without it, it reads an unwritten host buffer
    assert not all(torch.equal(x, y) for x, y in zip(reference[1], got[1]))


def test_reloads_at_the_moment_of_use_are_as_correct_as_prefetched_ones(monkeypatch):
    monkeypatch.setattr("neuron_ckpt.recompute.offload.hooks._prefetch", lambda *args: None)
    reference = _step(_model(None))
    model = _model(RecomputeConfig(offload_modules=["core_attn", "mlp"]))
    _identical(reference, _step(model, DeferredCopies()))
    assert offload_stats(model).prefetched == 0 and offload_stats(model).reloads > 0


def test_two_backwards_with_retain_graph_reload_twice_and_match():
    reference = _step(_model(None), backwards=2)
    model = _model(RecomputeConfig(offload_modules=["layer"]))
    _identical(reference, _step(model, DeferredCopies(), backwards=2))
    assert offload_stats(model).reloads == 2 * offload_stats(model).copies


def test_the_last_layer_is_left_alone_unless_a_per_layer_list_asks():
    names = apply_recompute(_model(None), RecomputeConfig(offload_modules=["mlp"]))
    assert names == ["0.mlp (offload)", "1.mlp (offload)"]
    per_layer = [None, RecomputeConfig.preset("selective"), RecomputeConfig(offload_modules=["mlp"])]
    names = apply_recompute(_model(None), per_layer)
    assert names == ["1.self_attn.core_attn", "2.mlp (offload)"]
    reference = _step(_model(None))
    _identical(reference, _step(_model(per_layer), DeferredCopies()))


def test_eval_and_no_grad_passes_copy_nothing_and_change_nothing():
    model = _model(RecomputeConfig(offload_modules=["mlp"]))
    reference = _step(_model(None))
    ids = torch.randint(0, 64, (2, S), generator=torch.Generator().manual_seed(9))
    _step(model, DeferredCopies())
    stats = offload_stats(model)
    stats.reset()
    model.eval()
    model(ids, labels=ids).loss.backward()  # eval with grad: dropout off, nothing offloaded
    model.zero_grad(set_to_none=True)
    model.train()
    with torch.no_grad():
        model(ids, labels=ids)
    assert stats.copies == 0
    _identical(reference, _step(model, DeferredCopies()))


def test_offloaded_storages_leave_the_device_and_the_recorder_sees_the_rest():
    """The sources' storages are freed once the forward is done (nothing else holds them), and a
    SavedTensorRecorder outside sees exactly what stayed: its total drops by the offloaded bytes."""

    class Watching(SyncCopies):
        def __init__(self):
            self.sources: list[StorageWeakRef] = []

        def offload(self, source):
            self.sources.append(StorageWeakRef(source.untyped_storage()))
            return super().offload(source)

    def kept(config, copies=None):
        model = _model(config)
        ids = torch.randint(0, 64, (2, S), generator=torch.Generator().manual_seed(1))
        with SavedTensorRecorder(exclude_modules=[model]) as rec, copies_override(copies or SyncCopies()):
            loss = model(ids, labels=ids).loss  # noqa: F841  the graph alive at exit: what backward finds
        return rec.total_bytes, model

    watching = Watching()
    without, _ = kept(None)
    with_offload, model = kept(RecomputeConfig(offload_modules=["core_attn", "mlp"]), watching)
    stats = offload_stats(model)
    assert without - with_offload == stats.total_bytes > 0
    assert watching.sources and all(ref.expired() for ref in watching.sources)


def test_at_most_two_offloading_layers_hold_device_storages_for_their_copies():
    """Copies never done until waited for: when layer 2 starts, layer 0's storages are let go after
    the compute stream waits for their copies (settled); layer 1's stay held until backward."""

    class Watching(DeferredCopies):
        def __init__(self):
            super().__init__()
            self.sources: list[StorageWeakRef] = []

        def offload(self, source):
            self.sources.append(StorageWeakRef(source.untyped_storage()))
            return super().offload(source)

    model = _model(RecomputeConfig(offload_modules=["core_attn", "mlp"]))
    stats = offload_stats(model)
    first: list[int] = []
    model.layers[1].register_forward_pre_hook(lambda *_: first.append(stats.copies))
    watching = Watching()
    ids = torch.randint(0, 64, (2, S), generator=torch.Generator().manual_seed(1))
    nc.model_parallel_manual_seed(3)
    with copies_override(watching):
        loss = model(ids, labels=ids).loss
    n0 = first[0]
    assert 0 < n0 < stats.copies and stats.settled == n0 and watching.waits == n0
    assert all(ref.expired() for ref in watching.sources[:n0])
    assert not any(ref.expired() for ref in watching.sources[n0:])
    loss.backward()
    assert all(ref.expired() for ref in watching.sources) and watching.freed_reads == 0


def test_print_shows_what_is_offloaded_and_remove_takes_it_off():
    model = _model(RecomputeConfig("selective", modules=["core_attn"], offload_modules=["core_attn", "mlp"]))
    keys = set(model.state_dict())
    text = repr(model)
    assert "Recompute[CoreAttention](selective; offload: what it keeps goes to host;" in text
    assert "LlamaMLP(\n        offload: what it keeps goes to host" in text
    assert "(0-1): 2 x LlamaDecoderLayer(" in text and text.count("offload:") == 2  # not the last layer
    remove_recompute(model)
    assert "offload" not in repr(model) and set(model.state_dict()) == keys
    with pytest.raises(ValueError, match="offloads nothing"):
        offload_stats(model)
    _identical(_step(_model(None)), _step(model))


# ---------------------------------------------------------------------------------------------
# transformers models: the attention function offloaded through the attention registry.


def test_transformers_llama_offloads_its_attention_function_bit_exact():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, attention_dropout=0.1, use_cache=False,
    )  # fmt: skip
    config._attn_implementation = "eager"

    def step(recompute):
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config).train()
        names = apply_recompute(model, recompute) if recompute is not None else []
        ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
        torch.manual_seed(2)
        with copies_override(DeferredCopies()):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return names, model, (loss.detach(), [p.grad for p in model.parameters()])

    _, _, reference = step(None)
    for recompute in (RecomputeConfig(offload_modules=["core_attn", "mlp"]),
                      RecomputeConfig("selective", offload_modules=["core_attn"])):  # fmt: skip
        names, model, got = step(recompute)
        _identical(reference, got, str(recompute))
        assert "0.core_attn (offload)" in names and "2.core_attn (offload)" not in names
        assert offload_stats(model).bytes.get("0.core_attn", 0) > 0
        assert "offload core_attn: what it keeps goes to host" in repr(model)
        remove_recompute(model)
        assert model.config._attn_implementation == "eager"


@pytest.mark.parametrize(
    "recompute",
    [
        RecomputeConfig(offload_modules=["moe"]),
        RecomputeConfig(offload_modules=["shared_experts", "norm"]),
        RecomputeConfig("selective", modules=["moe"], offload_modules=["moe"]),
    ],  # fmt: skip
    ids=["moe", "shared_experts + norm", "moe recomputed and offloaded"],
)
def test_transformers_moe_blocks_offload_bit_exact(recompute):
    pytest.importorskip("transformers")
    from .test_hf_moe_recompute import assert_equal, reference, step, tiny

    model = tiny("qwen2_moe")
    apply_recompute(model, recompute)
    with copies_override(DeferredCopies()):
        got = step(model)
    assert_equal(got, reference("qwen2_moe", "grouped_mm"))
    assert offload_stats(model).total_bytes > 0 and offload_stats(model).reloads == offload_stats(model).copies


# ---------------------------------------------------------------------------------------------
# TP 2 + sequence parallel (gloo, world 2): selective and full recompute.


def _tp2_steps() -> dict:
    out = {}
    for name in ("selective (discarding), offload core_attn + mlp + norm", "full, offload layer (its input)"):
        recompute, offloaded = CASES[name]
        reference = _step(_model(RecomputeConfig(**recompute), t=2, sp=True))
        got = _step(_model(RecomputeConfig(**recompute, offload_modules=offloaded), t=2, sp=True), DeferredCopies())
        out[name] = (reference, got)
    return out


def test_tp2_sequence_parallel_bit_identical(world):
    for rank, cases in enumerate(world(2).run(_tp2_steps)):
        for name, (reference, got) in cases.items():
            _identical(reference, got, f"rank {rank}: {name}")


# ---------------------------------------------------------------------------------------------
# The tutorial: train.py --offload-modules.


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        (dict(offload_modules="mlp,atn"), "--offload-modules mlp,atn: offload_modules: unknown module 'atn'"),
        (dict(recompute="full", offload_modules="mlp"), "only 'layer'"),
        (dict(recompute="auto", device_memory="trn1", offload_modules="mlp"), "does not combine with --recompute auto"),
        (dict(compile=True, offload_modules="mlp"), "does not combine with --compile"),
        (dict(backend="xla", offload_modules="mlp"), "does not combine with --backend xla"),
    ],
)
def test_train_config_refuses_in_one_line(kwargs, needle):
    from .tutorial_run import train_module

    with pytest.raises(ValueError) as exc:
        train_module().TrainConfig(**kwargs)
    assert needle in str(exc.value) and "\n" not in str(exc.value), str(exc.value)


def test_train_config_builds_offload_beside_any_recompute():
    from .tutorial_run import train_module

    TrainConfig = train_module().TrainConfig
    config = TrainConfig(recompute="selective", recompute_modules="core_attn,mlp_act", offload_modules="mlp,norm")
    assert config.recompute_config() == RecomputeConfig("selective", modules=["core_attn", "mlp_act"],
                                                        offload_modules=["mlp", "norm"])  # fmt: skip
    assert TrainConfig(recompute="full", offload_modules="layer").recompute_config().offload_modules == ("layer",)
    assert TrainConfig(offload_modules="core_attn").recompute_config() == RecomputeConfig(offload_modules=["core_attn"])


def test_train_py_with_offload_trains_the_same_losses(world, tmp_path):
    from .tutorial_run import tiny_run_files
    from .tutorial_run import train as run_train

    common = tiny_run_files(tmp_path) + [
        "--tp", "2", "--sequence-parallel", "--recompute", "selective", "--recompute-modules", "core_attn,norm",
        "--global-batch-size", "4", "--max-steps", "2", "--warmup-steps", "1", "--checkpoint-every", "0",
    ]  # fmt: skip
    plain = world(2).run(run_train, common)[0]
    offloaded = world(2).run(run_train, common + ["--offload-modules", "core_attn,mlp"])[0]
    assert len(plain["losses"]) == 2 and offloaded["losses"] == plain["losses"]
    assert offloaded["offloaded_bytes"] > 0 and "offloaded_bytes" not in plain


# ---------------------------------------------------------------------------------------------
# The benchmark (scripts/bench_offload.py, a stage of scripts/device_report.py): its plumbing.


def test_benchmark_figures_at_a_tiny_shape():
    from .helpers import REPO

    sys.path.insert(0, str(REPO / "scripts"))
    try:
        from bench_offload import measure, render
    finally:
        sys.path.remove(str(REPO / "scripts"))
    nc.initialize_model_parallel(1)
    nc.model_parallel_manual_seed(0)
    ids = torch.randint(0, 64, (1, S), generator=torch.Generator().manual_seed(1))
    r = measure(_args(0.0), torch.device("cpu"), torch.float32, ids, "mlp", "selective", "explicit", 1, 0)
    kept = r["kept_bytes"]
    assert r["offloaded_bytes_per_step"] == kept["plain"] - kept["offload"] > 0
    assert r["reloads_per_step"] == r["prefetched_per_step"] == r["copies_per_step"] > 0
    assert 0 <= r["hidden_fraction"] <= 1 and r["copies_alone_s"] > 0
    link = r["host_link"]  # each direction timed apart: what neuron-ckpt plan --host-link takes
    assert r["copies_alone_s"] == link["d2h_s"] + link["h2d_s"]
    assert link["d2h_gbps"] == pytest.approx(r["offloaded_bytes_per_step"] / link["d2h_s"] / 1e9)
    assert r["matmul_tflops"] > 0
    text = render(r)
    assert "CPU: the copies are host-to-host" in text and f"--host-link {link['d2h_gbps']:.1f}," in text
