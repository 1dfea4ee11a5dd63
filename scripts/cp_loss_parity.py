"""``train.py --cp 2`` against ``--cp 1``: the losses of every attention x recompute x TP configuration.

One 4-rank LocalWorld (gloo), the tutorial's own ``train.py`` ``main`` on a tiny Llama (the test
suite's: 2 layers, 4 heads, 2 kv heads, 16-token blocks), fp32, the same seed (every full weight is
drawn from it, so both runs start from the same weights) and data, ``--steps`` optimizer steps of
8 sequences. For each configuration it prints the largest relative difference of the logged losses
between CP 2 and CP 1 (the target: below 1e-5, fp32 summation order)::

    python scripts/cp_loss_parity.py              # 2 attentions x 4 recomputes x (TP 1, TP 2 + SP)
    python scripts/cp_loss_parity.py --steps 6

Recomputes: none, selective (core attention: its rerun is the second all-gather of K and V),
selective of the norms and SwiGLU too (output-discarding recompute around the CP attention), full.
tests/test_context_parallel.py runs four of these configurations.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECOMPUTES = {
    "none": ["--recompute", "none"],
    "selective": ["--recompute", "selective"],
    "selective+norm+act": ["--recompute", "selective", "--recompute-modules", "core_attn,norm,mlp_act"],
    "full": ["--recompute", "full"],
}
LAYOUTS = {"tp1": ["--tp", "1"], "tp2+sp": ["--tp", "2", "--sequence-parallel"]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=4)
    a = p.parse_args(argv)
    sys.path.insert(0, str(REPO))
    from neuron_ckpt.distributed.local import LocalWorld
    from tests.tutorial_run import tiny_run_files, train

    with tempfile.TemporaryDirectory() as tmp, LocalWorld(4, timeout_s=900) as world:
        common = tiny_run_files(Path(tmp)) + [
            "--global-batch-size", "8", "--max-steps", str(a.steps), "--warmup-steps", "1", "--lr", "1e-2",
            "--dtype", "fp32",
        ]  # fmt: skip
        rows = []
        for layout, layout_args in LAYOUTS.items():
            for attention in ("explicit", "flash"):
                for recompute, recompute_args in RECOMPUTES.items():
                    argv_ = common + layout_args + ["--attention", attention] + recompute_args
                    one, two = (world.run(train, argv_ + ["--cp", c])[0]["losses"] for c in ("1", "2"))
                    diff = max(abs(x - y) / abs(y) for x, y in zip(two, one))
                    rows.append((layout, attention, recompute, one[0], one[-1], diff))
    print(f"train.py --cp 2 vs --cp 1, {a.steps} steps, 4 gloo ranks, tiny Llama fp32 (DP = 4 / (TP x CP))")
    print(f"{'layout':<8}{'attention':<10}{'recompute':<20}{'loss first':>11}{'loss last':>11}{'max rel diff':>14}")
    for layout, attention, recompute, first, last, diff in rows:
        print(f"{layout:<8}{attention:<10}{recompute:<20}{first:>11.5f}{last:>11.5f}{diff:>14.2e}")
    worst = max(r[-1] for r in rows)
    print(f"worst: {worst:.2e} (target < 1e-5)")
    return 0 if worst < 1e-5 else 1


if __name__ == "__main__":
    raise SystemExit(main())
