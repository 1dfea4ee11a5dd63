"""Per-step training metrics: throughput, model-FLOPs utilisation (MFU), device memory, JSON lines.

The metrics file holds three kinds of JSON line: a header (``"kind": "header"``: the
``NEURON*`` / ``XLA*`` environment and the resolved options) where each run, fresh or resumed,
starts; one record per logged step (a ``StepRecord``: the lines with a ``"step"``); and a
summary (``"kind": "summary"``) where a run ends. :func:`read_metrics` splits them.

``MFU = flops_per_token * tokens_per_second / (peak FLOP/s per rank * ranks)`` with the model
FLOPs of :meth:`neuron_ckpt.memory.ModelShape.flops_per_token` (recompute not counted).

Peak dense FLOP/s per rank (one process drives one of these devices), from the vendors' specs:

==================  ============  ============  ==================================================
device kind         bf16 / fp16   fp32          source
==================  ============  ============  ==================================================
``trn1``            95 T          23.75 T       one NeuronCore-v2: a Trainium chip has 2, 190
                                                BF16 / 47.5 FP32 TFLOPS (AWS Neuron docs)
``trn2``            166.75 T      45.25 T       one logical NeuronCore at LNC=2 (2 physical
                                                NeuronCore-v3; a Trainium2 chip: 8 cores,
                                                667 BF16 / 181 FP32 TFLOPS)
``h100``            989 T         67 T          H100 SXM dense tensor-core BF16 / FP32 non-tensor
``cpu``             0.1 T         0.1 T         a guess for one process on a few CPU cores; set
                                                ``--peak-tflops`` for your machine
==================  ============  ============  ==================================================
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..files import write_atomic

PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "trn1": {"bf16": 95.0, "fp32": 23.75},
    "trn2": {"bf16": 166.75, "fp32": 45.25},
    "h100": {"bf16": 989.0, "fp32": 67.0},
    "cpu": {"bf16": 0.1, "fp32": 0.1},
}


def peak_tflops(device_kind: str, dtype: torch.dtype) -> float:
    """Peak dense TFLOP/s of one rank's device for ``dtype`` (bf16/fp16 share the 16-bit row)."""
    if device_kind not in PEAK_TFLOPS:
        raise ValueError(f"device_kind must be one of {sorted(PEAK_TFLOPS)}, got {device_kind!r}")
    key = "fp32" if dtype == torch.float32 else "bf16"
    return PEAK_TFLOPS[device_kind][key]


def detect_device_kind(backend: str) -> str:
    """``trn1`` on XLA (override with --device-kind trn2), ``h100`` on CUDA, else ``cpu``."""
    if backend == "xla":
        return "trn1"
    if backend == "nccl":
        return "h100"
    return "cpu"


@dataclass
class StepRecord:
    """One optimizer step, as logged and written to the metrics file."""

    step: int
    loss: float
    lr: float
    grad_norm: float
    step_time_s: float
    seq_per_s: float
    tokens_per_s: float
    mfu: float
    tokens_seen: int
    device_peak_bytes: int | None = None
    """Peak device memory of this rank so far, as the runtime reports it (XLA, CUDA; None elsewhere)."""
    predicted_peak_bytes: int | None = None
    """The memory planner's peak for this job (:func:`neuron_ckpt.memory.memory_budget`)."""


def make_record(
    step: int,
    loss: float,
    lr: float,
    grad_norm: float,
    step_time_s: float,
    global_batch: int,
    seq_len: int,
    flops_per_token: float,
    peak_tflops_per_rank: float,
    world_size: int,
    tokens_seen: int,
    device_peak_bytes: int | None = None,
    predicted_peak_bytes: int | None = None,
) -> StepRecord:
    seq_per_s = global_batch / step_time_s
    tokens_per_s = seq_per_s * seq_len
    mfu = flops_per_token * tokens_per_s / (peak_tflops_per_rank * 1e12 * world_size)
    return StepRecord(
        step, loss, lr, grad_norm, step_time_s, seq_per_s, tokens_per_s, mfu, tokens_seen,
        device_peak_bytes, predicted_peak_bytes,
    )  # fmt: skip


def format_record(r: StepRecord) -> str:
    line = (
        f"step {r.step:6d} | loss {r.loss:.4f} | lr {r.lr:.3e} | grad norm {r.grad_norm:.3f} | "
        f"{r.step_time_s * 1e3:.0f} ms | {r.seq_per_s:.2f} seq/s | {r.tokens_per_s:.0f} tok/s | "
        f"MFU {100 * r.mfu:.2f}%"
    )
    if r.device_peak_bytes is not None:
        planned = f" (planned {r.predicted_peak_bytes / 2**30:.2f} GiB)" if r.predicted_peak_bytes else ""
        line += f" | device peak {r.device_peak_bytes / 2**30:.2f} GiB{planned}"
    return line


