"""Training with pipeline parallelism: ZeRO-1 per stage, checkpoints, the HF export and train.py --pp.

What must hold:

* ZeRO-1 on each stage (PP 2 x DP 2, tied embeddings) takes the steps dense AdamW takes on the
  whole model: the gradient norm is the whole model's (summed over the stages, the tied table
  once), so clipping scales alike, and the tied ends stay one value; with fp32 gradient
  accumulation too, where the tied sum runs in ZeRO-1's buffer.
* ``save_hf_checkpoint`` of a pipeline (PP 2 x TP 2, two virtual stages per rank, tied) writes the
  whole model: ``transformers`` loads it and computes the logits of the same model built in one
  process.
* train.py: ``--pp 2`` trains as ``--pp 1`` on the same global batch, for GPipe, 1F1B and the
  interleaved schedule, with and without recompute, at TP 2 (+ SP) and TP 1 (x DP 2); a run
  stopped at step 2 and resumed continues bit for bit, dropout included (each stage's streams are
  in each rank's checkpoint); another PP degree is refused on resume in one line.
* On XLA ``--pp > 1`` is refused in one line before any process group starts.

Tolerances (fp32). A pipeline runs the same ops on micro-batches, so what differs from the
reference is summation order (loss and gradient sums over micro-batches and stages, the norm's sum
over stages): ulps per step. Gradient norms and train.py's losses: 1e-5 relative (measured ~1e-7,
printed); a norm counting the tied table twice is ~10% off, a lost micro-batch moves the loss by
~1/m. Weights after AdamW steps: 1e-3 of lr, absolute. AdamW divides by ``sqrt(v) + eps``, so an
element whose gradient cancels to about eps turns the ulps of its sum (relative 1e-4 there) into an
update that differs by up to ~1e-4 of lr: measured 2e-4 lr with torch's eps 1e-8 and 6e-5 lr with
eps 1e-6 (NxD's, used here). A real error moves a weight by about lr (a stage's gradient lost, a tied
end not summed: its update's sign or size), 1000 times the tolerance; errors of scale show in the
norm.

Every multi-process call is bounded (``_run`` of tests/test_pipeline.py: 120 s), so a pipeline that
hangs on gloo fails the test instead of hanging CI.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

import neuron_ckpt as nc
from neuron_ckpt.distributed import runtime
from neuron_ckpt.models import LlamaForCausalLM, save_hf_checkpoint
from neuron_ckpt.optim import Zero1Optimizer
from neuron_ckpt.pipeline import LlamaPipeline, LlamaStage, PipelineConfig, apply_pipeline_recompute, check_tied_weights
from neuron_ckpt.pipeline.hf_checkpoint import load_pipeline_hf_checkpoint
from neuron_ckpt.pipeline.xla import XLA_REFUSAL
from neuron_ckpt.recompute import RecomputeConfig

from .helpers import TINY, patched, rel_max
from .test_pipeline import MB, SEQ, VOCAB, _one_process, _run, config
from .tutorial_run import tiny_run_files, train, train_error, train_module

TOL = 1e-5
LR, WD, CLIP = 1e-2, 0.1, 0.05  # CLIP below every step's norm (~0.9 here): every step clips
EPS = 1e-6  # AdamW's epsilon (NxD's recipe): see the module docstring
UPDATE_TOL = 1e-3  # of lr: how far apart two AdamW trajectories' weights may be (module docstring)


# ---------------------------------------------------------------------------------------------
# ZeRO-1 on each stage equals dense AdamW on the whole model (4 processes: PP 2 x DP 2).


def _batch(step: int, dp_rank: int, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A replica's batch; ignored targets differ per replica, so the replicas' token means differ."""
    g = torch.Generator().manual_seed(100 * step + dp_rank)
    ids = torch.randint(0, VOCAB, (m * MB, SEQ), generator=g)
    labels = ids.clone()
    labels[dp_rank, : 3 + 4 * dp_rank] = -100
    return ids, labels


