"""XLA:CPU's own figure for one decoder layer: the compiler's buffer assignment of a training step.

In ONE process, at world size 1 on XLA:CPU (``PJRT_DEVICE=CPU``), with XLA's dumps switched on
before torch_xla is imported, for each recompute preset P and layer count N: build the tutorial's
tiny Llama (``tutorials/llama2_7b_tp_zero1/configs/tiny.json``) with N layers, explicit attention,
apply P as the tutorial does (``RecomputeConfig.preset(P)`` + ``apply_recompute``), run forward and
backward of the LM loss on one ``[1, 256]`` batch and compile that as one graph
(``torch_xla.sync()`` after backward). The optimizer step is NOT in the graph: the weights are the
graph's parameters, the gradients its outputs. That graph's buffer assignment is copied to
``OUT/P_LN/buffer-assignment.txt``, beside ``OUT/config.json`` and ``OUT/manifest.json`` (a
capture ``neuron-ckpt compare --capture OUT`` reads). Then it prints, per preset, the
least-squares slope over N of ``temp`` (:mod:`neuron_ckpt.memory.readers.xla_buffers`) and of
``live_at_peak`` less ``parameters`` next to ``layer_activation_bytes``, and the control: the
slope of ``parameters`` must equal one layer's weights exactly (exit status 1 otherwise).

    PJRT_DEVICE=CPU python scripts/xla_memory_slope.py --out /tmp/xla_capture [--dtype fp32]

The causal mask is materialised once before the first run, so every graph takes it as a
parameter, as a training loop does from its second step. Flash attention is not captured: NxD's
NKI kernel is Neuron-only and on XLA:CPU ``CoreAttention`` falls back to explicit attention.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import sys
import tempfile
from fractions import Fraction
from importlib.util import find_spec
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from neuron_ckpt.memory import ModelShape, TrainingSetup, layer_activation_bytes  # noqa: E402
from neuron_ckpt.memory.capture import Run, write_capture  # noqa: E402
from neuron_ckpt.memory.readers import xla_buffers  # noqa: E402
from neuron_ckpt.recompute import PRESETS  # noqa: E402

CONFIG = ROOT / "tutorials" / "llama2_7b_tp_zero1" / "configs" / "tiny.json"
SEQ, MICRO_BATCH = 256, 1
DTYPES = ("bf16", "fp32")
FILE = "buffer-assignment.txt"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="a new (or empty) directory for the capture")
    p.add_argument("--layers", default="1,2,3,4", help="comma-separated decoder layer counts (two or more)")
    p.add_argument("--presets", default=",".join(PRESETS), help=f"comma-separated, of {', '.join(PRESETS)}")
    p.add_argument("--dtype", default="bf16", choices=DTYPES)
    args = p.parse_args(argv)
    try:
        args.layers = sorted({int(n) for n in args.layers.split(",")})
    except ValueError:
        p.error(f"--layers: expected comma-separated integers, got {args.layers!r}")
    if len(args.layers) < 2 or args.layers[0] < 1:
        p.error(f"--layers: need two or more different positive layer counts, got {args.layers}")
    args.presets = list(dict.fromkeys(x for x in args.presets.split(",") if x))
    unknown = [x for x in args.presets if x not in PRESETS]
    if unknown or not args.presets:
        p.error(f"--presets: expected some of {', '.join(PRESETS)}, got {unknown or 'none'}")
    return args


def slope(points: list[tuple[int, int]]) -> Fraction:
    """Least-squares bytes per layer of ``(layers, bytes)`` points, exactly."""
    mx, my = Fraction(sum(x for x, _ in points), len(points)), Fraction(sum(y for _, y in points), len(points))
    return sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)


def capture(args: argparse.Namespace, out: Path, dump: Path) -> tuple[list[Run], str]:
    """Compile every (preset, layers) step with the dump on; copy each one's buffer assignment."""
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm

    import neuron_ckpt as nc
    from neuron_ckpt.models import LlamaForCausalLM, load_llama_config
    from neuron_ckpt.parallel.attention import causal_mask
    from neuron_ckpt.recompute import RecomputeConfig, apply_recompute

    rt = nc.init_distributed()
    nc.initialize_model_parallel(1)
    if rt.world_size != 1 or rt.device.type != "xla":
        raise SystemExit(f"xla_memory_slope.py: needs XLA at world size 1, got {rt.device} x {rt.world_size}")
    config = load_llama_config(CONFIG)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    causal_mask(SEQ, rt.device)  # device data from here on: a parameter of every graph below
    torch_xla.sync()
    runs = []
    for preset in args.presets:
        for layers in args.layers:
            cfg = dataclasses.replace(config, num_hidden_layers=layers)
            torch.manual_seed(0)
            model = LlamaForCausalLM(cfg, False, "explicit", dtype)
            apply_recompute(model, RecomputeConfig.preset(preset))
            model.to(rt.device)
            ids = torch.randint(0, cfg.vocab_size, (MICRO_BATCH, SEQ), generator=torch.Generator().manual_seed(1))
            ids = ids.to(rt.device)
            torch_xla.sync()
            xm.wait_device_ops()
            before = set(dump.glob(f"*{FILE}"))
            model(ids, labels=ids).loss.backward()
            torch_xla.sync()  # the step: forward + backward, one graph (no optimizer)
            xm.wait_device_ops()
            new = sorted(set(dump.glob(f"*{FILE}")) - before)
            if len(new) != 1:
                raise SystemExit(
                    f"xla_memory_slope.py: {preset} L{layers}: expected one compiled graph, "
                    f"XLA dumped {len(new)}: {[p.name for p in new]}"
                )
            rel = f"{preset}_L{layers}/{FILE}"
            (out / rel).parent.mkdir()
            shutil.copyfile(new[0], out / rel)
            for p in dump.iterdir():  # LLVM IR and objects too: megabytes per graph
                shutil.rmtree(p) if p.is_dir() else p.unlink()
            runs.append(Run(layers, preset, "explicit", {"xla_buffers": rel}))
            print(f"captured {rel}", flush=True)
            del model, ids
    nc.destroy_distributed()
    return runs, f"torch {torch.__version__}, torch-xla {torch_xla.__version__}"


