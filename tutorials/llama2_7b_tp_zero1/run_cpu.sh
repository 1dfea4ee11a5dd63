#!/usr/bin/env bash
# The tutorial end to end on one CPU host: tiny Llama, gloo, TP 2 x DP 2 (4 processes), sequence
# parallel, selective recompute, ZeRO-1. About 2 minutes on 2 cores. Re-running resumes from the
# last checkpoint (delete $OUT to start over). Override any option by appending it:
#   ./run_cpu.sh --max-steps 50 --recompute full --recompute-method uniform --recompute-num-layers 2
set -euo pipefail
cd "$(dirname "$0")"
# Set up (or reuse) the repo's .venv unless the caller brings their own interpreter.
if [ -z "${PYTHON:-}" ]; then
  bash ../../scripts/setup.sh
  PYTHON=../../.venv/bin/python
fi
TORCHRUN=${TORCHRUN:-"$PYTHON -m torch.distributed.run"}
DATA=${DATA:-../../data/tiny_train.safetensors}  # the repo-root data/ and runs/ are git-ignored
OUT=${OUT:-../../runs/cpu_tiny}
SEQ_LEN=128

if [ ! -f "$DATA" ]; then
  echo "== preparing $DATA (Shakespeare, 32k Llama-style tokenizer, $SEQ_LEN-token blocks)"
  "$PYTHON" prepare_data.py --seq-len "$SEQ_LEN" --output "$DATA" --val-fraction 0.01 --no-progress
fi

mkdir -p "$OUT"
start=$(date +%s)
$TORCHRUN --standalone --nproc_per_node 4 train.py \
  --model-config configs/tiny.json --data "$DATA" \
  --tp 2 --sequence-parallel --recompute selective --dtype fp32 \
  --micro-batch-size 2 --global-batch-size 8 \
  --lr 2e-3 --min-lr-ratio 0.1 --warmup-steps 10 --max-steps 120 --weight-decay 0.1 --grad-clip 1.0 \
  --checkpoint-dir "$OUT/checkpoints" --checkpoint-every 50 --keep-last 2 --resume latest \
  --metrics-file "$OUT/metrics.jsonl" "$@"
end=$(date +%s)

"$PYTHON" - "$OUT/metrics.jsonl" "$((end - start))" "$OUT/loss.png" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
rows = [r for r in rows if "kind" not in r]  # the step records (not the header / summary lines)
if not rows:
    sys.exit("no steps were run (already finished? delete the output directory to start over)")
steady = rows[1:] or rows
mean = lambda k, rs: sum(r[k] for r in rs) / len(rs)
print(f"== summary: {len(rows)} steps | loss {rows[0]['loss']:.3f} -> {rows[-1]['loss']:.3f} | "
      f"{mean('tokens_per_s', steady):.0f} tokens/s | {mean('seq_per_s', steady):.2f} seq/s | "
      f"MFU {100 * mean('mfu', steady):.2f}% (of the --peak-tflops guess) | wall {sys.argv[2]} s")
# The loss curve: mean loss over each tenth of the run, as a bar per tenth.
tenth = max(1, len(rows) // 10)
chunks = [rows[i:i + tenth] for i in range(0, len(rows), tenth)]
top = max(mean("loss", c) for c in chunks)
for c in chunks:
    loss = mean("loss", c)
    print(f"   steps {c[0]['step']:4d}-{c[-1]['step']:<4d} loss {loss:6.3f} {'#' * round(40 * loss / top)}")
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
fig, ax = plt.subplots(figsize=(6, 3.5))
ax.plot([r["step"] for r in rows], [r["loss"] for r in rows])
ax.set(xlabel="step", ylabel="training loss", title="tiny Llama, TP 2 x DP 2, CPU")
fig.tight_layout()
fig.savefig(sys.argv[3], dpi=100)
print(f"   loss curve: {sys.argv[3]}")
PY
