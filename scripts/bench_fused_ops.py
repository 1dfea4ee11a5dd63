"""Saved bytes and forward + backward time of ``fused_ops.rms_norm`` / ``swiglu`` / ``masked_softmax``
against the plain expressions.

Two parts: the ops alone (``--part ops``; RMSNorm and SwiGLU) and one whole ``LlamaDecoderLayer``
(``--part layer``; all three)::

    python scripts/bench_fused_ops.py                    # both, CPU
    python scripts/bench_fused_ops.py --part layer --layer-dtype bf16 --layer-iters 11
    python scripts/bench_fused_ops.py --part ops --iters 50 --device cuda

**Ops.** Shapes are one TP rank's at Llama-2 7B, seq 4096, TP 8, sequence parallel, bf16:

- RMSNorm: x ``[seq/tp, 1, hidden]`` = ``[512, 1, 4096]``, weight ``[4096]`` (bf16, as the bf16
  model builds it, and fp32).
- SwiGLU: gate and up ``[seq, 1, intermediate/tp]`` = ``[4096, 1, 1376]`` (the MLP runs on the
  gathered sequence).

Saved bytes: the distinct storages kept for backward (``SavedTensorRecorder``, the weight left
out: it is a parameter). Time: forward + backward, the variants taking turns every iteration so
drift hits them alike, best of ``--iters`` after ``--warmup`` (interference only adds time, so
the minimum is the stable estimate); medians beside. Ratios are fused / plain.

**Layer.** One ``LlamaDecoderLayer`` at TP 1 (default seq 1024, hidden 2048, ffn 5504, 16 heads,
batch 1; fp32 and bf16 parameters and activations), forward + backward of the layer from a
``[s, 1, h]`` input, in three variants taking turns every iteration (in rotating order): as
built (all fused), with ``SwiGLU.forward`` patched to the plain ``F.silu(gate) * up``, with
``RMSNorm.forward`` patched to the plain expression, and with the attention's ``masked_softmax``
patched to the expression it replaced (in-place mask, ``softmax(dtype=fp32)``, cast; it keeps the
fp32 softmax too and backpropagates through the mask) (the patches are undone after each
step). Per variant: the bytes
the layer keeps for backward (parameters, rotary tables and the shared causal mask left out;
the analytic model's figure beside, which describes the fused layer) and the step time; ratios
fused / plain, best of ``--layer-iters``, medians beside. The plain SwiGLU keeps ``silu(gate)``
besides gate and up (``w·s·f`` bytes more); the fused one recomputes it in backward (one
elementwise pass over ``[s, f]``).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from unittest import mock

import torch
import torch.nn.functional as F

from neuron_ckpt.memory.measure import SavedTensorRecorder
from neuron_ckpt.parallel.fused_ops import rms_norm, swiglu

EPS = 1e-5


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--intermediate", type=int, default=11008)
    p.add_argument("--tp", type=int, default=8)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--part", choices=["ops", "layer", "all"], default="all")
    p.add_argument("--layer-seq", type=int, default=1024)
    p.add_argument("--layer-hidden", type=int, default=2048)
    p.add_argument("--layer-ffn", type=int, default=5504)
    p.add_argument("--layer-heads", type=int, default=16)
    p.add_argument("--layer-dtype", choices=["fp32", "bf16", "both"], default="both")
    p.add_argument("--layer-iters", type=int, default=7, help="a layer step takes seconds on CPU")
    a = p.parse_args()
    for name in (
        "seq",
        "hidden",
        "intermediate",
        "tp",
        "iters",
        "layer_seq",
        "layer_hidden",
        "layer_ffn",
        "layer_heads",
        "layer_iters",
    ):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    if a.warmup < 0 or a.threads < 0:
        p.error("--warmup and --threads must be >= 0")
    if a.seq % a.tp or a.intermediate % a.tp:
        p.error(f"--tp ({a.tp}) must divide --seq ({a.seq}) and --intermediate ({a.intermediate})")
    if a.layer_hidden % a.layer_heads:
        p.error(f"--layer-heads ({a.layer_heads}) must divide --layer-hidden ({a.layer_hidden})")
    return a


def plain_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = EPS) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def plain_swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def saved_bytes(fn, inputs: list[torch.Tensor], exclude: list[torch.Tensor]) -> int:
    leaves = [t.detach().requires_grad_() for t in inputs]
    with SavedTensorRecorder(exclude_tensors=exclude) as rec:
        out = fn(*leaves)  # kept alive until the recorder exits: its graph holds the saves
    del out
    return rec.total_bytes


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, inputs: list[torch.Tensor], grad: torch.Tensor, device: torch.device) -> float:
    leaves = [t.detach().requires_grad_() for t in inputs]
    sync(device)
    t0 = time.perf_counter()
    fn(*leaves).backward(grad)
    sync(device)
    return time.perf_counter() - t0


def bench_ops(a: argparse.Namespace, device: torch.device) -> None:
    g = torch.Generator().manual_seed(0)

    def randn(*shape: int, dtype=torch.bfloat16) -> torch.Tensor:
        return torch.randn(shape, generator=g).to(device, dtype)

    x = randn(a.seq // a.tp, 1, a.hidden)
    gate, up = randn(a.seq, 1, a.intermediate // a.tp), randn(a.seq, 1, a.intermediate // a.tp)
    cases = {}
    for wdtype in (torch.bfloat16, torch.float32):
        w = (1 + 0.1 * randn(a.hidden, dtype=torch.float32)).to(wdtype)
        dy = randn(*x.shape, dtype=torch.promote_types(x.dtype, wdtype))
        name = f"rms_norm x{list(x.shape)} bf16, weight {str(wdtype)[6:]}"
        cases[name] = ((lambda x, w: rms_norm(x, w, EPS)), plain_rms_norm, [x, w], dy, [w])
    name = f"swiglu gate/up {list(gate.shape)} bf16"
    cases[name] = (swiglu, plain_swiglu, [gate, up], randn(*gate.shape), [])

    times = {(k, v): [] for k in cases for v in ("fused", "plain")}
    for it in range(a.warmup + a.iters):
        for k, (fused, plain, inputs, dy, _) in cases.items():
            for v, fn in (("fused", fused), ("plain", plain)):
                dt = timed(fn, inputs, dy, device)
                if it >= a.warmup:
                    times[(k, v)].append(dt)

    print(
        f"ops: device={device} threads={torch.get_num_threads()} iters={a.iters} (+{a.warmup} warmup) "
        f"torch {torch.__version__}"
    )
    for k, (fused, plain, inputs, _, exclude) in cases.items():
        fb, pb = saved_bytes(fused, inputs, exclude), saved_bytes(plain, inputs, exclude)
        best = {v: min(times[(k, v)]) for v in ("fused", "plain")}
        med = {v: statistics.median(times[(k, v)]) for v in ("fused", "plain")}
        print(k)
        print(f"  saved for backward   fused {fb / 2**20:7.2f} MiB   plain {pb / 2**20:7.2f} MiB   ratio {fb / pb:.3f}")
        print(
            f"  fwd+bwd best         fused {best['fused'] * 1e3:7.2f} ms    plain {best['plain'] * 1e3:7.2f} ms    "
            f"ratio {best['fused'] / best['plain']:.3f}  (medians {med['fused'] / med['plain']:.3f})"
        )


def plain_masked_softmax(scores: torch.Tensor, mask: torch.Tensor, fill: float) -> torch.Tensor:
    """What ``CoreAttention`` ran before ``masked_softmax``: mask in place, fp32 softmax, cast."""
    return torch.softmax(scores.masked_fill_(mask, fill), dim=-1, dtype=torch.float32).to(scores.dtype)


def layer_variants():
    """Name -> context manager factory: the layer as built, then each fused op swapped for its expression."""
    from neuron_ckpt.models.llama import SwiGLU
    from neuron_ckpt.parallel import RMSNorm, attention

    def swiglu_forward(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return plain_swiglu(gate, up)

    def rms_norm_forward(self, x: torch.Tensor) -> torch.Tensor:
        return plain_rms_norm(x, self._param(self.weight), self.eps)

    return {
        "fused (as built)": contextlib.nullcontext,
        "plain swiglu": lambda: mock.patch.object(SwiGLU, "forward", swiglu_forward),
        "plain rms_norm": lambda: mock.patch.object(RMSNorm, "forward", rms_norm_forward),
        "plain softmax": lambda: mock.patch.object(attention, "masked_softmax", plain_masked_softmax),
    }


def bench_layer(a: argparse.Namespace, device: torch.device, dtype_name: str) -> None:
    from neuron_ckpt.memory import ModelShape, TrainingSetup, layer_activation_bytes
    from neuron_ckpt.models.llama import LlamaArgs, LlamaDecoderLayer, LlamaOptions
    from neuron_ckpt.models.rotary import RotaryEmbedding
    from neuron_ckpt.parallel.attention import causal_mask

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    s, h = a.layer_seq, a.layer_hidden
    args = LlamaArgs(
        vocab_size=32000,
        hidden_size=h,
        intermediate_size=a.layer_ffn,
        num_hidden_layers=1,
        num_attention_heads=a.layer_heads,
        max_position_embeddings=s,
    )
    torch.manual_seed(0)
    layer = LlamaDecoderLayer(args, LlamaOptions(dtype=dtype)).to(device).train()
    cos, sin = RotaryEmbedding(args).to(device)(s, dtype, device)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(s, 1, h, generator=g).to(device, dtype)
    dy = torch.randn(s, 1, h, generator=g).to(device, dtype)
    variants = layer_variants()

    def step(leaf: torch.Tensor) -> torch.Tensor:
        return layer(leaf, cos, sin)

    saved = {}
    exclude = [*layer.parameters(), cos, sin, causal_mask(s, device)]
    for name, context in variants.items():
        with context():
            saved[name] = saved_bytes(step, [x], exclude)
    times = {name: [] for name in variants}
    names = list(variants)
    for it in range(a.warmup + a.layer_iters):
        for name in names[it % len(names) :] + names[: it % len(names)]:  # rotate the order too
            layer.zero_grad(set_to_none=True)
            with variants[name]():
                dt = timed(step, [x], dy, device)
            if it >= a.warmup:
                times[name].append(dt)
    setup = TrainingSetup(s, 1, tp=1, dtype=dtype_name, sequence_parallel=False)
    analytic = layer_activation_bytes(ModelShape.from_llama(args), setup, "none")
    best = {k: min(v) for k, v in times.items()}
    med = {k: statistics.median(v) for k, v in times.items()}
    print(
        f"layer: LlamaDecoderLayer seq={s} hidden={h} ffn={a.layer_ffn} heads={a.layer_heads} batch=1 tp=1 "
        f"{dtype_name}, device={device} threads={torch.get_num_threads()} iters={a.layer_iters} "
        f"(+{a.warmup} warmup)"
    )
    fused = "fused (as built)"
    for name in variants:
        print(
            f"  {name:17s} saved {saved[name] / 2**20:8.2f} MiB   fwd+bwd best {best[name] * 1e3:8.1f} ms   "
            f"median {med[name] * 1e3:8.1f} ms"
        )
    print(f"  analytic model (fused layer): {analytic / 2**20:.2f} MiB")
    for name in variants:
        if name != fused:
            print(
                f"  fused / {name:15s} saved {saved[fused] / saved[name]:.3f}   time {best[fused] / best[name]:.3f} "
                f"(medians {med[fused] / med[name]:.3f})"
            )


def main() -> None:
    a = parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    device = torch.device(a.device)
    if a.part in ("ops", "all"):
        bench_ops(a, device)
    if a.part in ("layer", "all"):
        import neuron_ckpt as nc

        nc.initialize_model_parallel(1)  # the layer's parallel state: one rank
        try:
            for dtype_name in ("fp32", "bf16") if a.layer_dtype == "both" else (a.layer_dtype,):
                bench_layer(a, device, dtype_name)
        finally:
            nc.destroy_distributed()


if __name__ == "__main__":
    main()
