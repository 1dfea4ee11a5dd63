"""A lent accelerator turned into figures in one command: memory against the budget, speed against the peers.

::

    python scripts/device_report.py --out runs/device     # on a device (CUDA, TorchNeuron's neuron): under 8 min
    python scripts/device_report.py --tiny --out /tmp/dr   # on CPU at tiny shapes: the plumbing only (CI runs it)

Our Llama of about 1B parameters (h 2048, 16 layers, 16 heads, 8 kv heads, f 5632, v 32000,
s 4096, bf16, TP 1, micro-batch 1; ``--tiny``: the tests' TINY Llama at s 64) trains on
whatever device ``torch.accelerator`` has, in a world of one rank (nccl, gloo on CPU), a full
step being forward, backward and a ``Zero1Optimizer`` (AdamW) step at dp 1. In this order, the
most telling figures first (``stage_clock.py`` stops it before the time budget, saying what it left):

1. **memory** (16 layers, flash then explicit attention; every preset of
   ``neuron_ckpt.recompute.PRESETS``): the device's peak allocated bytes over one step after a
   warm-up step (``torch.accelerator`` memory stats, peak reset before the step; None on CPU)
   next to ``memory_budget``'s total and activation peak for the same job; the activations
   autograd keeps (``SavedTensorRecorder``) next to the budget's. Each step is also timed: the
   speed rows of the presets, flash against explicit, and MFU against the device's dense bf16
   peak (``neuron_ckpt.train.peak_tflops``) come from these models.
2. **memory at 8 layers**, both attentions, then the **per-layer bytes by difference** through
   ``neuron_ckpt.memory.compare`` (``neuron-ckpt compare``'s method): the saved
   ``memory_stats()`` JSON of each run (and the recorder's figure, which CPU has too) read back
   with ``neuron_ckpt.memory.readers``, next to the analytic per-layer figure and the budget's.
3. **ours against transformers' checkpointing** at equal activation memory
   (``scripts/bench_equal_memory.py``'s functions: HF with ``gradient_checkpointing_enable()``,
   eager attention; ours as ``plan_activations`` plans it), forward + backward.
4. **offload of one module** (``scripts/bench_offload.py``'s :func:`measure`: the MLP of every layer
   but the last, selective recompute, flash): step time with and without, the copies alone, the
   exposed copy time, peak allocated memory of each (``details["offload"]`` of the JSON).
5. **torch.compile against eager** (selective, flash): inductor (``neuron`` on TorchNeuron;
   ``aot_eager`` with ``--tiny``: inductor's code generation takes 2 minutes on 2 cores).

Writes ``DIR/device_report.json`` (rewritten after every stage, so an interrupted run keeps what
it measured; the schema is :mod:`device_figures`'s), the raw files ``neuron-ckpt compare`` reads
(``DIR/config.json``; per run ``DIR/saved/*.json`` and, on a device, ``DIR/memory_stats/*.json``),
and appends a dated section to ``--docs`` (default: docs/device-figures.md on a device,
``DIR/device-figures.md`` with ``--tiny``). Timing:
synchronize before and after each step, warm-up steps excluded, the variants taking turns in
rotating order, the best step of each (medians beside). Exit status 0, 1 when a stage failed
(the report says which and why), 2 on bad input.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from device_figures import device_info, memory_row, mib, per_layer_row, render_section, speed_rows, write_json
from stage_clock import StageClock

REPO = Path(__file__).resolve().parents[1]
DTYPE = torch.bfloat16


@dataclass(frozen=True)
class Job:
    """The model and how long to time it. layers: the two layer counts of the per-layer difference
    (the larger is the model the memory and speed rows are of). need_scale: multiplies each stage's
    expected seconds, below which left on the clock the stage is skipped (0: never skip early)."""

    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    seq: int
    layers: tuple[int, int]
    warmup: int
    iters: int
    need_scale: float

    def config(self, layers: int):
        import transformers

        return transformers.LlamaConfig(
            hidden_size=self.hidden, intermediate_size=self.ffn, num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads, num_hidden_layers=layers, vocab_size=self.vocab,
            max_position_embeddings=self.seq, rms_norm_eps=1e-5, tie_word_embeddings=False,
            attention_dropout=0.0, use_cache=False,
        )  # fmt: skip

    def shape(self, layers: int | None = None):
        from neuron_ckpt.memory import ModelShape

        return ModelShape.from_llama(self.config(layers or self.layers[1]))


DEVICE_JOB = Job(2048, 16, 8, 5632, 32000, 4096, (8, 16), warmup=2, iters=5, need_scale=1.0)
# tests/helpers.py's TINY (the test checks they agree), at its longest sequence.
TINY_JOB = Job(64, 4, 2, 96, 128, 64, (1, 2), warmup=1, iters=2, need_scale=0.0)


class Context:
    """What the stages share: the job, the device, the clock, where files go, what was measured."""

    def __init__(self, job: Job, device: torch.device, out: Path, clock: StageClock, compile_backend: str):
        self.job, self.device, self.out, self.clock = job, device, out, clock
        self.compile_backend = compile_backend
        self.ids = torch.randint(0, job.vocab, (1, job.seq), generator=torch.Generator().manual_seed(1)).to(device)
        self.memory: dict[tuple[str, str, int], dict] = {}  # (attention, preset, layers) -> measured
        self.times: dict[str, list[float]] = {}  # "attention/preset", "hf checkpointing", ... -> step seconds
        self.details: dict = {}  # the bytes behind the equal-memory comparison, compile seconds
        self.bucket_cap_mb: float | None = None

    def setup(self, attention: str):
        from neuron_ckpt.memory import TrainingSetup

        cap = self.bucket_cap_mb if self.bucket_cap_mb is not None else 128.0
        return TrainingSetup(
            self.job.seq,
            1,
            tp=1,
            dp=1,
            dtype="bf16",
            sequence_parallel=False,
            zero1=True,
            bucket_cap_mb=cap,
            attention=attention,
        )

    def sync(self) -> None:
        if self.device.type != "cpu":
            torch.accelerator.synchronize(self.device)


def build(ctx: Context, layers: int, attention: str):
    """Our Llama and its ZeRO-1 AdamW on the device, after one step (AdamW's state, the
    allocator's and the libraries' first allocations happen there, not in a measured step)."""
    from neuron_ckpt.models.llama import LlamaForCausalLM
    from neuron_ckpt.optim import Zero1Optimizer

    torch.manual_seed(0)
    model = LlamaForCausalLM(ctx.job.config(layers), attention_implementation=attention, dtype=DTYPE)
    model = model.to(ctx.device).train()
    opt = Zero1Optimizer(model.parameters(), torch.optim.AdamW, lr=1e-5)
    ctx.bucket_cap_mb = opt.bucket_cap_mb
    train_step(model, opt, ctx.ids)
    return model, opt


def train_step(model, opt, ids: torch.Tensor) -> None:
    opt.zero_grad(set_to_none=True)
    model(ids, labels=ids).loss.backward()
    opt.step()


def time_variants(ctx: Context, variants: dict[str, tuple[Callable, Callable]]) -> None:
    """Seconds per step of each variant ``name: (prepare, step)`` into ``ctx.times``: ``prepare``
    untimed (apply a recompute), ``step`` between two synchronizations; the variants take turns
    in rotating order so drift hits them alike; past the deadline it stops after one timed turn."""
    warmup = ctx.job.warmup
    names = list(variants)
    times: dict[str, list[float]] = {n: [] for n in names}
    for it in range(warmup + ctx.job.iters):
        if it > warmup and ctx.clock.passed():
            break
        for name in names[it % len(names) :] + names[: it % len(names)]:
            prepare, step = variants[name]
            prepare()
            ctx.sync()
            t0 = time.perf_counter()
            step()
            ctx.sync()
            if it >= warmup:
                times[name].append(time.perf_counter() - t0)
    ctx.times.update(times)


def measure_presets(ctx: Context, layers: int, attention: str, timed: bool) -> None:
    """Stage 1 and 2: one model; per preset its kept activations, its step's device peak (and the
    allocator's stats saved for the comparison), and with ``timed`` its step time."""
    from bench_equal_memory import measure_ours

    from neuron_ckpt.memory.measure import device_peak_bytes, reset_device_peak
    from neuron_ckpt.memory.readers import recorder
    from neuron_ckpt.parallel.attention import causal_mask
    from neuron_ckpt.recompute import PRESETS, RecomputeConfig, apply_recompute

    before = torch.accelerator.memory_allocated(ctx.device) if ctx.device.type != "cpu" else None
    model, opt = build(ctx, layers, attention)
    for preset in PRESETS:
        if ctx.clock.passed():
            ctx.clock.skip(f"memory {attention} L{layers} from {preset} on")
            break
        apply_recompute(model, RecomputeConfig.preset(preset))
        saved = measure_ours(model, ctx.ids)
        if attention == "flash":  # measure_ours made the process-wide causal mask, which flash never uses
            causal_mask.cache_clear()
        train_step(model, opt, ctx.ids)  # this preset's first step: recompute's own first allocations
        ctx.sync()
        reset_device_peak(ctx.device)
        train_step(model, opt, ctx.ids)
        ctx.sync()
        name = f"{attention}-{preset}-L{layers}"
        peak = device_peak_bytes(ctx.device)
        files = {"saved": ctx.out / "saved" / f"{name}.json"}  # what neuron-ckpt compare reads: --run N=PATH
        files["saved"].parent.mkdir(parents=True, exist_ok=True)
        recorder.write(files["saved"], [saved])
        if peak is not None:
            files["stats"] = ctx.out / "memory_stats" / f"{name}.json"
            files["stats"].parent.mkdir(parents=True, exist_ok=True)
            write_json(files["stats"], dict(torch.accelerator.memory_stats(ctx.device)))
        ctx.memory[(attention, preset, layers)] = {
            "saved_bytes": saved,
            "device_peak_bytes": peak,
            "allocated_before_bytes": before,
            "files": files,
        }
        print(f"  {name}: kept {mib(saved)} MiB, device peak {mib(peak)} MiB", flush=True)
    if timed:

        def use(p: str):
            return lambda: apply_recompute(model, RecomputeConfig.preset(p))

        step = lambda: train_step(model, opt, ctx.ids)  # noqa: E731
        variants = {f"{attention}/{p}": (use(p), step) for p in PRESETS}
        time_variants(ctx, variants)


