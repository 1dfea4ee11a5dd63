"""Context parallelism: the sequence split over CP ranks gives the model of one rank.

References: the same layer or model on the whole sequence at CP 1 (single-rank attention, our
Llama at CP 1, ``train.py --cp 1``), on the same ranks of one 4-rank LocalWorld. fp64 for the
attention alone (errors ~1e-15); fp32 for whole models (summation order only: ~1e-7 relative).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import neuron_ckpt as nc
from neuron_ckpt.data import write_packed
from neuron_ckpt.distributed import collectives as C
from neuron_ckpt.distributed.traffic import count_collectives
from neuron_ckpt.memory import SavedTensorRecorder
from neuron_ckpt.models import LlamaForCausalLM
from neuron_ckpt.optim import Zero1Optimizer
from neuron_ckpt.parallel import CoreAttention
from neuron_ckpt.parallel.context_parallel import check_sequence, positions, regathered, shard, unshard
from neuron_ckpt.recompute import RecomputeConfig, apply_recompute
from neuron_ckpt.train.placement import Placement

from .helpers import patched, tiny_config
from .tutorial_run import tiny_run_files
from .tutorial_run import train as _train
from .tutorial_run import train_error as _train_error

WORLD = 4


# --- the split ---------------------------------------------------------------------------------


def test_each_rank_holds_an_early_and_a_late_chunk():
    """2c chunks, rank r holds r and 2c-1-r (TE's docstring example: s = 12, c = 2)."""
    assert positions(12, 2, 0).tolist() == [0, 1, 2, 9, 10, 11]
    assert positions(12, 2, 1).tolist() == [3, 4, 5, 6, 7, 8]
    assert positions(8, 4, 3).tolist() == [3, 4]
    x = torch.arange(24).view(2, 12)  # [b, s]: the split is along any dim
    ranks = [x.index_select(1, positions(12, 3, r)) for r in range(3)]
    assert torch.equal(unshard(torch.cat(ranks, 1), 1, 3), x)
    # Causal work (keys each query reads) is the same on every rank: (2c + 1) L^2 ... + L per chunk pair.
    work = [int((positions(16, 4, r) + 1).sum()) for r in range(4)]
    assert len(set(work)) == 1 and sum(work) == 16 * 17 // 2


@pytest.mark.parametrize(
    "s, c, t, sp, message",
    [
        (10, 2, 1, False, "sequence length 10 must be a multiple of 2 x context_parallel_size = 2 x 2 = 4"),
        (12, 2, 2, True, ("sequence length 12 must be a multiple of 2 x context_parallel_size x "
                          "tensor_parallel_size = 2 x 2 x 2 = 8 (sequence parallel)")),
    ],
)  # fmt: skip
def test_a_sequence_that_does_not_split_is_refused_in_one_line(s, c, t, sp, message):
    with pytest.raises(ValueError) as e:
        check_sequence(s, c, t, sp)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)
    check_sequence(12, 2, 2, False)  # without sequence parallel 2c is enough


# --- the attention -----------------------------------------------------------------------------


