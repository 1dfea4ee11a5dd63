"""What model a run of train.py trains, and how: the core attention, the recompute (a preset, or
planned per layer for ``--recompute auto``), the memory the planner predicts, and the model itself:
``LlamaForCausalLM``, or under ``--pp > 1`` this rank's stages of a ``LlamaPipeline`` (one step's
micro-batches are the schedule's; each stage applies the recompute preset; ``--init-hf`` read per
stage)."""

from __future__ import annotations

import torch
from train_config import TrainConfig

from neuron_ckpt.memory import ModelShape
from neuron_ckpt.models import LlamaForCausalLM, load_hf_checkpoint
from neuron_ckpt.parallel.flash import kernel_name as flash_kernel_name
from neuron_ckpt.parallel.flash import unavailable as flash_unavailable
from neuron_ckpt.pipeline import LlamaPipeline, PipelineConfig, apply_pipeline_recompute, cut_layers
from neuron_ckpt.pipeline.hf_checkpoint import load_pipeline_hf_checkpoint
from neuron_ckpt.recompute import apply_recompute


def _attention(cfg: TrainConfig, config, seq_len: int, device_type: str) -> tuple[str, str]:
    """The core attention this run uses and how to say it: flash where a kernel runs for this
    device, shape and CP degree (asked for, or by default), explicit otherwise, with the reason."""
    why = flash_unavailable(device_type, seq_len, config.head_dim, cfg.cp)
    if cfg.attention == "explicit":
        return "explicit", "explicit (asked for)"
    if why is None:
        return "flash", f"flash: {flash_kernel_name(device_type)}"
    asked = "--attention flash asked for, but" if cfg.attention == "flash" else "flash unavailable:"
    return "explicit", f"explicit ({asked} {why})"


def _auto_recompute(
    cfg: TrainConfig, config, parallel, seq_len: int, dtype: torch.dtype, device_type: str, attention: str
):
    """``--recompute auto``: the per-layer recompute with the least recompute FLOPs that fits
    (neuron_ckpt.memory.planner, the same plan ``neuron-ckpt plan`` prints)."""
    from neuron_ckpt.memory import plan_recompute

    memory = cfg.device_memory or {"xla": "trn1"}.get(device_type)
    if memory is None and device_type == "cpu":
        raise ValueError("--recompute auto on CPU needs --device-memory (GiB one rank may use)")
    return plan_recompute(ModelShape.from_llama(config), _setup(cfg, parallel, seq_len, dtype, attention), memory)


def _setup(cfg: TrainConfig, parallel, seq_len: int, dtype: torch.dtype, attention: str):
    """The job as the memory planner sees it."""
    from neuron_ckpt.memory import TrainingSetup

    return TrainingSetup(
        seq_len=seq_len,
        micro_batch=cfg.micro_batch_size,
        tp=parallel.tp_size,
        dp=parallel.dp_size,
        dtype={torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype],
        sequence_parallel=cfg.sequence_parallel,
        zero1=True,
        attention=attention,
    )


def predicted_peak(
    cfg: TrainConfig, config, parallel, seq_len: int, dtype: torch.dtype, attention: str, recompute, plan
) -> int | None:
    """The planner's peak bytes per rank for this job (logged next to the device's measured peak),
    or None where the recompute is not one the analytic model prices (docs/memory.md); offload
    (``--offload-modules``) priced as on the device: what leaves it, with the reloads in backward."""
    from neuron_ckpt.memory import memory_budget

    if plan is not None:
        return plan.budget.total_bytes
    try:
        return memory_budget(
            ModelShape.from_llama(config), _setup(cfg, parallel, seq_len, dtype, attention), recompute or "none"
        ).total_bytes
    except ValueError:
        return None


def attention_and_recompute(cfg: TrainConfig, config, parallel, seq_len: int, dtype: torch.dtype, rt):
    """The core attention (flash where it runs) and the recompute (``--recompute``, or the planner's
    choice for ``auto``, returned as the plan too), each said once."""
    is_main = rt.rank == 0
    attention, attention_text = _attention(cfg, config, seq_len, rt.device.type)
    recompute, plan = cfg.recompute_config(), None
    if is_main:
        print(f"attention: {attention_text}", flush=True)
        if (
            attention == "flash"
            and recompute is not None
            and "core_attn" in (recompute.modules or ())
            and recompute.granularity == "selective"
        ):
            print(
                "note: selective recompute of flash attention reruns the kernel to drop only its fp32 log-sum-exp "
                "(no s x s tensor to save); --recompute none keeps nearly the same memory",
                flush=True,
            )
    if cfg.recompute == "auto":
        plan = _auto_recompute(cfg, config, parallel, seq_len, dtype, rt.device.type, attention)
        recompute = plan.recompute
        if is_main:
            print(
                f"recompute auto: {plan.describe()} | planned peak {plan.budget.total_gib:.2f} of "
                f"{plan.limit_bytes / 2**30:.2f} GiB | recompute {plan.overhead:.2%} of a step's FLOPs",
                flush=True,
            )
    return attention, recompute, plan


def pipeline_config(cfg: TrainConfig, config, grad_accum: int) -> PipelineConfig | None:
    """``--pp > 1``: the schedule over this step's ``grad_accum`` micro-batches (the loop's mean of
    micro-batch means, so ``--pp 1`` and ``--pp N`` train on the same loss), checked against the
    pipeline size and the model's layers before anything is built."""
    if cfg.pp == 1:
        return None
    v = cfg.virtual_stages or 1
    try:
        pipeline = PipelineConfig(cfg.pp_schedule_name, grad_accum, v, loss_average="micro_batches")
        pipeline.validate(cfg.pp)
        cut_layers(config.num_hidden_layers, cfg.pp, v)
    except ValueError as e:
        raise ValueError(
            f"--pp {cfg.pp} --pp-schedule {cfg.pp_schedule}: {e} (micro-batches per step: "
            f"--global-batch-size / (--micro-batch-size x DP) = {grad_accum})"
        ) from None
    return pipeline


def build_model(
    cfg: TrainConfig, config, parallel, device, dtype: torch.dtype, attention: str, recompute, pipeline, seq_len: int
):
    """The model with recompute applied and ``--init-hf`` weights loaded: ``LlamaForCausalLM``, or
    this rank's stages of a ``LlamaPipeline`` (the recompute preset applied to each stage)."""
    if pipeline is None:
        model = LlamaForCausalLM(
            config, cfg.sequence_parallel, attention, dtype, parallel_state=parallel, seed=cfg.seed
        )
        apply_recompute(model, recompute)  # checked against the model first (e.g. --recompute-num-layers)
        model.to(device)
        if cfg.init_hf:
            load_hf_checkpoint(model, cfg.init_hf)  # each rank reads only its slices
        return model
    model = LlamaPipeline(config, pipeline, cfg.micro_batch_size, seq_len, cfg.sequence_parallel, attention, dtype,
                          parallel, seed=cfg.seed)  # fmt: skip
    apply_pipeline_recompute(model, recompute)  # per stage: block / uniform counts within each stage
    if cfg.init_hf:
        load_pipeline_hf_checkpoint(model, cfg.init_hf)  # each rank reads only its stages' slices
    return model