def compare_layers(ctx: Context) -> list[dict]:
    """Stage 2's comparison: per (attention, preset, source) with both layer counts measured."""
    from neuron_ckpt.memory.compare import compare
    from neuron_ckpt.memory.readers import ReadError
    from neuron_ckpt.memory.readers.detect import read_any
    from neuron_ckpt.recompute import PRESETS

    lo, hi = ctx.job.layers
    rows = []
    for attention in ("flash", "explicit"):
        for preset in PRESETS:
            runs = [ctx.memory.get((attention, preset, n)) for n in (lo, hi)]
            if None in runs:
                continue
            for kind in runs[1]["files"]:
                try:
                    readings = [(n, read_any(r["files"][kind])) for n, r in zip((lo, hi), runs)]
                except ReadError as exc:  # an accelerator whose memory_stats() are not CUDA's keys
                    ctx.clock.skip(f"per-layer {attention} {preset} from {kind}: {exc}")
                    continue
                setup = ctx.setup(attention)
                c = compare(ctx.job.shape(), setup, preset, readings)
                rows.append(per_layer_row((ctx.job.shape(lo), ctx.job.shape(hi)), setup, attention, preset, c))
    return rows


def equal_memory(ctx: Context) -> None:
    """Stage 3: transformers' checkpointing against our plan at no more activation memory."""
    from bench_equal_memory import hf_model, measure_hf, measure_ours

    from neuron_ckpt.memory import NothingFits, plan_activations
    from neuron_ckpt.models.llama import LlamaForCausalLM
    from neuron_ckpt.recompute import apply_recompute

    config = ctx.job.config(ctx.job.layers[1])
    hf = hf_model(config, DTYPE).to(ctx.device)
    hf_bytes, closure_bytes = measure_hf(hf, ctx.ids)
    try:
        plan = plan_activations(ctx.job.shape(), ctx.setup("explicit"), hf_bytes)
    except NothingFits as exc:
        ctx.clock.skip(f"hf checkpointing / ours planned: {exc}")
        return
    torch.manual_seed(0)
    ours = LlamaForCausalLM(config, attention_implementation="explicit", dtype=DTYPE).to(ctx.device).train()
    apply_recompute(ours, plan.recompute)
    ctx.details.update(
        hf_saved_bytes=hf_bytes,
        hf_closure_bytes=closure_bytes,
        plan=plan.describe(),
        ours_saved_bytes=measure_ours(ours, ctx.ids),
        planned_bytes=plan.budget.activation_bytes,
    )

    def forward_backward(model):
        def step() -> None:
            model.zero_grad(set_to_none=True)
            model(input_ids=ctx.ids, labels=ctx.ids).loss.backward()

        return step

    time_variants(
        ctx, {"hf checkpointing": (noop, forward_backward(hf)), "ours planned": (noop, forward_backward(ours))}
    )


