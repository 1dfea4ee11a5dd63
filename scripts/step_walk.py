"""Which files one training step walks through, measured: the repository's files (neuron_ckpt/
and the tutorial) that run while the tutorial's ``fit`` runs, and the distinct calls from one of
them into another (a call that passes through torch counts from the last repository frame).

One process (TP 1 x DP 1, gloo), the tiny config, bf16, selective recompute, 2 steps with a
checkpoint after each, so the walk holds the batch, forward, loss, backward (autograd calls our
Functions from the frame that called ``backward``), the ZeRO-1 step with its fp32 gradient
buffer, metrics and the save. docs/one_step.md gives the walk in reading order::

    python scripts/step_walk.py            # files and the count of cross-file calls
    python scripts/step_walk.py --edges    # each caller -> callee pair, with how often it ran
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import tempfile
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TUTORIAL = REPO / "tutorials" / "llama2_7b_tp_zero1"
sys.path[:0] = [str(REPO), str(TUTORIAL)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def walk(out: Path) -> tuple[Counter, Counter]:
    """(calls per file, calls per (caller file, callee file)) while ``fit`` runs."""
    import numpy as np

    import neuron_ckpt as nc
    from neuron_ckpt.data import write_packed

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))  # fmt: skip
    data = write_packed(out / "train.safetensors", np.random.default_rng(0).integers(0, 32000, (16, 64)),
                        vocab_size=32000, tokenizer="random")  # fmt: skip
    import train

    files: Counter = Counter()
    edges: Counter = Counter()
    depth = [0]
    root = str(REPO)

    def ours(path: str) -> bool:
        return path.startswith(root) and "/.venv/" not in path

    def profile(frame, event, arg):
        code = frame.f_code
        is_fit = code.co_name == "fit" and code.co_filename.endswith("train/loop.py")
        if is_fit and event in ("call", "return"):
            depth[0] += 1 if event == "call" else -1
        if event != "call" or not depth[0] or not ours(code.co_filename):
            return
        callee = os.path.relpath(code.co_filename, root)
        files[callee] += 1
        back = frame.f_back
        while back is not None and not ours(back.f_code.co_filename):
            back = back.f_back  # through torch: the repository frame that led here
        if back is not None and back.f_code.co_filename != code.co_filename:
            edges[(os.path.relpath(back.f_code.co_filename, root), callee)] += 1

    argv = ["--model-config", str(TUTORIAL / "configs/tiny.json"), "--data", str(data), "--tp", "1",
            "--recompute", "selective", "--dtype", "bf16", "--micro-batch-size", "2", "--global-batch-size", "4",
            "--max-steps", "2", "--checkpoint-dir", str(out / "ckpt"), "--checkpoint-every", "1"]  # fmt: skip
    sys.setprofile(profile)
    try:
        train.main(argv)
    finally:
        sys.setprofile(None)
        nc.destroy_distributed()
    return files, edges


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--edges", action="store_true", help="print every caller -> callee pair")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        files, edges = walk(Path(tmp))
    print(f"files on the walk: {len(files)}; distinct cross-file calls: {len(edges)}")
    for f in sorted(files):
        print(f"  {f}")
    if args.edges:
        for (a, b), n in sorted(edges.items()):
            print(f"  {a} -> {b}  ({n} calls)")


if __name__ == "__main__":
    main()
