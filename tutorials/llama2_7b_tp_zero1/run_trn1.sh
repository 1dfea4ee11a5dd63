#!/usr/bin/env bash
# Llama-2 7B pretraining on trn1.32xlarge (32 NeuronCore-v2 per node): TP 8 x DP (4 per node),
# sequence parallel, flash attention (NxD's NKI kernel), ZeRO-1, bf16, seq 4096, global batch 1024 sequences
# (4M tokens), LR 3e-4 with 100 warmup steps then cosine over 10000 steps.
#
#   COMPILE=1 ./run_trn1.sh       # ahead-of-time graph compilation only (neuron_parallel_compile)
#   ./run_trn1.sh                 # train; re-running resumes from the latest checkpoint in $OUT
#   RECOMPUTE=auto ./run_trn1.sh  # per-layer recompute planned to fit 16 GiB per core (neuron-ckpt plan)
#
# No recompute by default: with flash attention there is no s x s tensor for selective recompute to
# drop (it would rerun the kernel to save its fp32 logsumexp; NxD's selective checkpoint skips its
# flash path too), and `neuron-ckpt plan --config llama2-7b --tp 8 --dp 16 --seq 4096 --device-memory
# trn1` puts no recompute at 7.5 of 16 GiB per NeuronCore. train.py prints the attention it runs; where
# the NKI kernel is not importable it runs the explicit attention (12.0 GiB with no recompute, still within the 14.4 GiB the plan allows).
#   DRY_RUN=1 ./run_trn1.sh       # print the environment and the launch command; run nothing
#   ./run_trn1.sh --lr 2e-4       # extra arguments go to train.py, last (they override)
#
# Under Slurm (run_slurm.sbatch) every node runs this script. Settings, all optional: DATA, OUT,
# MAX_STEPS (10000), COMPILE_STEPS (2), RECOMPUTE (none), PROCESSES_PER_NODE (32), NUM_NODES /
# NODE_RANK / MASTER_ADDR / MASTER_PORT (44000) outside Slurm, NEURON_CC_FLAGS.
#
# Prepare the data first with your Llama-2 tokenizer and corpus, e.g.
#   python prepare_data.py --tokenizer /path/to/Llama-2-7b-hf --input /path/to/corpus \
#       --seq-len 4096 --output ~/data/llama2_train.safetensors
set -euo pipefail
cd "$(dirname "$0")"
DRY_RUN=${DRY_RUN:-0}

# --- Neuron compiler and runtime ----------------------------------------------------------------
# NEURON_CC_FLAGS as the AWS NxD reference sets them: aws-neuron/neuronx-distributed,
# examples/training/llama/tp_zero1_llama_hf_pretrain/tp_zero1_llama2_7B_hf_pretrain.sh (commit
# 82a2bb3d; likewise tp_zero1_llama3_8B_hf_pretrain.sh at c63420c5):
#   --model-type transformer --cache_dir=$HOME/neuron_compile_cache/
# An older version of the same script (commit 0598cd8) also had --distribution-strategy=llm-training,
# which the NxD examples dropped (Neuron 2.22 era; NxD Training 1.2.0, Neuron 2.22, removed it from
# its configs except Llama-2's). Neither version passes -O1 or --retry_failed_compilation.
# Unverified: that 82a2bb3d is what the Neuron 2.29 docs point to (commit dates not checked here).
# The cache makes re-runs (and the real run after COMPILE=1) skip compiles.
export NEURON_CC_FLAGS="${NEURON_CC_FLAGS:---model-type transformer --cache_dir=$HOME/neuron_compile_cache/}"
export NEURON_FUSE_SOFTMAX=1
export NEURON_RT_ASYNC_EXEC_MAX_INFLIGHT_REQUESTS=3   # let the host run ahead of the device by 3 steps
export NEURON_RT_STOCHASTIC_ROUNDING_EN=1             # bf16 params: stochastic rounding on update
export MALLOC_ARENA_MAX=64                            # 32 processes x glibc arenas exhaust host memory
ENV_VARS=(NEURON_CC_FLAGS NEURON_FUSE_SOFTMAX NEURON_RT_ASYNC_EXEC_MAX_INFLIGHT_REQUESTS
          NEURON_RT_STOCHASTIC_ROUNDING_EN MALLOC_ARENA_MAX)
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
  MASTER_ADDR=${MASTER_ADDR:-$(scontrol show hostnames "$SLURM_JOB_NODELIST" | awk 'NR == 1')}
  # EFA between nodes (trn1.32xlarge: 8 x 100 Gb/s).
  export FI_PROVIDER=efa FI_EFA_USE_DEVICE_RDMA=1 FI_EFA_FORK_SAFE=1
  ENV_VARS+=(FI_PROVIDER FI_EFA_USE_DEVICE_RDMA FI_EFA_FORK_SAFE)