def offload_one_module(ctx: Context) -> None:
    """Stage 4: step time with and without offloading the MLP, and the copy time left exposed."""
    from bench_offload import measure

    config = ctx.job.config(ctx.job.layers[1])
    ctx.details["offload"] = measure(config, ctx.device, DTYPE, ctx.ids, "mlp", "selective", "flash",
                                     ctx.job.iters, ctx.job.warmup)  # fmt: skip


def compiled_eager(ctx: Context) -> None:
    """Stage 5: ``torch.compile`` of the whole model against eager, full steps (selective, flash)."""
    from neuron_ckpt.recompute import RecomputeConfig, apply_recompute

    model, opt = build(ctx, ctx.job.layers[1], "flash")
    apply_recompute(model, RecomputeConfig.preset("selective"))
    compiled = torch.compile(model, backend=ctx.compile_backend)
    t0 = time.perf_counter()
    for _ in range(2):  # compiles; a second call may recompile (grad mode, optimizer-updated tensors)
        train_step(compiled, opt, ctx.ids)
    ctx.sync()
    ctx.details["compile_s"] = time.perf_counter() - t0
    time_variants(
        ctx,
        {
            "eager": (noop, lambda: train_step(model, opt, ctx.ids)),
            "compiled": (noop, lambda: train_step(compiled, opt, ctx.ids)),
        },
    )


