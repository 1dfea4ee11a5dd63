#!/usr/bin/env bash
# The tutorial end to end on one CPU host: tiny Llama, gloo, TP 2 x DP 2 (4 processes), sequence
# parallel, selective recompute, ZeRO-1. About 2 minutes on 2 cores. Re-running resumes from the
# last checkpoint (delete $OUT to start over). Override any option by appending it:
#   ./run_cpu.sh --max-steps 50 --recompute full --recompute-method uniform --recompute-num-layers 2
# PP_DEGREE=2 runs TP 2 x PP 2 on the same 4 processes (DP 1): each step's 4 micro-batches (global batch
# 8 / micro-batch 2 / DP 1) go through two pipeline stages (train.py --pp 2), 1F1B unless PP_SCHEDULE
# names another (gpipe, interleaved: train.py --pp-schedule). Its OUT is a directory of its own, so a
# resume never mixes two layouts.
#   PP_DEGREE=2 ./run_cpu.sh
#   PP_DEGREE=2 PP_SCHEDULE=gpipe ./run_cpu.sh --recompute full
set -euo pipefail
cd "$(dirname "$0")"
# Set up (or reuse) the repo's .venv unless the caller brings their own interpreter.
if [ -z "${PYTHON:-}" ]; then
  bash ../../scripts/setup.sh
  PYTHON=../../.venv/bin/python
fi
TORCHRUN=${TORCHRUN:-"$PYTHON -m torch.distributed.run"}
PP_DEGREE=${PP_DEGREE:-1}
PP_SCHEDULE=${PP_SCHEDULE:-}
case $PP_DEGREE in
  1) PP_ARGS=() LAYOUT="TP 2 x DP 2" RUN_NAME=cpu_tiny ;;
  2) PP_ARGS=(--pp 2) LAYOUT="TP 2 x PP 2 (${PP_SCHEDULE:-1f1b})" RUN_NAME=cpu_tiny_pp2 ;;
  *) echo "run_cpu.sh: PP_DEGREE must be 1 or 2 (TP 2 on 4 processes), got '$PP_DEGREE'" >&2; exit 2 ;;
esac
if [ -n "$PP_SCHEDULE" ]; then
  [ "$PP_DEGREE" -gt 1 ] || { echo "run_cpu.sh: PP_SCHEDULE applies only with PP_DEGREE=2" >&2; exit 2; }
  PP_ARGS+=(--pp-schedule "$PP_SCHEDULE")
  # Interleaved stages put other layers on each rank than GPipe and 1F1B do: another checkpoint layout.
  [ "$PP_SCHEDULE" != interleaved ] || RUN_NAME+=_interleaved
fi
DATA=${DATA:-../../data/tiny_train.safetensors}  # the repo-root data/ and runs/ are git-ignored
OUT=${OUT:-../../runs/$RUN_NAME}
SEQ_LEN=128

if [ ! -f "$DATA" ]; then
  echo "== preparing $DATA (Shakespeare, 32k Llama-style tokenizer, $SEQ_LEN-token blocks)"
  "$PYTHON" prepare_data.py --seq-len "$SEQ_LEN" --output "$DATA" --val-fraction 0.01 --no-progress
fi

mkdir -p "$OUT"
start=$(date +%s)
$TORCHRUN --standalone --nproc_per_node 4 train.py \
  --model-config configs/tiny.json --data "$DATA" \
  --tp 2 ${PP_ARGS[@]+"${PP_ARGS[@]}"} --sequence-parallel --recompute selective --dtype fp32 \
  --micro-batch-size 2 --global-batch-size 8 \
  --lr 2e-3 --min-lr-ratio 0.1 --warmup-steps 10 --max-steps 120 --weight-decay 0.1 --grad-clip 1.0 \
  --checkpoint-dir "$OUT/checkpoints" --checkpoint-every 50 --keep-last 2 --resume latest \
  --metrics-file "$OUT/metrics.jsonl" "$@"
end=$(date +%s)

"$PYTHON" - "$OUT/metrics.jsonl" "$((end - start))" "$OUT/loss.png" "$LAYOUT" <<'PY'
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
ax.set(xlabel="step", ylabel="training loss", title=f"tiny Llama, {sys.argv[4]}, CPU")
fig.tight_layout()
fig.savefig(sys.argv[3], dpi=100)
print(f"   loss curve: {sys.argv[3]}")
PY