def _attention_cases(c: int) -> dict:
    """CoreAttention at CP ``c`` against one rank, fp64: output and dq, dk, dv; the collectives of
    one call; the bytes kept for backward with and without the regather."""
    ps = nc.initialize_model_parallel(WORLD // c, context_parallel_size=c)
    s, b, d = 16, 2, 8
    out: dict = {"errors": {}}
    # Local heads of a 4-head, 2-kv-head model at TP 1, 2 and 4 (kv replicated at TP 4).
    for impl in ("explicit", "flash"):
        for a, g in ((4, 2), (2, 1), (1, 1)):
            gen = torch.Generator().manual_seed(a * 10 + g)
            q, gout = (torch.randn(s, b, a * d, generator=gen, dtype=torch.float64) for _ in range(2))
            k, v = (torch.randn(s, b, g * d, generator=gen, dtype=torch.float64) for _ in range(2))
            full = [t.clone().requires_grad_() for t in (q, k, v)]
            CoreAttention(a, g, d, implementation=impl)(*full).backward(gout)
            mine = [shard(t, 0, ps.cp).requires_grad_() for t in (q, k, v)]
            layer = CoreAttention(a, g, d, implementation=impl, context_parallel_group=ps.cp)
            with count_collectives() as calls:
                y = layer(*mine)
                forward = [(x.kind, x.sent) for x in calls]
                y.backward(shard(gout, 0, ps.cp))
            ref = CoreAttention(a, g, d, implementation=impl)(*full)
            errs = [(y - shard(ref, 0, ps.cp)).abs().max()]
            errs += [(m.grad - shard(f.grad, 0, ps.cp)).abs().max() for m, f in zip(mine, full)]
            out["errors"][impl, a, g] = max(e.item() for e in errs)
            out["calls", impl, a, g] = forward, [(x.kind, x.sent) for x in calls[len(forward) :]]
    # What autograd keeps: the local K and V, not the gathered ones (the regather), for flash.
    a, g = 4, 2
    q, k, v = (torch.randn(s // c, b, n * d, dtype=torch.float64, requires_grad=True) for n in (a, g, g))
    layer = CoreAttention(a, g, d, implementation="flash", context_parallel_group=ps.cp)
    kept, outputs = {}, []
    for regather in (True, False):
        with patched(regathered, "applies", staticmethod(lambda on=regather: on)), SavedTensorRecorder() as rec:
            outputs.append(layer(q, k, v))  # alive: what its graph keeps is what is counted
        kept[regather] = rec.total_bytes
    out["kept"], out["kv_local"] = kept, 2 * (s // c) * b * g * d * 8
    nc.destroy_model_parallel()
    return out


@pytest.mark.parametrize("c", [2, 4])
def test_attention_over_the_whole_context_equals_one_rank(world, c):
    for rank, out in enumerate(world(WORLD).run(_attention_cases, c)):
        assert max(out["errors"].values()) < 1e-12, (rank, out["errors"])
        for (_, impl, a, g), (forward, backward) in ((k, v) for k, v in out.items() if k[0] == "calls"):
            kv = 2 * (16 // c) * 2 * g * 8 * 8  # local K and V, fp64: what each call moves
            # One all-gather forward; backward gathers again and reduce-scatters dK, dV: (c - 1) KV each.
            assert forward == [("all_gather", (c - 1) * kv)], (impl, a, g, forward)
            assert sorted(backward) == [("all_gather", (c - 1) * kv), ("reduce_scatter", (c - 1) * kv)]
        # Kept for backward: the local K and V instead of the gathered ones, (c - 1) x local less.
        assert out["kept"][False] - out["kept"][True] == (c - 1) * out["kv_local"], out["kept"]


# --- the model ---------------------------------------------------------------------------------


def _llama(tp: int, c: int, sp: bool, impl: str, labels_from: int, dropout: float = 0.0, recompute=None):
    """Logits (full), loss and gradients (CP mean) of our Llama at CP ``c``; RNG stream seed."""
    ps = nc.initialize_model_parallel(tp, context_parallel_size=c)
    nc.model_parallel_manual_seed(5)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[:, :labels_from] = -100
    model = LlamaForCausalLM(tiny_config(attention_dropout=dropout), sp, impl, parallel_state=ps)
    if recompute is not None:
        apply_recompute(model, RecomputeConfig.preset(recompute))
    out = model(ids, labels=labels, return_logits="full")
    out.loss.backward()
    grads = model.hf_grad_dict()
    if ps.cp is not None:  # the mean over CP, as ZeRO-1 takes it (over DP x CP)
        grads = {k: C.all_reduce(v, ps.cp) / c for k, v in grads.items()}
    loss = C.all_reduce(out.loss.detach(), ps.cp) / c if ps.cp is not None else out.loss.detach()
    seed = nc.get_rng_tracker().seeds["model-parallel-rng"]
    del model
    nc.destroy_model_parallel()
    return loss, out.logits.detach(), grads, seed


def _model_cases() -> dict:
    out = {}
    for tp, c, sp in ((1, 2, False), (2, 2, True), (1, 4, False)):
        for impl in ("explicit", "flash"):
            # labels_from 13: only positions 12-14 have targets, all on the CP ranks holding the
            # last chunks (at CP 4 two ranks have none): the loss is not a mean of rank means.
            for labels_from in (0, 13):
                ref, got = _llama(tp, 1, sp, impl, labels_from), _llama(tp, c, sp, impl, labels_from)
                err = max((got[2][k] - ref[2][k]).abs().max().item() / ref[2][k].abs().max().item() for k in ref[2])
                out[tp, c, impl, labels_from] = (
                    abs(got[0] - ref[0]).item() / ref[0].item(), (got[1] - ref[1]).abs().max().item(), err
                )  # fmt: skip
    return out


def test_llama_at_cp_equals_cp_1(world):
    """Loss (the token mean whatever c is, with and without ranks that hold no target), full
    logits and every parameter's gradient at CP 2 (TP 1; TP 2 + SP) and CP 4 equal CP 1's."""
    for rank, out in enumerate(world(WORLD).run(_model_cases)):
        for case, (loss, logits, grads) in out.items():
            assert loss < 1e-6 and logits < 1e-5 and grads < 1e-5, (rank, case, loss, logits, grads)


def _dropout_cases() -> dict:
    """At CP 2 with attention dropout: each CP rank's stream seed; gradients with selective recompute
    (the rerun draws the same masks) against none."""
    plain = _llama(2, 2, True, "explicit", 0, dropout=0.3)
    recomputed = _llama(2, 2, True, "explicit", 0, dropout=0.3, recompute="selective")
    full = _llama(2, 2, True, "explicit", 0, dropout=0.3, recompute="full")
    same = all(torch.equal(plain[2][k], r[2][k]) for r in (recomputed, full) for k in plain[2])
    return {"seed": plain[3], "replayed": same, "loss": (plain[0].item(), recomputed[0].item())}


def test_dropout_streams_per_cp_rank_and_recompute_replays_them(world):
    out = world(WORLD).run(_dropout_cases)
    # tp-cp-dp order at TP 2 x CP 2: rank = cp_rank * 2 + tp_rank; seed 5 + 2718 + tp_rank + 2 cp_rank.
    assert [o["seed"] for o in out] == [5 + 2718 + r for r in range(WORLD)]
    assert all(o["replayed"] and o["loss"][0] == o["loss"][1] for o in out), out


def _zero1_step() -> list[torch.Tensor]:
    """One ZeRO-1 AdamW step of our Llama at TP 2 + SP x CP 2: this rank's parameters after it."""
    ps = nc.initialize_model_parallel(2, context_parallel_size=2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_config(), True, "flash", parallel_state=ps)
    opt = Zero1Optimizer(model.parameters(), torch.optim.AdamW, parallel_state=ps, lr=1e-2)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    model(ids, labels=ids).loss.backward()
    opt.step()
    params = [p.detach().clone() for p in model.parameters()]
    del model, opt
    nc.destroy_model_parallel()
    return params


def test_weights_stay_replicated_over_cp_after_a_zero1_step(world):
    """ZeRO-1 shards over DP x CP and all-gathers the update over it: the CP ranks of a TP rank
    (ranks r and r + 2 at TP 2) hold the same parameters, bit for bit."""
    out = world(WORLD).run(_zero1_step)
    for tp_rank in (0, 1):
        assert all(torch.equal(a, b) for a, b in zip(out[tp_rank], out[tp_rank + 2]))
    assert not all(torch.equal(a, b) for a, b in zip(out[0], out[1]))  # TP shards differ


# --- the tutorial ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def run_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("cp")
    write_packed(root / "blocks12.safetensors", np.arange(16 * 12).reshape(16, 12) % 128, vocab_size=128, tokenizer="r")
    common = tiny_run_files(root) + [
        "--global-batch-size", "8", "--max-steps", "3", "--warmup-steps", "1", "--lr", "1e-2", "--dtype", "fp32",
    ]  # fmt: skip
    return root, common


CONFIGS = {
    "tp1 explicit none": ["--tp", "1", "--attention", "explicit", "--recompute", "none"],
    "tp1 flash full": ["--tp", "1", "--attention", "flash", "--recompute", "full"],
    "tp2+sp flash selective": ["--tp", "2", "--sequence-parallel", "--attention", "flash", "--recompute", "selective"],
    "tp2+sp explicit full": ["--tp", "2", "--sequence-parallel", "--attention", "explicit", "--recompute", "full"],
}


@pytest.mark.parametrize("config", list(CONFIGS))
def test_train_at_cp_2_trains_the_losses_of_cp_1(world, run_files, config):
    """Same data and initial weights (the seed draws every full weight): the logged losses of three
    steps agree to 1e-5 relative (fp32 summation order). scripts/cp_loss_parity.py runs all twelve
    configurations."""
    root, common = run_files
    argv = common + CONFIGS[config]
    ref = world(WORLD).run(_train, argv + ["--cp", "1"])[0]
    got = world(WORLD).run(_train, argv + ["--cp", "2"])[0]
    assert len(got["losses"]) == 3 and got["losses"][-1] < got["losses"][0]
    assert got["losses"] == pytest.approx(ref["losses"], rel=1e-5, abs=0)


def test_a_cp_run_saves_the_model_once_and_resumes_only_at_its_cp(world, run_files):
    """The CP ranks of a TP rank hold the same weights: one of them writes its model file; a
    resume continues exactly, and one at another CP degree is refused before any work."""
    root, common = run_files
    ckpt = ["--checkpoint-dir", str(root / "ckpt")]

    def argv(cp: int) -> list[str]:
        return common + CONFIGS["tp2+sp flash selective"] + ["--cp", str(cp)]

    straight = world(WORLD).run(_train, argv(2))[0]
    world(WORLD).run(_train, argv(2) + ckpt + ["--stop-at-step", "2"])
    step = root / "ckpt" / "step_00000002"
    model_files = sorted(p.name.split("-")[0] for p in step.glob("model_*.safetensors"))
    assert model_files == ["model_tp00000", "model_tp00001"], model_files
    assert json.loads((step / "meta.json").read_text())["cp_size"] == 2
    writers = [Placement(tp, 2, 0, 1, cp_rank=cp, cp_size=2).writes("model") for cp in range(2) for tp in range(2)]
    assert writers == [True, True, False, False]  # CP rank 0 of each TP rank
    resumed = world(WORLD).run(_train, argv(2) + ckpt + ["--resume", "latest"])[0]
    assert resumed["start_step"] == 2 and resumed["losses"] == straight["losses"][2:]
    message = world(WORLD).run(_train_error, argv(1) + ckpt + ["--resume", "latest"])[0]
    assert "cp_size: checkpoint 2, this run 1" in message and "\n" not in message


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--cp", "2", "--pp", "2"], "does not combine with pipeline parallelism yet"),
        (["--cp", "2", "--recompute", "auto", "--device-memory", "1"], "the planner does not model context"),
        (["--cp", "0"], "--cp must be >= 1, got 0"),
    ],
)
def test_what_cp_does_not_combine_with_is_refused_before_any_work(extra, message, capsys):
    from .tutorial_run import train_module

    train_module()
    from train_config import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--tp", "1", *extra])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert message in err


def test_a_sequence_that_does_not_split_over_cp_is_refused_before_training(world, run_files):
    """Blocks of 12 tokens at TP 2 + SP x CP 2: 12 is not a multiple of 2 c t = 8."""
    root, common = run_files
    data = common.index("--data") + 1
    argv = common[:data] + [str(root / "blocks12.safetensors")] + common[data + 1 :]
    message = world(WORLD).run(_train_error, argv + ["--tp", "2", "--sequence-parallel", "--cp", "2"])[0]
    assert message.startswith("--cp 2: ") and "sequence length 12 must be a multiple of 2 x context" in message
    assert "\n" not in message
