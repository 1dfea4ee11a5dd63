#!/usr/bin/env bash
# Llama-2 7B pretraining on trn1.32xlarge (32 NeuronCore-v2 per node): TP 8 x DP (4 per node),
# sequence parallel, selective recompute, ZeRO-1, bf16, seq 4096, global batch 1024 sequences
# (4M tokens), LR 3e-4 with 100 warmup steps then cosine over 10000 steps.
#
#   ./run_trn1.sh                 # one node; under Slurm (run_slurm.sbatch) every node runs this
#   COMPILE=1 ./run_trn1.sh       # ahead-of-time graph compilation only (neuron_parallel_compile)
#   RECOMPUTE=auto ./run_trn1.sh  # per-layer recompute planned to fit 16 GiB per core (neuron-ckpt plan)
#
# Prepare the data first with your Llama-2 tokenizer and corpus, e.g.
#   python prepare_data.py --tokenizer /path/to/Llama-2-7b-hf --input /path/to/corpus \
#       --seq-len 4096 --output ~/data/llama2_train.safetensors
set -euo pipefail
cd "$(dirname "$0")"

# --- Neuron compiler and runtime ----------------------------------------------------------------
# llm-training: the compiler's transformer-training schedule; the cache makes re-runs skip compiles.
export NEURON_CC_FLAGS="${NEURON_CC_FLAGS:---model-type transformer --distribution-strategy=llm-training --cache_dir=$HOME/neuron_compile_cache/}"
export NEURON_FUSE_SOFTMAX=1
export NEURON_RT_ASYNC_EXEC_MAX_INFLIGHT_REQUESTS=3   # let the host run ahead of the device by 3 steps
export NEURON_RT_STOCHASTIC_ROUNDING_EN=1             # bf16 params: stochastic rounding on update
export MALLOC_ARENA_MAX=64                            # 32 processes x glibc arenas exhaust host memory
# bf16: this script trains with --dtype bf16 (bf16 parameters and activations, fp32 master weights
# and optimizer state inside ZeRO-1). Do NOT also set XLA_USE_BF16=1 or XLA_DOWNCAST_BF16=1: they
# make torch-xla store every fp32 tensor as bf16 on device, including ZeRO-1's fp32 master weights
# and Adam moments (silently losing small updates), and both are deprecated in torch-xla >= 2.5.
unset XLA_USE_BF16 XLA_DOWNCAST_BF16

# --- topology (torchrun) -----------------------------------------------------------------------
PROCESSES_PER_NODE=${PROCESSES_PER_NODE:-32}
NUM_NODES=${SLURM_NNODES:-${NUM_NODES:-1}}
NODE_RANK=${SLURM_NODEID:-${NODE_RANK:-0}}
if [ -n "${SLURM_JOB_NODELIST:-}" ]; then
  MASTER_ADDR=${MASTER_ADDR:-$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)}
  # EFA between nodes (trn1.32xlarge: 8 x 100 Gb/s).
  export FI_PROVIDER=efa FI_EFA_USE_DEVICE_RDMA=1 FI_EFA_FORK_SAFE=1
fi
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-41000}
DISTRIBUTED_ARGS=(--nproc_per_node "$PROCESSES_PER_NODE" --nnodes "$NUM_NODES" --node_rank "$NODE_RANK"
                  --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT")

# --- run ----------------------------------------------------------------------------------------
DATA=${DATA:-$HOME/data/llama2_train.safetensors}
OUT=${OUT:-$HOME/runs/llama2_7b_tp8_zero1}
MAX_STEPS=${MAX_STEPS:-10000}
EXTRA=()
if [ "${COMPILE:-0}" = "1" ]; then
  # neuron_parallel_compile runs the script with NEURON_EXTRACT_GRAPHS_ONLY=1: graphs are traced and
  # compiled in parallel into the cache, results are not real. A few steps trace every graph
  # (forward/backward per micro-batch, the ZeRO-1 step); no checkpoints or metrics.
  LAUNCH=(neuron_parallel_compile torchrun)
  MAX_STEPS=${COMPILE_STEPS:-10}
else
  LAUNCH=(torchrun)
  EXTRA=(--checkpoint-dir "$OUT/checkpoints" --checkpoint-every 500 --keep-last 3 --resume latest
         --metrics-file "$OUT/metrics.jsonl")
  mkdir -p "$OUT"
fi

"${LAUNCH[@]}" "${DISTRIBUTED_ARGS[@]}" train.py \
  --model-config configs/llama2_7b.json --data "$DATA" \
  --tp 8 --sequence-parallel --recompute "${RECOMPUTE:-selective}" --attention explicit --dtype bf16 \
  --micro-batch-size 1 --global-batch-size 1024 \
  --lr 3e-4 --min-lr-ratio 0.1 --warmup-steps 100 --max-steps "$MAX_STEPS" --decay cosine \
  --weight-decay 0.1 --beta1 0.9 --beta2 0.95 --grad-clip 1.0 \
  --device-kind trn1 "${EXTRA[@]}" "$@"
