"""The tutorial's options: :class:`TrainConfig`, one typed field per command-line flag, checked
when it is built (before any process group or file is touched); :func:`parse_args` reads them."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field, fields

import torch

from neuron_ckpt.distributed.runtime import backends
from neuron_ckpt.parallel.attention import ATTENTION
from neuron_ckpt.pipeline.config import CP_REFUSAL
from neuron_ckpt.pipeline.xla import XLA_REFUSAL
from neuron_ckpt.recompute import PRESETS, RecomputeConfig
from neuron_ckpt.train import RECIPES

DESCRIPTION = "Llama pretraining with tensor parallel, sequence parallel, activation recompute and ZeRO-1."
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
PP_SCHEDULES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved": "Interleaved1F1B"}  # --pp-schedule: torch's


def opt(default, help: str, choices=None):
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass
class TrainConfig:
    """All options of a run; validated at construction."""

    model_config: str | None = opt(
        None,
        "a transformers LlamaConfig JSON (NxD's too) or a preset (llama2-7b, llama3-8b, llama3.1-8b); "
        "default: --init-hf's config.json, else configs/tiny.json",
    )
    data: str = opt("data/train.safetensors", "packed token file from prepare_data.py")
    # parallelism
    tp: int = opt(1, "tensor-parallel size (ranks per TP group, contiguous); DP = world / (tp x cp x pp)")
    cp: int = opt(
        1,
        "context-parallel size: each sequence split over this many ranks (stride TP: rank = ... + cp_rank x TP + "
        "tp_rank), attention all-gathering keys and values over them; the sequence length must be a multiple of 2 x cp "
        "(2 x cp x tp with --sequence-parallel); docs/context_parallel.md",
    )
    pp: int = opt(
        1,
        "pipeline-parallel size (stages, outermost: rank = pp_rank x DP x CP x TP + dp_rank x CP x TP + cp_rank x TP + "
        "tp_rank); each step's "
        "micro-batches (--global-batch-size / (--micro-batch-size x DP)) run through the stages; not on XLA (trn1)",
    )
    pp_schedule: str = opt(
        "1f1b",
        "--pp > 1: gpipe (all forwards, then all backwards), 1f1b (at most pp - stage micro-batches in "
        "flight; needs micro-batches >= pp) or interleaved (--virtual-stages stages per rank: a smaller bubble)",
        list(PP_SCHEDULES),
    )
    virtual_stages: int | None = opt(None, "--pp-schedule interleaved: stages per rank (default 2)")
    sequence_parallel: bool = opt(False, "split norms/residuals along the sequence over the TP group")
    recompute: str = opt(
        "none",
        "activation recompute: a preset (selective: --recompute-modules, default core attention; full: one "
        "layer per activation checkpoint unless --recompute-method and --recompute-num-layers say otherwise), or auto "
        "(planned per layer to fit --device-memory)",
        [*PRESETS, "auto"],
    )
    device_memory: str | None = opt(
        None,
        "--recompute auto: memory per rank, GiB or 'trn1' (default: trn1 on XLA, detected on CUDA; required on CPU)",
    )
    recompute_method: str | None = opt(
        None, "full recompute: uniform (groups) or block (first N)", ["uniform", "block"]
    )
    recompute_num_layers: int | None = opt(
        None, "full recompute: group size (uniform) / layers recomputed (block); with --pp > 1 per stage (Megatron's)"
    )
    recompute_modules: str = opt(
        "core_attn", "selective recompute: comma-separated modules (core_attn,mlp,mlp_act,norm)"
    )
    offload_modules: str = opt(
        "",
        "activation offload: comma-separated modules whose kept activations go to host memory during the step, "
        "copied beside the compute (layer,core_attn,mlp,mlp_act,norm; every layer but the last; with --recompute full "
        "only layer); CUDA copies on side streams, on CPU the mechanics only; not on XLA (docs/offload.md)",
    )
    attention: str | None = opt(
        None,
        "core attention: flash (a fused kernel, no s x s tensor: torch SDPA's flash on CPU/CUDA, NxD's NKI kernel "
        "on trn1) or explicit (softmax(QK^T) written out); default: flash where the device has a kernel for the "
        "shape, explicit otherwise (printed at start)",
        list(ATTENTION),
    )
    compile: bool = opt(
        False,
        "torch.compile the model (inductor on CPU/CUDA, the neuron backend on TorchNeuron; "
        "not on XLA, which compiles already)",
    )
    dtype: str = opt(
        "auto", "parameter/compute dtype; auto: bf16 on XLA and CUDA, fp32 on CPU", ["auto", "fp32", "bf16"]
    )
    backend: str | None = opt(None, "torch.distributed backend (default: detected)", list(backends()))
    collective_timeout: float | None = opt(
        None,
        "seconds a collective waits for the other ranks; then the run fails naming the ranks that stopped "
        "answering (default: 7200 on XLA, where the first step compiles for up to an hour on each rank while the "
        "ranks done first wait, 1800 elsewhere)",
    )
    recipe: str = opt(
        "default",
        "hyperparameters of the options marked 'per --recipe' that are not given: default (Llama-2 paper: "
        "cosine to 10%%, beta2 0.95, shuffled blocks) or nxd (NxD's Llama tutorial: linear warmup from 0 then to 0, "
        "beta2 0.999, eps 1e-6, weight decay 0.01, seed 12349, blocks in file order); docs/recipes.md",
        list(RECIPES),
    )
    # batch and optimizer
    micro_batch_size: int = opt(1, "sequences per rank per forward/backward")
    global_batch_size: int = opt(8, "sequences per optimizer step over all DP ranks (gradient accumulation fills it)")
    lr: float = opt(3e-4, "peak learning rate")
    min_lr_ratio: float | None = opt(None, "final learning rate as a fraction of --lr (per --recipe: 0.1, nxd 0)")
    warmup_steps: int = opt(100, "linear warmup steps")
    decay: str | None = opt(
        None, "decay after warmup (per --recipe: cosine, nxd linear)", ["cosine", "linear", "constant"]
    )
    max_steps: int = opt(10000, "total optimizer steps (decay ends here)")
    stop_at_step: int | None = opt(None, "stop (and checkpoint) after this step; --resume continues the same schedule")
    weight_decay: float | None = opt(
        None, "AdamW weight decay, not on norm weights and biases (per --recipe: 0.1, nxd 0.01)"
    )
    beta1: float = opt(0.9, "AdamW beta1")
    beta2: float | None = opt(None, "AdamW beta2 (per --recipe: 0.95, nxd 0.999)")
    adam_eps: float | None = opt(None, "AdamW epsilon (per --recipe: 1e-8, nxd 1e-6)")
    grad_clip: float = opt(1.0, "clip the global gradient norm to this (0: no clipping)")
    seed: int | None = opt(None, "seed for init, data order and the TP RNG streams (per --recipe: 1234, nxd 12349)")
    data_order: str | None = opt(
        None,
        "blocks per step: shuffled (a seeded permutation per epoch) or sequential (file order, dealt to the "
        "DP ranks as DistributedSampler(shuffle=False) does) (per --recipe: shuffled, nxd sequential)",
        ["shuffled", "sequential"],
    )
    # logging, checkpoints
    log_every: int | None = opt(
        None,
        "log loss, grad norm and throughput every N steps "
        "(default: 10 on XLA, where a logged step waits for the device; 1 elsewhere)",
    )
    metrics_file: str | None = opt(None, "append one JSON line per logged step here (rank 0)")
    tensorboard_dir: str | None = opt(None, "also log the step scalars to TensorBoard here (needs tensorboard)")
    device_kind: str | None = opt(None, "device for the MFU peak (default: detected)", ["trn1", "trn2", "h100", "cpu"])
    peak_tflops: float | None = opt(None, "peak dense TFLOP/s per rank for MFU (default: per device kind)")
    checkpoint_dir: str | None = opt(None, "sharded checkpoints go here")
    checkpoint_every: int = opt(0, "save every N steps (0: only at the end, when --checkpoint-dir is set)")
    keep_last: int = opt(3, "checkpoints to keep")
    checkpoint_writers: int = opt(
        8, "ranks per host that write (and, on resume, read) checkpoint files at the same time; 0: all"
    )
    resume: str | None = opt(None, "'latest' (under --checkpoint-dir; a fresh start if none) or a checkpoint path")
    init_hf: str | None = opt(
        None,
        "initial weights: a transformers checkpoint directory (save_pretrained's) or one .safetensors / torch file",
    )
    export_hf: str | None = opt(
        None, "at the end, write a transformers checkpoint directory here (from_pretrained loads it)"
    )

    def __post_init__(self) -> None:
        if self.recipe not in RECIPES:
            raise ValueError(f"--recipe must be one of {list(RECIPES)}, got {self.recipe!r}")
        # The recipe fills the options not given (None); a value given explicitly wins over it.
        given = {f.name: getattr(self, f.name) for f in fields(self)}
        for name, value in RECIPES[self.recipe].settings.items():
            if getattr(self, name) is None:
                setattr(self, name, value)
        for f in fields(self):
            choices = f.metadata.get("choices")
            value = getattr(self, f.name)
            if choices and value is not None and value not in choices:
                raise ValueError(f"--{f.name.replace('_', '-')} must be one of {choices}, got {value!r}")
        positive = ("tp", "cp", "pp", "micro_batch_size", "global_batch_size", "max_steps", "keep_last")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.checkpoint_writers < 0:
            raise ValueError(f"--checkpoint-writers must be >= 0 (0: all), got {self.checkpoint_writers}")
        if self.log_every is not None and self.log_every < 1:
            raise ValueError(f"--log-every must be >= 1, got {self.log_every}")
        if self.resume is not None and self.checkpoint_dir is None and self.resume == "latest":
            raise ValueError("--resume latest needs --checkpoint-dir")
        flag = lambda name: "--" + name.replace("_", "-")  # noqa: E731
        for f in fields(self):  # nan/inf pass argparse's float(): refuse them here
            value = getattr(self, f.name)
            if str(f.type).removesuffix(" | None") == "float":  # annotations are strings
                if value is not None and not -float("inf") < value < float("inf"):
                    raise ValueError(f"{flag(f.name)} must be a finite number, got {value}")
        ranges = [
            ("lr", self.lr > 0, "> 0"), ("weight_decay", self.weight_decay >= 0, ">= 0"),
            ("beta1", 0 <= self.beta1 < 1, "in [0, 1)"), ("beta2", 0 <= self.beta2 < 1, "in [0, 1)"),
            ("adam_eps", self.adam_eps > 0, "> 0"), ("grad_clip", self.grad_clip >= 0, ">= 0 (0: no clipping)"),
            ("min_lr_ratio", 0 <= self.min_lr_ratio <= 1, "in [0, 1]"),
            ("warmup_steps", self.warmup_steps >= 0, ">= 0"),
            ("checkpoint_every", self.checkpoint_every >= 0, ">= 0 (0: only at the end)"),
            ("peak_tflops", self.peak_tflops is None or self.peak_tflops > 0, "> 0"),
            ("collective_timeout", self.collective_timeout is None or self.collective_timeout > 0, "> 0 seconds"),
            ("stop_at_step", self.stop_at_step is None or 1 <= self.stop_at_step <= self.max_steps,
             f"in [1, --max-steps {self.max_steps}] (the schedule ends at --max-steps)"),
        ]  # fmt: skip
        for name, ok, want in ranges:
            if not ok:
                raise ValueError(f"{flag(name)} must be {want}, got {getattr(self, name)}")
        # Options that only act together with another: given without it they would be ignored.
        default = {f.name: f.default for f in fields(self)}  # recipe options: None unless given
        needs = [
            ("recompute_method", self.recompute == "full", "--recompute full"),
            ("recompute_num_layers", self.recompute == "full", "--recompute full"),
            ("recompute_modules", self.recompute == "selective", "--recompute selective"),
            ("device_memory", self.recompute == "auto", "--recompute auto"),
            ("checkpoint_every", self.checkpoint_dir is not None, "--checkpoint-dir"),
            ("keep_last", self.checkpoint_dir is not None, "--checkpoint-dir"),
            ("checkpoint_writers", self.checkpoint_dir is not None or self.resume is not None,
             "--checkpoint-dir or --resume"),
            ("min_lr_ratio", self.decay != "constant", "--decay cosine or linear (constant has no floor)"),
            ("pp_schedule", self.pp > 1, "--pp 2 or more"),
            ("virtual_stages", self.pp_schedule == "interleaved", "--pp-schedule interleaved"),
        ]  # fmt: skip
        for name, applies, needed in needs:
            if not applies and given[name] != default[name]:
                raise ValueError(
                    f"{flag(name)} {getattr(self, name)} applies only with {needed}; this run would "
                    f"ignore it: drop it or add {needed}"
                )
        self._check_pipeline()
        if self.offload_modules:
            refused = [
                ("--recompute auto", self.recompute == "auto", "the planner does not weigh offload yet"),
                ("--compile", self.compile, "offload's hooks run eagerly; compiled graphs keep what they keep"),
                ("--backend xla", self.backend == "xla", "XLA (trn1) has no streams and no host placement"),
            ]
            for option, given_, why in refused:
                if given_:
                    raise ValueError(f"--offload-modules {self.offload_modules} does not combine with {option}: {why}")
        self._check_context_parallel()
        try:  # the recompute options' own checks (method and layer count, module names), now
            self._recompute = self._build_recompute()
        except (ValueError, TypeError) as e:
            offload = f" --offload-modules {self.offload_modules}" if self.offload_modules else ""
            raise ValueError(f"--recompute {self.recompute}{offload}: {e}") from None

    def _check_pipeline(self) -> None:
        """What --pp > 1 does not combine with, refused before any process starts work."""
        if self.pp_schedule == "interleaved" and self.virtual_stages is None:
            self.virtual_stages = 2
        if self.virtual_stages is not None and self.virtual_stages < 2:
            raise ValueError(f"--virtual-stages must be >= 2 (stages per rank), got {self.virtual_stages}")
        if self.pp == 1:
            return
        if self.backend == "xla":
            raise ValueError(f"--pp {self.pp}: {XLA_REFUSAL}")
        refused = [("compile", self.compile, "--compile"), ("recompute", self.recompute == "auto", "--recompute auto")]
        for name, given, flag in refused:
            if given:
                why = {
                    "compile": "torch.distributed.pipelining runs the stages eagerly",
                    "recompute": "the planner here plans one model; plan per stage with neuron-ckpt plan --pp and "
                    "pass a preset (each stage applies it)",
                }[name]
                raise ValueError(f"{flag} does not combine with --pp {self.pp}: {why}")

    def _check_context_parallel(self) -> None:
        """What --cp > 1 does not combine with, refused before any process starts work."""
        if self.cp == 1:
            return
        if self.pp > 1:
            raise ValueError(f"--cp {self.cp} --pp {self.pp}: {CP_REFUSAL.format(cp=self.cp)}")
        if self.recompute == "auto":
            raise ValueError(
                f"--recompute auto does not combine with --cp {self.cp} yet: the planner does not model context "
                "parallelism; pass a preset (none, selective, full)"
            )

    @property
    def pp_schedule_name(self) -> str:
        """The ``PipelineConfig.schedule`` of ``--pp-schedule``."""
        return PP_SCHEDULES[self.pp_schedule]

    def _build_recompute(self) -> RecomputeConfig | None:
        if self.recompute == "auto":
            return None
        offload = tuple(m for m in self.offload_modules.split(",") if m)
        if self.recompute == "selective":
            modules = tuple(m for m in self.recompute_modules.split(",") if m)
            return RecomputeConfig(granularity="selective", modules=modules, offload_modules=offload)
        if self.recompute == "full" and (self.recompute_method, self.recompute_num_layers) != (None, None):
            return RecomputeConfig(
                granularity="full",
                method=self.recompute_method,
                num_layers=self.recompute_num_layers,
                offload_modules=offload,
            )
        return dataclasses.replace(RecomputeConfig.preset(self.recompute), offload_modules=offload)

    def recompute_config(self) -> RecomputeConfig | None:
        """The fixed choice, built and checked at construction; None for ``auto``, planned per layer
        in :func:`_auto_recompute` once the model and the memory are known."""
        return self._recompute


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    p = argparse.ArgumentParser(description=DESCRIPTION, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for f in fields(TrainConfig):
        flag, kw = "--" + f.name.replace("_", "-"), {"default": f.default, "help": f.metadata["help"]}
        if f.type in ("bool", bool):
            p.add_argument(flag, action=argparse.BooleanOptionalAction, **kw)
            continue
        base = {"int": int, "float": float}.get(str(f.type).removesuffix(" | None"), str)  # annotations are strings
        p.add_argument(flag, type=base, choices=f.metadata["choices"], **kw)
    try:
        return TrainConfig(**vars(p.parse_args(argv)))
    except ValueError as e:
        p.error(str(e))