def _zero1_matches_dense(options: dict, steps: int = 2) -> dict:
    state = nc.initialize_model_parallel(pipeline_parallel_size=2)  # DP 2
    cfg, m = config(tied=True), 2
    torch.manual_seed(0)
    ref = LlamaForCausalLM(cfg, parallel_state=_one_process())
    options = dict(options)
    schedule, recompute = options.pop("schedule", "1F1B"), options.pop("recompute", None)
    pipe = LlamaPipeline(cfg, PipelineConfig(schedule, m, 1 if schedule == "1F1B" else 2), MB, SEQ)
    if recompute is not None:
        apply_pipeline_recompute(pipe, recompute)
    pipe.load_hf_state_dict(ref.hf_state_dict())
    opt = Zero1Optimizer(pipe.parameters(), torch.optim.AdamW, grad_clip_norm=CLIP, lr=LR, weight_decay=WD, eps=EPS,
                         **options)  # fmt: skip
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD, eps=EPS)
    norms, ref_norms = [], []
    for step in range(steps):
        opt.zero_grad()
        pipe.step(*_batch(step, state.dp_rank, m))  # the replica's token mean; ZeRO-1 averages over DP
        norms.append(float(opt.step()))
        ref_opt.zero_grad()
        losses = [ref(*_batch(step, r, m)).loss for r in range(state.dp_size)]
        (sum(losses) / state.dp_size).backward()
        ref_norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)))  # the table once
        ref_opt.step()
    weights = ref.hf_state_dict()
    return {
        "err": max(float((v - weights[k]).abs().max()) for k, v in pipe.hf_state_dict().items()) / LR,
        "norms": norms,
        "ref_norms": ref_norms,
        "tied": check_tied_weights(pipe.modules, state),
        "buffered": opt.accumulated_grad(next(pipe.parameters())) is not next(pipe.parameters()).grad,
    }


# The zero-bubble schedule computes weight gradients in a pass of their own, after the input
# gradients: ZeRO-1's fp32 accumulation hooks and the tied sum must see them all the same.
ZERO_BUBBLE = {
    "accumulate_fp32": True,
    "schedule": "InterleavedZeroBubble",
    "recompute": RecomputeConfig("full", method="block", num_layers=1),
}


@pytest.mark.parametrize(
    "options",
    [{}, {"accumulate_fp32": True}, ZERO_BUBBLE],
    ids=["grads", "fp32_buffer", "zero_bubble_fp32_buffer_full_recompute"],
)
def test_zero1_per_stage_equals_dense_adamw(world, options):
    ranks = _run(world, 4, _zero1_matches_dense, options)
    print(
        f"\nZeRO-1 x PP 2 x DP 2 vs dense AdamW: norms {ranks[0]['norms']} (dense {ranks[0]['ref_norms']}), "
        f"largest weight difference {max(r['err'] for r in ranks):.1e} x lr"
    )
    for rank in ranks:
        assert rank["norms"] == pytest.approx(rank["ref_norms"], rel=TOL), rank  # the whole model's norm
        assert min(rank["norms"]) > CLIP, rank  # clipped every step
        assert rank["err"] < UPDATE_TOL, rank
        assert rank["tied"] == 0.0  # both ends took the same steps
        assert rank["buffered"] == bool(options.get("accumulate_fp32"))


# ---------------------------------------------------------------------------------------------
# The HF export of a pipeline (4 processes: PP 2 x TP 2 + SP, 2 virtual stages per rank, tied).


def _export(directory: str) -> str | None:
    nc.initialize_model_parallel(tensor_parallel_size=2, pipeline_parallel_size=2)
    pipe = LlamaPipeline(config(tied=True), PipelineConfig("Interleaved1F1B", 2, 2), MB, SEQ, True, seed=3)
    path = save_hf_checkpoint(pipe, directory, max_shard_size="16KB")  # several shards: the order matters
    return None if path is None else str(path)


def test_hf_export_of_a_pipeline_loads_into_transformers(world, tmp_path):
    paths = _run(world, 4, _export, str(tmp_path / "hf"))
    assert paths == [str(tmp_path / "hf"), None, None, None]  # global rank 0 writes
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager")
    whole = LlamaStage(config(tied=True), range(0, 4), 0, 1, parallel_state=_one_process(), seed=3)  # pp = 1
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ours, theirs = whole(ids).transpose(0, 1), hf(ids).logits  # [b, s, v]
    assert rel_max(theirs, ours) < TOL
    assert hf.config.tie_word_embeddings and hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()


def _load_shallow(path: str) -> str:
    """A 4-layer pipeline (PP 2) loading a 2-layer model's weights file: the message each rank raises."""
    nc.initialize_model_parallel(pipeline_parallel_size=2)
    pipe = LlamaPipeline(config(), PipelineConfig("GPipe", 2), MB, SEQ)
    before = {k: v.clone() for k, v in pipe.state_dict().items()}
    try:
        load_pipeline_hf_checkpoint(pipe, path)
    except KeyError as e:
        assert all(torch.equal(v, before[k]) for k, v in pipe.state_dict().items())  # nothing written
        return str(e)
    return ""