def device_peak_bytes(device: torch.device) -> int | None:
    """The peak memory the runtime reports for ``device`` (this process), or None where it reports
    none (:func:`neuron_ckpt.memory.measure.device_peak_bytes`: XLA's ``peak_bytes_used``, the
    accelerator allocator's peak, nothing on CPU). A backend whose query fails prints nothing
    rather than failing the run."""
    from ..memory.measure import device_peak_bytes as runtime_peak

    try:
        return runtime_peak(device)
    except Exception:  # noqa: BLE001  a backend whose query fails must not fail the run
        return None


def read_metrics(path: str | os.PathLike) -> dict[str, list[dict]]:
    """The metrics file's lines by kind: ``{"header": [...], "step": [...], "summary": [...]}``
    (a torn last line is skipped)."""
    out: dict[str, list[dict]] = {"header": [], "step": [], "summary": []}
    for line in Path(path).read_text().splitlines(keepends=True):
        if not line.endswith("\n"):
            continue  # torn by a kill
        record = json.loads(line)
        out[record.get("kind", "step")].append(record)
    return out


def drop_after_step(path: str | os.PathLike, step: int) -> int:
    """Rewrite the JSON-lines file ``path`` without its records of steps after ``step``; returns
    how many were dropped.

    For a resume from a checkpoint at ``step``: the interrupted run went on logging past its last
    checkpoint, and the resumed run logs those steps again. A torn last line (a kill mid-write)
    and the summary of a run that ended after ``step`` are dropped too; other lines without a step
    are kept. The file is replaced atomically (a temporary file, fsynced, renamed over it), so a
    kill here leaves the old file or the new one. No file: nothing to do.
    """
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        return 0
    lines = text.splitlines(keepends=True)
    kept = []
    for line in lines:
        if not line.endswith("\n"):
            continue  # torn by a kill
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            kept.append(line)
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] > step:
            continue
        if (
            isinstance(record, dict)
            and record.get("kind") == "summary"
            and record.get("start_step", 0) + record.get("steps", 0) > step
        ):
            continue  # the summary of a run whose last steps are dropped
        kept.append(line)
    dropped = len(lines) - len(kept)
    if dropped:
        write_atomic(path, "".join(kept).encode())
    return dropped


class MetricsWriter:
    """Prints each record, appends it as one JSON line to ``path`` and, with ``tensorboard_dir``,
    logs its scalars to TensorBoard (rank 0 only; ``path=None``: no file).

    ``append``: continue the file (a resumed run) instead of starting it anew. With
    ``resume_step`` (the step of the checkpoint resumed from), the records of later steps are
    dropped from the file first (:func:`drop_after_step`) and TensorBoard's are purged, so each
    step is listed once: the interrupted run's records up to ``resume_step``, then the resumed
    run's.
    """

    def __init__(
        self,
        path: str | os.PathLike | None,
        enabled: bool = True,
        append: bool = False,
        tensorboard_dir: str | os.PathLike | None = None,
        resume_step: int | None = None,
    ):
        self.enabled = enabled
        self._file = None
        self._tb = None
        self.dropped = 0
        """Records of steps after ``resume_step`` dropped from the file."""
        if enabled and path is not None:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            if append and resume_step is not None:
                self.dropped = drop_after_step(path, resume_step)
                if self.dropped:
                    print(
                        f"{path}: dropped {self.dropped} records after step {resume_step} "
                        "(the interrupted run logged them past its last checkpoint; this run logs them again)",
                        flush=True,
                    )
            self._file = open(path, "a" if append else "w", buffering=1)
        if enabled and tensorboard_dir is not None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise ValueError("--tensorboard-dir needs the tensorboard package: pip install tensorboard") from None
            purge = resume_step + 1 if append and resume_step is not None else None
            self._tb = SummaryWriter(log_dir=str(tensorboard_dir), purge_step=purge)

    def write_header(self, env: dict[str, str], config: dict, **extra) -> None:
        """The first line of this run's part of the file: its environment and options."""
        if self.enabled and self._file is not None:
            self._file.write(json.dumps({"kind": "header", "env": env, "config": config, **extra}) + "\n")

    def write_summary(self, summary: dict) -> None:
        if self.enabled and self._file is not None:
            self._file.write(json.dumps({"kind": "summary", **summary}) + "\n")

    def write(self, record: StepRecord, **extra) -> None:
        if not self.enabled:
            return
        print(format_record(record), flush=True)
        if self._file is not None:
            self._file.write(json.dumps({**asdict(record), **extra}) + "\n")
        if self._tb is not None:
            for name in ("loss", "lr", "grad_norm", "seq_per_s", "tokens_per_s", "mfu", "device_peak_bytes"):
                if getattr(record, name) is not None:
                    self._tb.add_scalar(f"train/{name}", getattr(record, name), record.step)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
