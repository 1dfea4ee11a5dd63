"""Llama-2 pretraining with tensor parallel, sequence parallel, activation recompute and ZeRO-1.

Launch one process per device with torchrun (see run_trn1.sh, run_slurm.sbatch, run_cpu.sh)::

    torchrun --nproc_per_node 32 train.py --model-config llama2-7b \\
        --data data/train.safetensors --tp 8 --sequence-parallel --recompute selective ...

Every option is a field of :class:`TrainConfig` (``train_config.py``; ``--help`` lists them). The pieces live in the
library (model: ``neuron_ckpt.models``, pipeline stages: ``neuron_ckpt.pipeline``, optimizer: ``neuron_ckpt.optim``,
data: ``neuron_ckpt.data``, loop / schedule / metrics / checkpoints: ``neuron_ckpt.train``); this file and
``model_setup.py`` (attention, recompute, the model or its pipeline stages) only assemble them.

``--pp N`` (eager backends only; refused on XLA before the process group starts) cuts the model
into N stages (``--pp-schedule gpipe|1f1b|interleaved``, ``--virtual-stages V``): the
``global batch / (micro-batch x DP)`` micro-batches of a step are the schedule's micro-batches, and
the loss is the mean of their means, as at ``--pp 1``. ``--cp N`` splits each sequence over N ranks (context
parallelism, docs/context_parallel.md): the CP ranks of a replica read the same batch, each trains on its share of
the sequence, and the loss is the token mean of the whole batch, as at ``--cp 1``. ``main(argv)`` also runs inside
a ``LocalWorld`` worker (tests).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time

import torch
from model_setup import attention_and_recompute, build_model, pipeline_config, predicted_peak
from train_config import DTYPES, TrainConfig, parse_args

import neuron_ckpt as nc
from neuron_ckpt.data import DataParallelBatches, PackedDataset
from neuron_ckpt.distributed import host
from neuron_ckpt.distributed.runtime import collective_timeout_s, detect_backend, get_runtime
from neuron_ckpt.memory import ModelShape
from neuron_ckpt.models import check_writable, hf_config_for, load_llama_config, save_hf_checkpoint
from neuron_ckpt.models.config_file import fit_positions
from neuron_ckpt.models.llama_args import PARAMETER_SHAPE_FIELDS
from neuron_ckpt.optim import Zero1Optimizer
from neuron_ckpt.parallel.context_parallel import check_sequence
from neuron_ckpt.pipeline import PipelineConfig
from neuron_ckpt.pipeline.xla import refuse_on_xla
from neuron_ckpt.recompute.offload import offload_stats
from neuron_ckpt.train import (
    RECIPES,
    CheckpointManager,
    FitOptions,
    Interrupted,
    LRSchedule,
    MetricsWriter,
    NonFiniteError,
    SavePolicy,
    TrainState,
    detect_device_kind,
    fit,
    param_groups,
    peak_tflops,
)


def open_dataset(path: str, rt) -> PackedDataset:
    """Open the packed corpus; its full scans (checksum, id range) run on one rank per host.

    That rank leaves a stamp beside the file which the host's other ranks find after the host
    barrier, so they skip the scans. If the scan fails there, there is no stamp: every rank
    scans and raises the same error, and no rank waits in a collective for a failed one.
    """
    dataset, error = None, None
    if rt.local_rank == 0:
        try:
            dataset = PackedDataset(path)
        except ValueError as e:
            error = e
    host.barrier()
    if error is not None:
        raise error
    return dataset or PackedDataset(path)


def _check_device_kind(device_kind: str | None, backend: str) -> None:
    """trn1/trn2 (NeuronCores) are reached through torch-xla only: refuse to label a CPU or GPU
    run as one (e.g. run_trn1.sh on a machine without the Neuron SDK 2.28 venv active)."""
    if device_kind in ("trn1", "trn2") and backend != "xla":
        raise ValueError(
            f"--device-kind {device_kind} needs the xla backend (torch-neuronx + torch-xla: Neuron SDK "
            f"2.28 (PyTorch 2.9), see docs/trainium.md), but this process runs {backend!r}. Activate the "
            "Neuron venv, or pass --device-kind cpu/h100 for a run on this machine."
        )


def compile_backend(device_type: str, backend: str) -> str:
    """The ``torch.compile`` backend for the runtime's device: ``"neuron"`` on TorchNeuron
    (trn2/trn3), ``"inductor"`` elsewhere; refused on XLA (trn1), whose graphs XLA compiles."""
    if backend == "xla":
        raise ValueError(
            "--compile is for eager devices (CPU, CUDA, TorchNeuron on trn2/trn3); on XLA (trn1) the "
            "model already runs as compiled XLA graphs: drop --compile"
        )
    return "neuron" if device_type == "neuron" else "inductor"


def _check_output_paths(cfg: TrainConfig) -> None:
    """At start-up, on every rank (a collective): the outputs can be written, rather than failing
    at the first save / first logged step. The metrics file and TensorBoard directory are checked
    on rank 0 (the rank that writes them), the checkpoint directory on every rank; every rank
    raises the same ValueError naming the option. (--export-hf: check_writable, below.)"""
    from neuron_ckpt.paths import check_output_paths

    check_output_paths(
        files={"--metrics-file": cfg.metrics_file},
        dirs={"--checkpoint-dir": cfg.checkpoint_dir, "--tensorboard-dir": cfg.tensorboard_dir},
        rank0_only=("--metrics-file", "--tensorboard-dir"),
    )


def _print(message: str) -> None:
    print(message, flush=True)


def check_seq_len(seq_len: int, config, cfg: TrainConfig, notices: list[str]):
    """The config whose positions hold the corpus' blocks: a ``max_position_embeddings`` below the
    block length is raised to it with a notice, as NxD's get_model does; refused (ValueError) where
    that would change the RoPE tables."""
    source = cfg.model_config or (f"{cfg.init_hf}'s config.json" if cfg.init_hf else "configs/tiny.json")
    config, notice = fit_positions(config, seq_len, f"{cfg.data} with the model config ({source})")
    if notice:
        notices.append(notice)
    return config


def _start(cfg: TrainConfig):
    """torch.distributed (with the collective timeout) and the TP x CP x DP (x PP) groups."""
    backend = cfg.backend or detect_backend()
    if cfg.pp > 1:
        refuse_on_xla(backend == "xla")  # before the process group: no rank starts work
    timeout = cfg.collective_timeout or (7200.0 if backend == "xla" else 1800.0)
    rt = nc.init_distributed(backend=cfg.backend, timeout_s=timeout)
    parallel = nc.initialize_model_parallel(cfg.tp, cfg.pp, context_parallel_size=cfg.cp)
    if cfg.collective_timeout and collective_timeout_s() != cfg.collective_timeout and rt.rank == 0:
        print(f"--collective-timeout {cfg.collective_timeout:g} not applied: torch.distributed was initialised "
              "before main() (e.g. by LocalWorld)", flush=True)  # fmt: skip
    _check_device_kind(cfg.device_kind, rt.backend)
    return rt, parallel


def _grad_accum(cfg: TrainConfig, dp: int) -> int:
    """Micro-batches per optimizer step on each DP rank."""
    per_step = cfg.micro_batch_size * dp
    if cfg.global_batch_size % per_step:
        raise ValueError(
            f"--global-batch-size {cfg.global_batch_size} must be a multiple of micro_batch_size x DP "
            f"= {cfg.micro_batch_size} x {dp}"
        )
    return cfg.global_batch_size // per_step


def _model_config_and_data(cfg: TrainConfig, rt):
    """The model config (``--model-config``, ``--init-hf``'s config.json, or the tiny one) and the
    packed corpus, checked against each other; notices (dropped NxD keys, raised positions) said once."""
    notices: list[str] = []
    config = load_llama_config(cfg.model_config, notices) if cfg.model_config else None  # strict: typos are errors
    if cfg.init_hf:
        config = hf_config_for(cfg.init_hf, config, notices)  # its config.json, checked against --model-config
    config = config or load_llama_config("configs/tiny.json", notices)
    if cfg.export_hf:
        check_writable(cfg.export_hf)  # every rank, now: not after the run
    dataset = open_dataset(cfg.data, rt)
    config = check_seq_len(dataset.block_len, config, cfg, notices)
    for notice in dict.fromkeys(notices) if rt.rank == 0 else ():
        print(f"note: {notice}", flush=True)
    if dataset.info.vocab_size > config.vocab_size:
        raise ValueError(
            f"{cfg.data}: tokenizer vocab {dataset.info.vocab_size} > model vocab_size {config.vocab_size}"
        )
    return config, dataset


def _build(
    cfg: TrainConfig,
    config,
    dataset,
    parallel,
    device,
    dtype: torch.dtype,
    attention: str,
    recompute,
    grad_accum: int,
    pipeline: PipelineConfig | None,
):
    """The model (recompute applied, ``--init-hf`` weights loaded), the ZeRO-1 optimizer and the
    batch order, as one TrainState; and the LR schedule."""
    nc.model_parallel_manual_seed(cfg.seed)
    model = build_model(cfg, config, parallel, device, dtype, attention, recompute, pipeline, dataset.block_len)
    optimizer = Zero1Optimizer(
        param_groups(model, cfg.weight_decay, RECIPES[cfg.recipe].no_decay),
        torch.optim.AdamW,
        parallel_state=parallel,
        grad_clip_norm=cfg.grad_clip or None,
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.adam_eps,
    )
    schedule = LRSchedule(
        cfg.lr, cfg.warmup_steps, cfg.max_steps, cfg.decay, cfg.min_lr_ratio, RECIPES[cfg.recipe].warmup_from_zero
    )
    batches = DataParallelBatches(
        dataset,
        cfg.micro_batch_size,
        parallel.dp_rank,
        parallel.dp_size,
        cfg.seed,
        grad_accum=grad_accum,
        shuffle=cfg.data_order == "shuffled",
    )
    return TrainState(model, optimizer, batches), schedule


def main(argv: list[str] | None = None) -> dict:
    cfg = parse_args(argv)
    t_start = time.perf_counter()
    # neuron_parallel_compile runs the script with this set: graphs are traced and compiled, the
    # values that reach the host are placeholders (as NxD's tutorial, no checks, no metrics).
    graphs_only = os.environ.get("NEURON_EXTRACT_GRAPHS_ONLY", "") not in ("", "0")
    rt, parallel = _start(cfg)
    is_main = rt.rank == 0
    compile_with = compile_backend(rt.device.type, rt.backend) if cfg.compile else None
    _check_output_paths(cfg)  # every rank, before any work: not at the first save / logged step
    dtype = DTYPES[cfg.dtype] if cfg.dtype != "auto" else (torch.float32 if rt.device.type == "cpu" else torch.bfloat16)
    checkpoints = CheckpointManager(
        cfg.checkpoint_dir or ".", cfg.keep_last, rt.rank, rt.world_size, parallel_state=parallel,
        local_rank=rt.local_rank, writers=cfg.checkpoint_writers, log=_print if is_main else None,
    )  # fmt: skip
    if cfg.checkpoint_dir and not cfg.resume:
        checkpoints.check_fresh_start()  # a collective, before any work: never mix two runs' checkpoints

    config, dataset = _model_config_and_data(cfg, rt)
    seq_len = dataset.block_len
    try:  # every rank, before any work: the sequence splits into 2 x cp chunks (x tp under SP)
        check_sequence(seq_len, cfg.cp, cfg.tp, cfg.sequence_parallel)
    except ValueError as e:
        raise ValueError(f"--cp {cfg.cp}: {cfg.data}: {e}") from None
    grad_accum = _grad_accum(cfg, parallel.dp_size)
    pipeline = pipeline_config(cfg, config, grad_accum)
    attention, recompute, plan = attention_and_recompute(cfg, config, parallel, seq_len, dtype, rt)
    train_state, schedule = _build(cfg, config, dataset, parallel, rt.device, dtype, attention, recompute, grad_accum,
                                   pipeline)  # fmt: skip
    model = train_state.model
    layout = {"tp_size": parallel.tp_size, "dp_size": parallel.dp_size, "pp_size": parallel.pp_size,
              "cp_size": parallel.cp_size, "model": {k: getattr(config, k) for k in PARAMETER_SHAPE_FIELDS},
              "dtype": str(dtype)}  # fmt: skip
    if pipeline is not None:  # which layers each stage's files hold
        layout["stage_layers"] = list(model.cut.layers_per_stage)
    resumed = train_state.resume(checkpoints, cfg.resume, layout) if cfg.resume else None
    start_step = train_state.step
    if is_main and cfg.resume:
        print(f"resumed from {resumed[0]} at step {start_step}" if resumed else
              f"--resume {cfg.resume}: no checkpoint under {cfg.checkpoint_dir} yet, starting fresh")  # fmt: skip

    device_kind = cfg.device_kind or detect_device_kind(rt.backend)
    peak = cfg.peak_tflops or peak_tflops(device_kind, dtype)
    fpt = ModelShape.from_llama(config).flops_per_token(seq_len)
    # The whole-model planner; per stage: neuron-ckpt plan --pp.
    # The whole-model planner, not yet with context parallelism (issue 46, point 4); per stage: neuron-ckpt plan --pp.
    modelled = pipeline is None and parallel.cp_size == 1
    predicted = predicted_peak(cfg, config, parallel, seq_len, dtype, attention, recompute, plan) if modelled else None
    if is_main:
        n_params = sum(p.numel() for p in model.parameters())
        print(
            f"world {rt.world_size} ({rt.backend}) = TP {parallel.tp_size}"
            + (f" x CP {parallel.cp_size} (seq {seq_len // parallel.cp_size} per rank)" if parallel.cp_size > 1 else "")
            + f" x DP {parallel.dp_size}"
            + (f" x PP {parallel.pp_size} ({cfg.pp_schedule}, stages of {list(model.cut.layers_per_stage)} layers)"
               if pipeline else "") + " | "
            f"sequence parallel {cfg.sequence_parallel} | recompute {cfg.recompute} | "
            + (f"offload {cfg.offload_modules} | " if cfg.offload_modules else "") + f"dtype {dtype} | "
            f"seq {seq_len} | micro-batch {cfg.micro_batch_size} x accum {grad_accum} x DP {parallel.dp_size} = "
            f"global batch {cfg.global_batch_size} | params/rank {n_params / 1e6:.2f} M | "
            f"{fpt / 1e9:.3f} GFLOP/token | peak {peak} TFLOP/s per rank ({device_kind}) | recipe {cfg.recipe}"
            + (f" | planned memory peak {predicted / 2**30:.2f} GiB per rank" if predicted else ""),
            flush=True,
        )  # fmt: skip
        if graphs_only:
            print("NEURON_EXTRACT_GRAPHS_ONLY: compiling graphs only; the values are placeholders, so no NaN "
                  "check, no metrics and no checkpoints", flush=True)  # fmt: skip
    metrics = MetricsWriter(  # a graphs-only run leaves the metrics file alone
        None if graphs_only else cfg.metrics_file, enabled=is_main, append=start_step > 0,
        tensorboard_dir=None if graphs_only else cfg.tensorboard_dir,
        resume_step=start_step if start_step > 0 else None,  # drop what the interrupted run logged past it
    )  # fmt: skip
    stop = min(cfg.max_steps, cfg.stop_at_step or cfg.max_steps)
    log_every = cfg.log_every or (10 if rt.backend == "xla" else 1)
    env = {k: v for k, v in sorted(os.environ.items()) if k.startswith(("NEURON", "XLA"))}
    metrics.write_header(
        env, dataclasses.asdict(cfg), start_step=start_step, world_size=rt.world_size, backend=rt.backend,
        tp=parallel.tp_size, dp=parallel.dp_size, pp=parallel.pp_size, cp=parallel.cp_size, seq_len=seq_len,
        grad_accum=grad_accum, dtype=str(dtype),
        attention=attention, predicted_peak_bytes=predicted,
    )  # fmt: skip
    options = FitOptions(
        stop, cfg.global_batch_size, seq_len, fpt, peak, log_every=log_every, predicted_peak_bytes=predicted,
        graphs_only=graphs_only,
    )  # fmt: skip
    t_fit = time.perf_counter()
    try:
        records = fit(
            train_state, schedule, options, metrics, checkpoints if cfg.checkpoint_dir else None,
            SavePolicy(cfg.checkpoint_every), {**layout, "train_config": dataclasses.asdict(cfg)}, parallel,
            run=torch.compile(model, backend=compile_with) if compile_with else None,
        )  # fmt: skip
        train_s = time.perf_counter() - t_fit
        if cfg.export_hf:
            save_hf_checkpoint(model, cfg.export_hf, config)  # collective: a layer at a time, rank 0 writes
        summary = _summary(records, time.perf_counter() - t_start, start_step, train_s, log_every)
        summary["attention"] = attention
        summary["predicted_peak_bytes"] = predicted
        if plan is not None:
            summary["recompute_plan"] = plan.counts
        if cfg.offload_modules and not pipeline:
            summary["offloaded_bytes"] = offload_stats(model).total_bytes  # this rank, every step
        if records:
            metrics.write_summary({k: v for k, v in summary.items() if k != "losses"})
    finally:
        metrics.close()
    if is_main and records:
        print("summary " + json.dumps({k: v for k, v in summary.items() if k != "losses"}), flush=True)
    return summary


def _summary(records, wall_s: float, start_step: int, train_s: float = 0.0, log_every: int = 1) -> dict:
    """The run's means, plus NxD's results.json fields (final loss, time to train, average
    throughput without the first ceil(10 / log_every) logged steps, peak throughput; seq/s)."""
    if not records:
        return {"steps": 0, "start_step": start_step, "wall_s": wall_s}
    steady = records[1:] or records  # the first step includes warm-up (and XLA compilation)
    mean = lambda key: sum(getattr(r, key) for r in steady) / len(steady)  # noqa: E731
    after = records[math.ceil(10 / log_every) :] or records  # NxD's: the first ~10 steps dropped
    return {
        "start_step": start_step,
        "steps": len(records),
        "loss_first": records[0].loss,
        "loss_last": records[-1].loss,
        "tokens_per_s": mean("tokens_per_s"),
        "seq_per_s": mean("seq_per_s"),
        "mfu": mean("mfu"),
        "wall_s": wall_s,
        "final_loss": records[-1].loss,
        "time_to_train_s": train_s,
        "average_throughput_seq_per_s": sum(r.seq_per_s for r in after) / len(after),
        "peak_throughput_seq_per_s": max(r.seq_per_s for r in after),
        "device_peak_bytes": records[-1].device_peak_bytes,
        "losses": [r.loss for r in records],
    }


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except (Interrupted, NonFiniteError) as e:  # every rank stopped at the same step: a clean exit
        if get_runtime().rank == 0:
            print(f"{type(e).__name__}: {e}", file=sys.stderr, flush=True)
        nc.destroy_distributed()
        sys.exit(getattr(e, "exit_code", 1))  # Interrupted: 128 + signal number (143 SIGTERM, 130 SIGINT)
    nc.destroy_distributed()