def test_init_hf_of_another_depth_is_refused_on_every_stage(world, tmp_path):
    """Stage 0 holds layers 0-1, which the 2-layer file has: it refuses too, since the keys are
    checked against the whole model (load_hf_slices, the code load_hf_checkpoint runs)."""
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config(layers=2)).save_pretrained(tmp_path, safe_serialization=True)
    messages = _run(world, 2, _load_shallow, str(tmp_path / "model.safetensors"))
    for message in messages:
        assert "does not match the model (4 layers)" in message and "model.layers.3.mlp.up_proj.weight" in message


# ---------------------------------------------------------------------------------------------
# train.py --pp: parity with --pp 1, resume, refusals.


@pytest.fixture(scope="module")
def run_files(tmp_path_factory) -> tuple[Path, list[str]]:
    """A 4-layer tiny Llama as a transformers checkpoint (the runs that resume or load start from
    it) and the tiny corpus."""
    root = tmp_path_factory.mktemp("pp_train")
    data = tiny_run_files(root)[2:]  # --data <file>
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY | {"num_hidden_layers": 4}))
    hf.save_pretrained(root / "init")
    common = data + [
        "--init-hf", str(root / "init"), "--global-batch-size", "8", "--max-steps", "5", "--warmup-steps", "1",
        "--lr", "1e-2", "--dtype", "fp32",
    ]  # fmt: skip
    return root, common


TP2 = ["--tp", "2", "--sequence-parallel"]
FULL, SELECTIVE = ["--recompute", "full"], ["--recompute", "selective"]
# name: (arguments, the --pp 1 run it must equal)
PARITY = {
    "pp1 tp2": (TP2, None),
    "pp1 tp2 full": (TP2 + FULL, None),
    "pp1 tp1": (["--tp", "1"], None),
    "gpipe tp2": (TP2 + ["--pp", "2", "--pp-schedule", "gpipe"], "pp1 tp2"),
    "1f1b tp2": (TP2 + ["--pp", "2"], "pp1 tp2"),
    "1f1b tp2 full": (TP2 + FULL + ["--pp", "2"], "pp1 tp2 full"),
    "interleaved tp2 selective": (TP2 + SELECTIVE + ["--pp", "2", "--pp-schedule", "interleaved"], "pp1 tp2"),
    "1f1b tp1 selective": (["--tp", "1"] + SELECTIVE + ["--pp", "2"], "pp1 tp1"),
}


@pytest.fixture(scope="module")
def parity(world, run_files) -> dict[str, dict]:
    """Every layout from the seed alone (no checkpoint): each draws the same model from it."""
    root, common = run_files
    init = common.index("--init-hf")
    common = common[:init] + ["--model-config", str(root / "init" / "config.json"), "--seed", "5"] + common[init + 2 :]
    return {name: _run(world, 4, train, common + args)[0] for name, (args, _) in PARITY.items()}


@pytest.mark.parametrize("name", [n for n, (_, base) in PARITY.items() if base])
def test_train_pp2_equals_pp1(parity, name):
    base = parity[PARITY[name][1]]
    got, want = parity[name]["losses"], base["losses"]
    diffs = [abs(a - b) / abs(b) for a, b in zip(got, want)]
    print(f"\n{name}: losses {[f'{x:.6f}' for x in got]}, largest relative difference to --pp 1 {max(diffs):.2e}")
    assert len(got) == len(want) == 5 and max(diffs) < TOL, (got, want)
    assert got[-1] < got[0]  # it learns


def test_pp1_runs_are_one_model(parity):
    """The references agree among themselves: recompute and TP do not change the loss."""
    a, b, c = (parity[n]["losses"] for n in ("pp1 tp2", "pp1 tp2 full", "pp1 tp1"))
    assert max(abs(x - y) / abs(y) for x, y in zip(a + a, b + c)) < TOL


def _resume(argv: list[str], keep_streams: bool = True) -> dict:
    """train.py ``argv``; with ``keep_streams=False`` a resume does not restore the stages' streams."""
    if keep_streams:
        return train(argv)
    with patched(LlamaPipeline, "load_rng_state_dict", lambda self, states: None):
        return train(argv)