def report(out: Path, runs: list[Run], dtype: str) -> bool:
    """Print the table; True when the control holds for every preset."""
    from neuron_ckpt.models import load_llama_config

    model = ModelShape.from_llama(load_llama_config(CONFIG))
    setup = TrainingSetup(
        seq_len=SEQ,
        micro_batch=MICRO_BATCH,
        tp=1,
        dtype=dtype,
        sequence_parallel=False,
        zero1=False,
        attention="explicit",
    )
    one, two = (dataclasses.replace(model, layers=n).local_parameters(1) for n in (1, 2))
    weights = (two - one) * setup.width
    readings = {(r.recompute, r.layers): xla_buffers.read(out / r.files["xla_buffers"]).core(0) for r in runs}
    layers = sorted({r.layers for r in runs})
    presets = list(dict.fromkeys(r.recompute for r in runs))
    print(
        f"\nXLA:CPU buffer assignment per decoder layer: tiny Llama (h {model.hidden}, heads {model.heads}/"
        f"{model.kv_heads}, ffn {model.ffn}, vocab {model.vocab}), seq {SEQ}, micro-batch {MICRO_BATCH}, "
        f"{dtype}, explicit attention, layers {','.join(map(str, layers))}; bytes per layer (least-squares slope)"
    )
    print(f"{'preset':<18} {'temp':>11} {'peak-params':>11} {'analytic':>11} {'temp/an.':>9} {'peak/an.':>9}")
    ok = True
    controls = []
    for preset in presets:

        def per_layer(category: str, preset: str = preset) -> float:  # this preset's, bound
            return float(slope([(n, readings[preset, n][category]) for n in layers]))

        temp, params, outputs = per_layer("temp"), per_layer("parameters"), per_layer("outputs")
        peak = per_layer("live_at_peak") - params if "live_at_peak" in readings[preset, layers[0]] else float("nan")
        analytic = layer_activation_bytes(model, setup, preset)
        print(
            f"{preset:<18} {temp:>11,.0f} {peak:>11,.0f} {analytic:>11,} {temp / analytic:>8.2f}x "
            f"{peak / analytic:>8.2f}x"
        )
        ok &= params == weights
        controls.append(
            f"{preset:<18} {params:>11,.0f} {'OK' if params == weights else 'FAIL':>4} "
            f"{outputs:>11,.0f} {outputs / weights:>7.3f}x"
        )
    print(f"\ncontrol: analytic weights per layer {weights:,} B; parameters must equal them exactly")
    print(f"{'preset':<18} {'parameters':>11} {'':>4} {'outputs':>11} {'/weights':>8}")
    print("\n".join(controls))
    print(
        "temp: the preallocated temp buffer; peak-params: XLA's live bytes at the schedule's peak less the "
        "parameters; outputs: gradients (and what else torch-xla returns)"
    )
    return ok


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        print(f"xla_memory_slope.py: --out {out} exists and is not an empty directory; give a new one", file=sys.stderr)
        return 2
    if "torch_xla" in sys.modules or os.environ.get("PJRT_DEVICE", "CPU") != "CPU" or not find_spec("torch_xla"):
        print(
            "xla_memory_slope.py: run it in a fresh process of the torch-xla environment (scripts/setup_xla.sh) "
            "with PJRT_DEVICE=CPU or unset",
            file=sys.stderr,
        )
        return 2
    out.mkdir(parents=True, exist_ok=True)
    dump = Path(tempfile.mkdtemp(prefix="xla_dump_"))
    os.environ["PJRT_DEVICE"] = "CPU"
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={dump} --xla_dump_hlo_as_text".strip()
    try:
        runs, versions = capture(args, out, dump)
    finally:
        shutil.rmtree(dump, ignore_errors=True)
    shutil.copyfile(CONFIG, out / "config.json")
    job = {
        "model": "llama",
        "config": "config.json",
        "tp": 1,
        "dp": 1,
        "seq": SEQ,
        "micro_batch": MICRO_BATCH,
        "dtype": args.dtype,
        "sequence_parallel": False,
        "zero1": False,
        "attention": "explicit",
    }
    notes = [
        (
            f"XLA:CPU ({versions}), world size 1: each run is one compiled graph, forward + backward of the LM loss "
            "(torch_xla.sync() after backward); the optimizer step is not in it. Weights are its parameters, "
            "gradients its outputs."
        ),
        (
            "flash attention not captured: NxD's NKI flash kernel runs on Neuron only; on XLA:CPU CoreAttention "
            "falls back to explicit attention (with a warning), so a flash run here would be an explicit one."
        ),
        "the causal mask was materialised before the first run: every graph takes it as a parameter.",
        (
            "XLA:CPU removes optimization barriers before scheduling (cse_barrier_expander), so the recompute "
            "that activation checkpoints add can be scheduled into the forward here."
        ),
    ]
    write_capture(out, job, runs, notes)
    return 0 if report(out, runs, args.dtype) else 1


if __name__ == "__main__":
    sys.exit(main())
