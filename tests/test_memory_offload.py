"""Offload priced (issue 48, point 3): per layer, the bytes ``layer_offloads`` says stay on the
device are what a ``SavedTensorRecorder`` around real Llama layers sees, and the bytes it says go
to host are what ``offload_stats`` counted, to the byte.

Three layers (one config offloads the first two; the last is left alone, and its bytes are the
layer's without offload), bf16, each module name alone, and with selective or full recompute;
explicit and flash attention at TP 1 in this process, then TP 2 + sequence parallel on the
shared 2-rank world.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from neuron_ckpt.memory import ModelShape, TrainingSetup, layer_activation_bytes
from neuron_ckpt.memory.layers import measure_layers, measure_on_ranks
from neuron_ckpt.memory.offload import layer_offloads, offload_price, pinned_block
from neuron_ckpt.recompute import RecomputeConfig

MODEL = ModelShape("llama", 64, 4, 2, 96, 3, vocab=128)
SELECTIVE = dict(granularity="selective", modules=["core_attn", "mlp_act", "norm"])
CORE, MLP = dict(granularity="selective", modules=["core_attn"]), dict(granularity="selective", modules=["mlp"])
FULL = dict(granularity="full", method="uniform", num_layers=1)
CASES = {  # name: (attention, recompute, offload_modules)
    "norm": ("explicit", {}, ["norm"]),
    "core_attn": ("explicit", {}, ["core_attn"]),
    "mlp": ("explicit", {}, ["mlp"]),
    "mlp_act": ("explicit", {}, ["mlp_act"]),
    "layer (and the rotary tables once)": ("explicit", {}, ["layer"]),
    "selective discarding, offload core_attn + mlp": ("explicit", SELECTIVE, ["core_attn", "mlp"]),
    "selective core_attn, offload core_attn + norm": ("explicit", CORE, ["core_attn", "norm"]),
    "selective mlp, offload mlp (its checkpoint's input)": ("explicit", MLP, ["mlp"]),
    "full, offload layer (its input)": ("explicit", FULL, ["layer"]),
    "flash, core_attn (its output copied, kept on the device too)": ("flash", {}, ["core_attn"]),
}  # fmt: skip


def _case(name: str, tp: int = 1) -> tuple:
    attention, recompute, offloaded = CASES[name]
    setup = TrainingSetup(32, 2, tp=tp, dtype="bf16", sequence_parallel=tp > 1, attention=attention)
    return MODEL, setup, RecomputeConfig(**recompute, offload_modules=offloaded)


def _check(name: str, measured, tp: int = 1) -> None:
    model, setup, config = _case(name, tp)
    analytic = layer_offloads(model, setup, config)
    assert measured.unscoped_bytes == 0
    assert measured.per_layer_bytes == [x.device for x in analytic], f"{name}: device"
    assert measured.offloaded_per_layer == [x.host for x in analytic], f"{name}: host"
    assert analytic[0].host > 0 and analytic[-1].host == 0  # the last layer is left alone
    without = RecomputeConfig(**CASES[name][1]) if CASES[name][1] else "none"
    assert analytic[-1].device == analytic[-1].kept == layer_activation_bytes(model, setup, without, 2)


@pytest.mark.parametrize("name", CASES)
def test_measured_device_and_host_bytes_equal_the_model_at_tp1(name):
    _check(name, measure_layers(*_case(name), num_layers=MODEL.layers, backward=False))


def test_measured_equal_the_model_at_tp2_sequence_parallel(world):
    names = [n for n in CASES if CASES[n][0] == "explicit"]
    per_rank = world(2).run(measure_on_ranks, [_case(n, 2) for n in names], MODEL.layers)
    for rank in per_rank:
        for name, measured in zip(names, rank):
            _check(name, measured, tp=2)


def test_the_job_counts_micro_batches_in_flight_and_pinned_blocks():
    model, setup, config = _case("mlp")
    one, four = offload_price(model, setup, config), offload_price(model, setup, config, micro_batches=4)
    layers = one.layers
    assert four.host_bytes == 4 * one.host_bytes == 4 * sum(x.host for x in layers)
    # MLP terms at this shape: 8192 (its input) and 12288 (gate, up, SwiGLU's output) bytes each.
    assert one.host_pinned_bytes == 2 * (8192 + 3 * 16384)
    assert one.copies_in_flight == 2 * one.offloaded_bytes_per_layer == 2 * 45056
    assert one.device_bytes == sum(x.device for x in layers) < sum(x.kept for x in layers)
    # Offload lowers the forward's end by what it moves, less the worst case copies in flight.
    assert one.peak <= one.peak_without


def test_pinned_blocks_round_up_to_a_power_of_two():
    gib = 1 << 30
    assert pinned_block(int(20.4 * gib)) == 32 * gib  # sglang#37285: a 20.4 GiB request took 32 GiB
    assert [pinned_block(n) for n in (0, 1, 4096, 4097)] == [0, 1, 4096, 8192]


@pytest.mark.parametrize(
    "model, offloaded, needle",
    [
        (MODEL, ["moe"], "['moe'] not priced yet"),
        (ModelShape("gpt", 64, 4, 4, 256, 3, vocab=128), ["mlp"], "priced for llama only"),
    ],
)
def test_unpriced_offload_is_refused_in_one_line(model, offloaded, needle):
    with pytest.raises(ValueError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        layer_offloads(model, TrainingSetup(32, 2), RecomputeConfig(offload_modules=offloaded))


# ---------------------------------------------------------------------------------------------
# neuron-ckpt memory --offload-modules / --recompute-modules.

TINY = ["--model", "llama", "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--ffn", "96", "--seq", "32",
        "--micro-batch", "2", "--layers", "3"]  # fmt: skip


def _memory_json(capsys, *args: str) -> dict:
    from neuron_ckpt.cli import main

    assert main(["memory", *TINY, *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_memory_command_prices_any_module_set_and_measures_it(capsys):
    report = _memory_json(
        capsys, "--recompute-modules", "mlp_act,norm", "--offload-modules", "core_attn,mlp", "--measure"
    )
    model, setup = MODEL, TrainingSetup(32, 2, dtype="bf16")
    config = RecomputeConfig("selective", modules=["mlp_act", "norm"], offload_modules=["core_attn", "mlp"])
    first = layer_offloads(model, setup, config)[0]
    assert report["spec"]["recompute"] == "selective[mlp_act,norm]"
    assert report["spec"]["offload_modules"] == ["core_attn", "mlp"]
    assert report["offloaded_bytes_per_layer"] == first.offloaded == first.kept - first.device > 0
    assert report["measured_offloaded_bytes_per_layer"] == report["offloaded_bytes_per_layer"]
    assert report["measured_host_bytes_per_layer"] == report["host_bytes_per_layer"] == first.host
    assert report["measured_device_bytes_per_layer"] == report["device_bytes_per_layer"] == first.device
    assert report["measured_bytes_per_layer"] == report["analytic_bytes_per_layer"] == first.kept
    assert report["offload"]["layers_offloading"] == 2


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--offload-modules", "mlp,atn"], ("--offload-modules mlp,atn: offload_modules: unknown module 'atn'; "
                                            "offloadable modules: ['layer', 'core_attn'")),
        (["--recompute-modules", "core_attn,mpl"], "--recompute-modules core_attn,mpl: modules: unknown module 'mpl'"),
        (["--recompute", "full", "--recompute-modules", "mlp"], "does not combine with --recompute full"),
        (["--offload-modules", "mlp", "--layers", "1"], "give --layers 2 or more"),
        (["--offload-modules", "moe"], "not priced yet"),
    ],
)  # fmt: skip
def test_memory_command_refuses_bad_names_in_one_line(capsys, args, needle):
    from neuron_ckpt.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["memory", *TINY, *args])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and len(err.strip().splitlines()) == 1 and needle in err, err


def test_the_host_budget_holds_the_pinned_blocks_from_the_first_step_on():
    from neuron_ckpt.memory.host import host_budget

    llama2 = ModelShape("llama", 4096, 32, 32, 11008, 32, vocab=32000)
    setup = TrainingSetup(4096, 1, tp=8, sequence_parallel=True, attention="flash")
    price = offload_price(llama2, setup, RecomputeConfig(offload_modules=["mlp"]))
    plain = host_budget(llama2, setup, "p5.48xlarge")
    budget = host_budget(llama2, setup, "p5.48xlarge", offload_pinned_bytes=price.host_pinned_bytes)
    moments, before = {m.name: m for m in budget.moments}, {m.name: m for m in plain.moments}
    # 31 layers x (its input 4 MiB, gate, up and SwiGLU's output 10.75 MiB each: 16 MiB blocks)
    assert price.host_pinned_bytes == 31 * (4 + 3 * 16) << 20
    assert moments["activation offload"].per_rank == price.host_pinned_bytes
    assert moments["activation offload"].per_host == 8 * price.host_pinned_bytes
    saving = moments["checkpoint save"]
    assert saving.per_rank == before["checkpoint save"].per_rank + price.host_pinned_bytes
    assert moments["model construction"] == before["model construction"]  # before the first step
    assert "activation offload" in budget.table() and budget.fits


def test_storages_held_for_their_copies_are_the_models_worst_case():
    """Copies never done until waited for (the test backend): at the end of each layer's forward,
    the device storages still held for their copies are ``in_flight`` to the byte: that layer's
    and the nearest earlier offloading layer's (the engine lets go of older ones at a layer's start)."""
    from torch.multiprocessing.reductions import StorageWeakRef

    from neuron_ckpt.distributed import model_parallel_manual_seed
    from neuron_ckpt.memory.layers import build_layers, layer_input
    from neuron_ckpt.recompute import run_layers
    from neuron_ckpt.recompute.offload import copies_override

    from .deferred_copies import DeferredCopies

    class Watching(DeferredCopies):
        def __init__(self):
            super().__init__()
            self.sources: list[tuple[StorageWeakRef, int]] = []

        def offload(self, source):
            self.sources.append((StorageWeakRef(source.untyped_storage()), source.numel()))
            return super().offload(source)

    four = dataclasses.replace(MODEL, layers=4)
    setup, config = TrainingSetup(32, 2, dtype="bf16"), RecomputeConfig(offload_modules=["core_attn", "mlp"])
    layers, extra = build_layers(four, setup, config, num_layers=4)
    watching, held = Watching(), []
    for layer in layers:
        layer.register_forward_hook(lambda *_: held.append(sum(n for ref, n in watching.sources if not ref.expired())))
    model_parallel_manual_seed(0)
    x = layer_input(four, setup, 0).clone()
    with copies_override(watching):
        out = run_layers(layers, x, *extra)
    price = offload_price(four, setup, config)
    moved = price.layers[0].offloaded
    assert held == list(price.in_flight) == [moved, 2 * moved, 2 * moved, moved]
    assert price.copies_in_flight == 2 * moved
    out.float().sum().backward()
    assert watching.freed_reads == 0


def test_reloads_held_in_backward_are_the_layers_own_and_the_reload_buffer():
    """When each layer's backward starts, the reloaded storages alive on the device are its own
    offloaded bytes and the prefetched ones of the nearest earlier offloading layer (the reload
    buffer), to the byte; the later layers' reloads are gone."""
    from torch.multiprocessing.reductions import StorageWeakRef

    from neuron_ckpt.distributed import model_parallel_manual_seed
    from neuron_ckpt.memory.layers import build_layers, layer_input
    from neuron_ckpt.recompute import run_layers
    from neuron_ckpt.recompute.offload import SyncCopies, copies_override

    class Watching(SyncCopies):
        def __init__(self):
            self.reloaded: list[tuple[StorageWeakRef, int]] = []

        def reload(self, host, device, after):
            dest, event = super().reload(host, device, after)
            self.reloaded.append((StorageWeakRef(dest.untyped_storage()), dest.numel()))
            return dest, event

    four = dataclasses.replace(MODEL, layers=4)
    setup, config = TrainingSetup(32, 2, dtype="bf16"), RecomputeConfig(offload_modules=["core_attn", "mlp"])
    layers, extra = build_layers(four, setup, config, num_layers=4)
    watching, held = Watching(), []

    def alive(_grad):
        held.append(sum(n for ref, n in watching.reloaded if not ref.expired()))

    for layer in layers:  # after offload's own hook on the output: its reload and prefetch have started
        layer.register_forward_hook(lambda _m, _a, out: out.register_hook(alive) and None)
    model_parallel_manual_seed(0)
    x = layer_input(four, setup, 0).clone()
    with copies_override(watching):
        out = run_layers(layers, x, *extra)
    out.float().sum().backward()
    price = offload_price(four, setup, config)
    moved = [x.offloaded for x in price.layers]
    assert held == [moved[2], moved[2] + moved[1], moved[1] + moved[0], moved[0]]  # layers 3, 2, 1, 0
    assert price.reload_buffer == moved[0] > 0


def test_without_offload_modules_nothing_moves_and_the_peak_is_unchanged():
    for model in (MODEL, ModelShape("gpt", 64, 4, 4, 256, 3, vocab=128)):
        price = offload_price(model, TrainingSetup(32, 2), "selective")
        assert price.host_bytes == price.copies_in_flight == 0 and price.peak == price.peak_without
        assert price.device_bytes == sum(x.kept for x in price.layers)