def test_resume_with_pp_continues_exactly_and_another_pp_is_refused(world, run_files, tmp_path):
    """PP 2 x DP 2, two virtual stages per rank, dropout and selective recompute: stop after step 2,
    resume, and the losses of steps 3-4 are the uninterrupted run's, bit for bit."""
    root, common = run_files
    cfg = json.loads((root / "init" / "config.json").read_text())
    (tmp_path / "init").mkdir()
    (tmp_path / "init" / "config.json").write_text(json.dumps({**cfg, "attention_dropout": 0.2}))
    (tmp_path / "init" / "model.safetensors").symlink_to(root / "init" / "model.safetensors")
    argv = [a if a != str(root / "init") else str(tmp_path / "init") for a in common]
    argv += ["--pp", "2", "--pp-schedule", "interleaved", "--recompute", "selective", "--max-steps", "4",
             "--attention", "explicit"]  # fmt: skip
    straight = _run(world, 4, train, argv + ["--checkpoint-dir", str(tmp_path / "a")])[0]
    ckpt = ["--checkpoint-dir", str(tmp_path / "b")]
    first = _run(world, 4, train, argv + ckpt + ["--stop-at-step", "2"])[0]
    resumed = _run(world, 4, _resume, argv + ckpt + ["--resume", str(tmp_path / "b" / "step_00000002")])[0]
    assert first["losses"] == straight["losses"][:2] and resumed["losses"] == straight["losses"][2:]
    fresh = _run(world, 4, _resume, argv + ckpt + ["--resume", str(tmp_path / "b" / "step_00000002")], False)[0]
    assert fresh["losses"][0] != straight["losses"][2]  # the stages' streams not restored: other dropout masks

    step = tmp_path / "b" / "step_00000002"
    meta = json.loads((step / "meta.json").read_text())
    assert (meta["pp_size"], meta["dp_size"], meta["tp_size"], meta["stage_layers"]) == (2, 2, 1, [1, 1, 1, 1])
    assert meta["shared"] == {"model": ["model_pp00000_tp00000", "model_pp00001_tp00000"]}  # DP rank 0 of each stage
    assert {p.name for p in step.glob("rank_*.pt")} == {f"rank_{r:05d}.pt" for r in range(4)}  # ZeRO-1 shards, streams

    pp1 = [a if a != "2" or argv[i - 1] != "--pp" else "1" for i, a in enumerate(argv)]
    pp1 = [a for a in pp1 if a not in ("--pp-schedule", "interleaved")]
    message = _run(world, 4, train_error, pp1 + ckpt + ["--resume", "latest"])[0]
    assert "pp_size: checkpoint 2, this run 1" in message and "--init-hf" in message and "\n" not in message
    one_f_one_b = [a for a in argv if a not in ("--pp-schedule", "interleaved")]  # 2 stages of 2 layers, not 4 of 1
    message = _run(world, 4, train_error, one_f_one_b + ckpt + ["--resume", "latest"])[0]
    assert "stage_layers: checkpoint [1, 1, 1, 1], this run [2, 2]" in message and "\n" not in message


def test_pipeline_options_are_refused_in_one_line(capsys):
    """Options that need --pp, or do not combine with it, are refused before any process starts."""
    parse = train_module().parse_args
    cases = [
        (["--pp-schedule", "gpipe"], "--pp-schedule gpipe applies only with --pp 2 or more"),
        (["--pp", "2", "--virtual-stages", "2"], "--virtual-stages 2 applies only with --pp-schedule interleaved"),
        (["--pp", "2", "--pp-schedule", "interleaved", "--virtual-stages", "1"], "--virtual-stages must be >= 2"),
        (["--pp", "2", "--compile"], "--compile does not combine with --pp 2"),
        (["--pp", "2", "--recompute", "auto"], "--recompute auto does not combine with --pp 2"),
        (["--pp", "2", "--backend", "xla"], "does not run on XLA"),
    ]
    for argv, message in cases:
        with pytest.raises(SystemExit):
            parse(argv)
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert message in err, err


def test_too_few_micro_batches_for_1f1b_are_refused(world, run_files):
    root, common = run_files
    message = _run(world, 4, train_error, common + ["--pp", "2", "--global-batch-size", "2", "--micro-batch-size", "1"])
    assert all(
        "--pp 2 --pp-schedule 1f1b: schedule '1F1B' needs micro_batches >= pipeline_parallel_size=2, got 1" in m
        and "= 1)" in m
        for m in message
    ), message


# ---------------------------------------------------------------------------------------------
# XLA: refused at set-up, in one line, with the reason.


def test_pp_on_xla_is_refused_before_any_work(monkeypatch, run_files):
    """torch-xla detected (as tests/test_runtime.py simulates it): train.py --pp 2 raises the
    refusal before torch.distributed starts; LlamaPipeline refuses on an XLA runtime too."""
    import torch.distributed as dist

    root, common = run_files
    monkeypatch.setattr(runtime, "_module_available", lambda name: name in {"torch_neuronx", "torch_xla"})
    assert runtime.detect_backend() == "xla"
    message = train_error(common + ["--pp", "2"])
    assert message == XLA_REFUSAL and "aws-neuron-sdk#1189" in message and "\n" not in message
    assert not dist.is_initialized()
    monkeypatch.setattr(runtime, "is_xla", lambda: True)
    with pytest.raises(ValueError, match="does not run on XLA"):
        LlamaPipeline(config(), PipelineConfig("1F1B", 2), MB, SEQ)