fi
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
# Rendezvous port and reserved ports as in the NxD reference script above: torchrun --master_port
# 44000 and `sudo sysctl -w net.ipv4.ip_local_reserved_ports=44000,48620`. Reserving a port keeps
# the kernel from handing it out as the ephemeral source port of some outgoing connection (32
# processes per node open many), which would make the rendezvous fail with "address in use". The
# reference does not say what 48620 is for; we reserve it too. A MASTER_PORT override is reserved
# in place of 44000.
MASTER_PORT=${MASTER_PORT:-44000}
RESERVED_PORTS="$MASTER_PORT,48620"
DISTRIBUTED_ARGS=(--nproc_per_node "$PROCESSES_PER_NODE" --nnodes "$NUM_NODES" --node_rank "$NODE_RANK"
                  --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT")

# The kernel's list of reserved ports (tests point this at a file of their own).
PORTS_FILE=${IP_LOCAL_RESERVED_PORTS_FILE:-/proc/sys/net/ipv4/ip_local_reserved_ports}

# Is port $1 in the kernel's reserved list ("44000,48620" or ranges "44000-44010")?
port_reserved() {
  local entry
  local -a entries=()
  IFS=, read -r -a entries 2>/dev/null <"$PORTS_FILE" || return 1
  for entry in ${entries[@]+"${entries[@]}"}; do
    if [ "$1" -ge "${entry%-*}" ] && [ "$1" -le "${entry#*-}" ]; then
      return 0
    fi
  done
  return 1
}

# Add RESERVED_PORTS to net.ipv4.ip_local_reserved_ports (keeping what is there). Needs root or
# passwordless sudo; without them, warn and go on (the run usually works; a collision shows up
# as a rendezvous error).
reserve_ports() {
  local port current want
  local -a missing=() as_root=()
  for port in ${RESERVED_PORTS//,/ }; do
    port_reserved "$port" || missing+=("$port")
  done
  if [ "${#missing[@]}" -eq 0 ]; then
    return 0
  fi
  current=$(cat "$PORTS_FILE" 2>/dev/null || true)
  want=$(IFS=,; echo "${current:+$current,}${missing[*]}")
  if [ "$(id -u)" != 0 ]; then
    as_root=(sudo -n)   # -n: fail instead of prompting for a password
  fi
  if ! ${as_root[@]+"${as_root[@]}"} sysctl -q -w "net.ipv4.ip_local_reserved_ports=$want" >/dev/null 2>&1; then
    echo "run_trn1.sh: warning: could not reserve ports ${missing[*]} (needs root or passwordless sudo);" \
         "continuing. To do it by hand: sudo sysctl -w net.ipv4.ip_local_reserved_ports=$want" >&2
  fi
}

# --- run ----------------------------------------------------------------------------------------
DATA=${DATA:-$HOME/data/llama2_train.safetensors}
OUT=${OUT:-$HOME/runs/llama2_7b_tp8_zero1}
MAX_STEPS=${MAX_STEPS:-10000}
EXTRA=()
if [ "${COMPILE:-0}" = "1" ]; then
  # neuron_parallel_compile runs the script with NEURON_EXTRACT_GRAPHS_ONLY=1: graphs are traced and
  # compiled in parallel into the cache, results are not real. Two steps trace every graph
  # (forward/backward per micro-batch, the ZeRO-1 step), as the NxD reference does (2 steps).
  # --stop-at-step, not a smaller --max-steps: the LR schedule stays that of the real run. No
  # checkpoints or metrics.
  LAUNCH=(neuron_parallel_compile torchrun)
  EXTRA=(--stop-at-step "${COMPILE_STEPS:-2}")
else
  LAUNCH=(torchrun)
  EXTRA=(--checkpoint-dir "$OUT/checkpoints" --checkpoint-every 500 --keep-last 3 --resume latest
         --metrics-file "$OUT/metrics.jsonl")
fi

CMD=("${LAUNCH[@]}" "${DISTRIBUTED_ARGS[@]}" train.py
  --model-config llama2-7b --data "$DATA"
  --tp 8 --sequence-parallel --recompute "${RECOMPUTE:-none}" --dtype bf16
  --micro-batch-size 1 --global-batch-size 1024
  --lr 3e-4 --min-lr-ratio 0.1 --warmup-steps 100 --max-steps "$MAX_STEPS" --decay cosine
  --weight-decay 0.1 --beta1 0.9 --beta2 0.95 --grad-clip 1.0
  --device-kind trn1 ${EXTRA[@]+"${EXTRA[@]}"} "$@")

if [ "$DRY_RUN" = "1" ]; then
  # Shell-quoted, so the lines can be pasted into a shell. Nothing is run, created or changed.
  printf 'cd %q\n' "$PWD"
  echo "# not done in a dry run: reserve ports $RESERVED_PORTS (sysctl net.ipv4.ip_local_reserved_ports)"
  echo "unset XLA_USE_BF16 XLA_DOWNCAST_BF16"
  for var in "${ENV_VARS[@]}"; do
    printf 'export %s=%q\n' "$var" "${!var}"
  done
  line=$(printf '%q ' "${CMD[@]}")
  echo "${line% }"
  exit 0
fi

reserve_ports
[ "${COMPILE:-0}" = "1" ] || mkdir -p "$OUT"
exec "${CMD[@]}"