def noop() -> None:
    pass


def release(ctx: Context) -> None:
    """Free what a stage left, so the next one's peak starts from nothing: the process-wide causal
    mask explicit attention cached is dropped too (the budget counts it only for explicit)."""
    from neuron_ckpt.parallel.attention import causal_mask

    causal_mask.cache_clear()
    gc.collect()
    if ctx.device.type != "cpu":
        torch.accelerator.empty_cache()


def report_of(ctx: Context, meta: dict, per_layer: list[dict]) -> dict:
    from neuron_ckpt.recompute import PRESETS

    lo, hi = ctx.job.layers
    memory = [
        memory_row(ctx.job.shape(n), ctx.setup(a), a, p, n, ctx.memory.get((a, p, n)))
        for n in (hi, lo)
        for a in ("flash", "explicit")
        for p in PRESETS
    ]
    best = {k: min(v) for k, v in ctx.times.items() if v}
    median = {k: statistics.median(v) for k, v in ctx.times.items() if v}
    setups = {a: ctx.setup(a) for a in ("flash", "explicit")}
    speed = speed_rows(ctx.job.shape(), setups, best, median, meta["device"]["peak_tflops_bf16"])
    return {
        **meta,
        "memory": memory,
        "per_layer": per_layer,
        "speed": speed,
        "details": ctx.details,
        "skipped": ctx.clock.skipped,
        "errors": ctx.clock.errors,
        "elapsed_s": round(ctx.clock.elapsed(), 1),
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from neuron_ckpt.train import PEAK_TFLOPS

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="directory for device_report.json and the raw stats")
    p.add_argument("--tiny", action="store_true", help="CPU at the tests' tiny shapes: checks the plumbing")
    p.add_argument(
        "--docs",
        default=None,
        help="markdown file to append the section to (default: "
        "docs/device-figures.md on a device, OUT/device-figures.md with --tiny)",
    )
    p.add_argument(
        "--budget-s",
        type=float,
        default=450.0,
        help="stop starting measurements after this many seconds (default 450: done within 8 minutes)",
    )
    p.add_argument(
        "--device-kind",
        choices=sorted(PEAK_TFLOPS),
        default=None,
        help="the peak-FLOPs row for MFU (default: h100 on CUDA (H200's is the same), trn2 on neuron)",
    )
    a = p.parse_args(argv)
    if not a.budget_s >= 0:
        p.error(f"--budget-s must be >= 0 seconds, got {a.budget_s}")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    from neuron_ckpt.paths import check_output_paths

    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if accelerator is None and not a.tiny:
        print(
            "device_report.py: no accelerator is visible to torch (torch.accelerator.is_available() is False); "
            "--tiny is the CPU mode",
            file=sys.stderr,
        )
        return 2
    out = Path(a.out)
    docs = Path(a.docs) if a.docs else (out / "device-figures.md" if a.tiny else REPO / "docs" / "device-figures.md")
    try:
        check_output_paths(dirs={"--out": out})
        check_output_paths(files={"--docs": docs})
    except ValueError as exc:
        print(f"device_report.py: {exc}", file=sys.stderr)
        return 2
    import neuron_ckpt as nc

    job = TINY_JOB if a.tiny else DEVICE_JOB
    if a.tiny:
        torch.set_num_threads(1)  # tiny ops: threads only add overhead, and CI machines are shared
    device = torch.device("cpu") if a.tiny else torch.device(accelerator.type, torch.accelerator.current_device_index())
    clock = StageClock(a.budget_s, job.need_scale)
    nc.initialize_model_parallel(1)
    nc.model_parallel_manual_seed(0)
    backend = "aot_eager" if a.tiny else "neuron" if device.type == "neuron" else "inductor"
    ctx = Context(job, device, out, clock, backend)
    meta = {
        "schema": 1,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "mode": "tiny" if a.tiny else "device",
        "command": shlex.join(["python", "scripts/device_report.py", *(sys.argv[1:] if argv is None else argv)]),
        "device": device_info(device, a.device_kind),
        "torch": torch.__version__,
        "shape": {
            "hidden": job.hidden,
            "heads": job.heads,
            "kv_heads": job.kv_heads,
            "ffn": job.ffn,
            "vocab": job.vocab,
            "seq": job.seq,
            "layers": list(job.layers),
            "micro_batch": 1,
            "dtype": "bf16",
            "tp": 1,
            "dp": 1,
        },
    }
    lo, hi = job.layers
    job.config(hi).to_json_file(out / "config.json")  # for neuron-ckpt compare --config, by hand
    per_layer: list[dict] = []
    stages = [  # (name, expected seconds on a device, run): the most telling first
        (f"memory + speed, flash, {hi} layers", 60, lambda: measure_presets(ctx, hi, "flash", timed=True)),
        (f"memory + speed, explicit, {hi} layers", 60, lambda: measure_presets(ctx, hi, "explicit", timed=True)),
        (f"memory, flash, {lo} layers", 30, lambda: measure_presets(ctx, lo, "flash", timed=False)),
        (f"memory, explicit, {lo} layers", 30, lambda: measure_presets(ctx, lo, "explicit", timed=False)),
        ("per-layer bytes by difference", 0, lambda: per_layer.extend(compare_layers(ctx))),
        ("hf checkpointing / ours planned", 90, lambda: equal_memory(ctx)),
        ("offload mlp / none", 40, lambda: offload_one_module(ctx)),
        ("compiled / eager", 200, lambda: compiled_eager(ctx)),
    ]
    for name, need_s, run in stages:
        clock.run(name, need_s, run)
        release(ctx)
        write_json(out / "device_report.json", report_of(ctx, meta, per_layer))
    report = report_of(ctx, meta, per_layer)
    write_json(out / "device_report.json", report)
    with docs.open("a", encoding="utf-8") as f:
        if f.tell() == 0:
            f.write("# Device figures\n\nSections appended by `scripts/device_report.py`, one per run.\n")
        f.write(render_section(report))
    print(
        f"[{clock.elapsed():5.0f} s] wrote {out / 'device_report.json'} and a section of {docs}"
        + (f"; skipped: {'; '.join(clock.skipped)}" if clock.skipped else "")
        + (f"; FAILED: {'; '.join(clock.errors)}" if clock.errors else ""),
        flush=True,
    )
    nc.destroy_distributed()
    return 1 if clock.errors else 0


if __name__ == "__main__":
    sys.exit(main())
