#!/usr/bin/env bash
# Llama pretraining on trn1.32xlarge (32 NeuronCore-v2 per node), as the AWS NxD "Llama TP + ZeRO-1"
# tutorial trains it: TP 8 x DP (4 per node), sequence parallel, flash attention (NxD's NKI kernel),
# ZeRO-1 with fp32 master weights, bf16, global batch 1024 sequences, 100 warmup steps, 10000 steps.
# MODEL picks the model and NxD's values for it (aws-neuron/neuronx-distributed,
# examples/training/llama/tp_zero1_llama_hf_pretrain/, identical at the SDK 2.28.0 tag and Release 2.29):
#   llama2-7b (default)        tp_zero1_llama2_7B_hf_pretrain.sh: seq 4096, LR 3e-4, logging every 10 steps
#   llama3-8b, llama3.1-8b     tp_zero1_llama3_8B_hf_pretrain.sh (llama31_8B runs it with the 3.1 config):
#                              seq 8192, LR 1.5e-4, logging every step
# and, from examples/training/llama/tp_pp_llama_hf_pretrain/, TP 32 x PP 8 (ZeRO-1 over DP = nodes / 8),
# micro-batch 1, global batch 1024 (train.py runs GBS / DP micro-batches per step through the stages:
# 256 on NxD's 32 nodes), 2000 warmup of 30000 steps, cosine to min_lr = LR / 15, weight decay 0.1,
# beta2 0.95, logging every step:
#   llama2-70b                 run_llama2_70B_tp_pp.sh: seq 4096, LR 1.5e-4 (min_lr 1e-5), explicit attention
#                              (NxD's script runs without its flash kernel; --attention flash after the script)
#   llama3.1-70b               run_llama3_70B_tp_pp.sh (run_llama31_70B_tp_pp.sh runs it with the 3.1 config):
#                              seq 8192, LR 1.5e-5 (min_lr 1e-6), flash attention
# trn1 cannot run pipeline parallelism today (docs/pipeline.md): with PP_DEGREE > 1 this script stops with
# the reason before it launches anything, and DRY_RUN=1 prints what it would run.
# Long sequences: CP_DEGREE=C splits each sequence over C ranks (context parallelism, train.py --cp;
# docs/context_parallel.md), with the model's sequence length times C, so each rank holds NxD's length:
#   MODEL=llama3.1-8b CP_DEGREE=4 ./run_trn1.sh   # seq 32768 (8192 per rank), TP 32 x CP 4 = 4 nodes per
#                              replica, 256 sequences per step (NxD's 8M tokens), explicit attention,
#                              selective recompute; data packed at 32768 (llama3_train_32k.safetensors)
#
#   COMPILE=1 ./run_trn1.sh       # ahead-of-time graph compilation only (neuron_parallel_compile)
#   ./run_trn1.sh                 # train; re-running resumes from the latest checkpoint in $OUT
#   MODEL=llama3.1-8b ./run_trn1.sh
#   MODEL=llama2-70b DRY_RUN=1 ./run_trn1.sh   # TP 32 x PP 8: printed only, trn1 refuses PP_DEGREE > 1 today
#   MODEL=llama3.1-8b CP_DEGREE=8 DRY_RUN=1 ./run_trn1.sh   # seq 65536: TP 32 x CP 8, 8 nodes per replica
#   RECIPE=nxd ./run_trn1.sh      # NxD's schedule, AdamW, decay exclusions, seed and data order (train.py --recipe nxd)
#   DRY_RUN=1 ./run_trn1.sh       # print the environment and the launch command; run nothing
#   ./run_trn1.sh --lr 2e-4       # extra arguments go to train.py, last (they override)
#
# Settings, all optional:
#   MODEL        llama2-7b | llama3-8b | llama3.1-8b | llama2-70b | llama3.1-70b (the --model-config preset)
#   RECIPE       empty: this project's schedule and AdamW (cosine to 10%, beta2 0.95, weight decay 0.1; for the
#                70B models cosine to LR / 15, as NxD's 70B scripts);
#                nxd: train.py --recipe nxd (linear decay to 0, AdamW as NxD's TP + ZeRO-1 tutorial), to lay loss
#                curves over NxD's; not for the 70B models, whose NxD recipe is the default's
#   PRECISION    fp32-master (default): NEURON_RT_STOCHASTIC_ROUNDING_EN=0, as NxD's default
#                --use_gpu_compatible_precision 1 (ZeRO-1 keeps fp32 master weights; AWS's bf16 migration note
#                calls this the mode "without setting NEURON_RT_STOCHASTIC_ROUNDING_EN=1");
#                sr: NEURON_RT_STOCHASTIC_ROUNDING_EN=1, for pure-bf16 experiments (every fp32 -> bf16 rounding
#                on the device becomes stochastic: runs are not bit-reproducible)
#   TP_DEGREE    8 (default; AWS's tutorial page: TP 8, ZeRO-1 over 16 on 4 nodes) or 32 (the default of NxD's
#                8B script; TP 32 x DP 1 per node); the 70B models: 32 only. Any other degree: pass --tp N
#                after the script.
#   PP_DEGREE    pipeline stages (train.py --pp): 1 (default), 8 for the 70B models; TP x PP ranks hold one
#                replica (TP 32 x PP 8: 8 nodes). Above 1 a run is refused on trn1 today (DRY_RUN=1 prints it).
#                --pp-schedule and --virtual-stages go after the script (default 1F1B, as NxD's).
#   CP_DEGREE    context-parallel ranks per sequence (train.py --cp): 1 (default). Above 1 the sequence length is
#                the model's times CP_DEGREE (llama2-7b 4096, the 8B models 8192 per rank: CP 4 gives 16384 and
#                32768), the global batch 1024 / CP_DEGREE sequences (the same tokens per step), TP 32 by
#                default (TP x CP ranks hold one replica), explicit attention (NxD's NKI kernel takes a query
#                block against keys of the same length only; under CP each query chunk reads a longer key
#                prefix), selective recompute (the planner does not model CP yet: RECOMPUTE=auto is refused),
#                and the default DATA is <stem>_<seq/1024>k.safetensors. Not with PP_DEGREE > 1 (train.py
#                refuses --cp with --pp), so not for the 70B models unless PP_DEGREE=1.
#   RECOMPUTE    none for llama2-7b and the 70B models; auto for the 8B models (planned per layer for the
#                attention that runs: nothing with the NKI kernel, recompute where train.py falls back to
#                explicit attention, which at seq 8192 needs 31 GiB per core without it; neuron-ckpt plan
#                --config llama3-8b --seq 8192). auto plans one model, not a stage: with PP_DEGREE > 1 set a
#                preset (none, selective, full), planned per stage with neuron-ckpt plan --pp.
#   DATA, OUT, MAX_STEPS (10000; 30000 for the 70B models), COMPILE_STEPS (2), PROCESSES_PER_NODE (32),
#                NEURON_CC_FLAGS
#   NUM_NODES, NODE_RANK, MASTER_ADDR, MASTER_PORT (44000): set by hand when neither Slurm nor Open MPI
#                launches the nodes (MASTER_ADDR = node 0's address, required with NUM_NODES > 1)
#
# llama2-7b: no recompute by default. With flash attention there is no s x s tensor for selective
# recompute to drop (it would rerun the kernel to save its fp32 logsumexp; NxD's selective checkpoint
# skips its flash path too), and `neuron-ckpt plan --config llama2-7b --tp 8 --dp 16 --seq 4096
# --device-memory trn1` puts no recompute at 7.5 of 16 GiB per NeuronCore. train.py prints the attention it
# runs; where the NKI kernel is not importable it runs the explicit attention (12.0 GiB with no recompute,
# still within the 14.4 GiB the plan allows).
#
# 70B models: no recompute by default either. NxD's scripts run selective checkpointing
# (--use_selective_checkpoint 1: core attention, and the MLP too at seq 8192; RECOMPUTE=selective is that
# choice, plus --recompute-modules core_attn,mlp after the script at 8192), but the per-stage plan finds
# every stage fits without it on NxD's 32 nodes (TP 32 x PP 8 x DP 4, 1F1B over 256 micro-batches; 14.4 GiB
# per core to plan for):
#   neuron-ckpt plan --config llama2-70b --seq 4096 --tp 32 --dp 4 --pp 8 --micro-batches 256 \
#       --device-memory trn1 --attention explicit        # the most loaded stage (1): 10.5 GiB, no recompute
#   neuron-ckpt plan --config llama3.1-70b --seq 8192 --tp 32 --dp 4 --pp 8 --micro-batches 256 \
#       --device-memory trn1 --attention flash           # the most loaded stage (1): 9.2 GiB, no recompute
#
# Launchers: under Slurm (run_slurm.sbatch) every node runs this script and reads its rank from Slurm.
# Under Open MPI (NxD's EKS / MPI-operator path: one process per node, e.g. mpirun -N 1) it reads
# OMPI_COMM_WORLD_SIZE / OMPI_COMM_WORLD_RANK, takes MASTER_ADDR from the environment or else the first
# host printed by NODELIST_HELPER (NxD's container helper, /root/nodelist_helper.py), raises the open-file
# limit to 65535 and sets CCOM_SOCKET_IFNAME=eth0, as NxD's scripts do there. With more than one node the
# EFA variables are set however the nodes were launched.
#
# Prepare the data first with the model's tokenizer, packed at the model's sequence length (the
# launcher refuses a DATA file packed at another length), e.g.
#   python prepare_data.py --tokenizer /path/to/Llama-2-7b-hf --input /path/to/corpus \
#       --seq-len 4096 --output ~/data/llama2_train.safetensors
#   python prepare_data.py --tokenizer /path/to/Meta-Llama-3.1-8B --input /path/to/corpus \
#       --seq-len 8192 --output ~/data/llama3_train_8k.safetensors     # llama3-8b, llama3.1-8b, llama3.1-70b
# (llama2-70b shares Llama-2's tokenizer and seq 4096, so the llama2_train file.)
set -euo pipefail
cd "$(dirname "$0")"
DRY_RUN=${DRY_RUN:-0}

die() {
  echo "run_trn1.sh: $*" >&2
  exit 2
}

# --- model, recipe, precision --------------------------------------------------------------------
# Values of NxD's scripts; GBS 1024 and MBS 1 are the same in all of them, 100 warmup of 10000 steps in the
# TP + ZeRO-1 ones (7B, 8B).
MODEL=${MODEL:-llama2-7b}
WARMUP_STEPS=100 DEFAULT_MAX_STEPS=10000 MIN_LR_RATIO=0.1 ATTENTION=flash DEFAULT_TP=8 DEFAULT_PP=1
case $MODEL in
  llama2-7b)
    SEQ_LEN=4096 LR=3e-4 LOG_EVERY=10 RUN_NAME=llama2_7b
    DEFAULT_DATA=$HOME/data/llama2_train.safetensors DEFAULT_RECOMPUTE=none ;;
  llama3-8b | llama3.1-8b)   # one tokenizer (128256 ids), so one data file
    SEQ_LEN=8192 LR=1.5e-4 LOG_EVERY=1 RUN_NAME=${MODEL//-/_}
    DEFAULT_DATA=$HOME/data/llama3_train_8k.safetensors DEFAULT_RECOMPUTE=auto ;;
  llama2-70b | llama3.1-70b)
    # NxD's TP + PP scripts; their min_lr is LR / 15 for both (1e-5 of 1.5e-4, 1e-6 of 1.5e-5). No recompute:
    # the per-stage plan fits every stage without it (see the header; NxD's choice is RECOMPUTE=selective).
    LOG_EVERY=1 RUN_NAME=${MODEL//-/_} WARMUP_STEPS=2000 DEFAULT_MAX_STEPS=30000 MIN_LR_RATIO=0.06666666666666667
    DEFAULT_TP=32 DEFAULT_PP=8 DEFAULT_RECOMPUTE=none
    if [ "$MODEL" = llama2-70b ]; then
      SEQ_LEN=4096 LR=1.5e-4 ATTENTION=explicit DEFAULT_DATA=$HOME/data/llama2_train.safetensors
    else
      SEQ_LEN=8192 LR=1.5e-5 DEFAULT_DATA=$HOME/data/llama3_train_8k.safetensors
    fi ;;
  *) die "MODEL must be llama2-7b, llama3-8b, llama3.1-8b, llama2-70b or llama3.1-70b, got '$MODEL'" ;;
esac
CP_DEGREE=${CP_DEGREE:-1}
case $CP_DEGREE in
  "" | *[!0-9]* | 0*) die "CP_DEGREE must be a positive integer (ranks per sequence), got '$CP_DEGREE'" ;;
esac
GLOBAL_BATCH=1024 CP_ARGS=() CP_TAG=
if [ "$CP_DEGREE" -gt 1 ]; then
  [ $((GLOBAL_BATCH % CP_DEGREE)) -eq 0 ] || die "CP_DEGREE must divide 1024 (the global batch keeps 1024 x $SEQ_LEN tokens), got $CP_DEGREE"
  # Each rank keeps the model's own length; the step keeps NxD's tokens. Explicit attention: the NKI kernel
  # attends over equal query and key lengths only. Selective recompute: the probabilities of a query chunk
  # against its whole key prefix are the largest activation under CP (docs/context_parallel.md).
  SEQ_LEN=$((SEQ_LEN * CP_DEGREE)) GLOBAL_BATCH=$((GLOBAL_BATCH / CP_DEGREE)) ATTENTION=explicit
  DEFAULT_DATA=${DEFAULT_DATA%%_train*}_train_$((SEQ_LEN / 1024))k.safetensors
  DEFAULT_TP=32 DEFAULT_RECOMPUTE=selective CP_ARGS=(--cp "$CP_DEGREE") CP_TAG=_cp$CP_DEGREE
fi
TP_DEGREE=${TP_DEGREE:-$DEFAULT_TP}
case $MODEL:$TP_DEGREE in
  *-70b:32 | *-7b:8 | *-7b:32 | *-8b:8 | *-8b:32) ;;
  *-70b:*) die "TP_DEGREE must be 32 for MODEL=$MODEL (NxD's 70B scripts: TP 32 x PP 8), got '$TP_DEGREE'; for another degree pass --tp N after the script" ;;
  *) die "TP_DEGREE must be 8 (AWS's tutorial page) or 32 (NxD's 8B script), got '$TP_DEGREE'; for another degree pass --tp N after the script" ;;
esac
PP_DEGREE=${PP_DEGREE:-$DEFAULT_PP}
case $PP_DEGREE in
  "" | *[!0-9]* | 0*) die "PP_DEGREE must be a positive integer (pipeline stages), got '$PP_DEGREE'" ;;
esac
PP_ARGS=() PP_TAG=
if [ "$PP_DEGREE" -gt 1 ]; then
  PP_ARGS=(--pp "$PP_DEGREE") PP_TAG=_pp$PP_DEGREE
  # Why a real run stops here (train.py would refuse it too, but only after torchrun started every process).
  PP_REFUSAL="PP_DEGREE=$PP_DEGREE: trn1 cannot run pipeline parallelism today (torch.distributed.pipelining's send/recv fail on Neuron, aws-neuron-sdk#1189; torch-xla has no stage hook, pytorch#161017 unmerged); see docs/pipeline.md"
fi
if [ "$CP_DEGREE" -gt 1 ] && [ "$PP_DEGREE" -gt 1 ]; then
  die "CP_DEGREE=$CP_DEGREE does not combine with PP_DEGREE=$PP_DEGREE (train.py refuses --cp with --pp: pipeline stages take the whole sequence); set one of them to 1"
fi
RECOMPUTE=${RECOMPUTE:-$DEFAULT_RECOMPUTE}
if [ "$CP_DEGREE" -gt 1 ] && [ "$RECOMPUTE" = auto ]; then
  die "RECOMPUTE=auto does not combine with CP_DEGREE=$CP_DEGREE: the planner does not model context parallelism yet; set RECOMPUTE to a preset (none, selective, full)"
fi
if [ "$PP_DEGREE" -gt 1 ] && [ "$RECOMPUTE" = auto ]; then
  die "RECOMPUTE=auto plans one model, not a pipeline stage (PP_DEGREE=$PP_DEGREE): plan per stage with neuron-ckpt plan --pp $PP_DEGREE and set RECOMPUTE to a preset (none, selective, full)"
fi
RECIPE=${RECIPE:-}
case $RECIPE in
  "") RECIPE_ARGS=(--min-lr-ratio "$MIN_LR_RATIO" --decay cosine --weight-decay 0.1 --beta1 0.9 --beta2 0.95)
      RUN_SUFFIX= ;;
  nxd) RECIPE_ARGS=(--recipe nxd)   # train.py sets NxD's schedule shape, AdamW, decay exclusions, seed, data order
       RUN_SUFFIX=_nxd ;;
  *) die "RECIPE must be empty (this project's) or nxd, got '$RECIPE'" ;;
esac
if [ "$RECIPE" = nxd ] && [ "$DEFAULT_PP" -gt 1 ]; then
  # train.py's nxd recipe is NxD's TP + ZeRO-1 tutorial's (linear to 0, beta2 0.999, weight decay 0.01); the
  # 70B scripts train with cosine to min_lr, beta2 0.95 and weight decay 0.1, which the default passes.
  die "RECIPE=nxd is NxD's 7B/8B recipe; for MODEL=$MODEL leave RECIPE empty: it passes NxD's 70B schedule and AdamW (cosine to LR / 15, beta2 0.95, weight decay 0.1)"
fi
PRECISION=${PRECISION:-fp32-master}
case $PRECISION in
  fp32-master) STOCHASTIC_ROUNDING=0 ;;
  sr) STOCHASTIC_ROUNDING=1 RUN_SUFFIX+=_sr ;;
  *) die "PRECISION must be fp32-master or sr, got '$PRECISION'" ;;
esac

# --- Neuron compiler and runtime ----------------------------------------------------------------
# NEURON_CC_FLAGS as the NxD scripts set them (tp_zero1_llama2_7B_hf_pretrain.sh and
# tp_zero1_llama3_8B_hf_pretrain.sh, l.8): unchanged from commit 82a2bb3 (Neuron 2.22) through the
# SDK 2.28.0 tag and Release 2.29. NxD's 2.19-2.21 scripts also passed --distribution-strategy=llm-training,
# which later ones dropped. Neither passes -O1 or --retry_failed_compilation.
# The cache makes re-runs (and the real run after COMPILE=1) skip compiles.
export NEURON_CC_FLAGS="${NEURON_CC_FLAGS:---model-type transformer --cache_dir=$HOME/neuron_compile_cache/}"
export NEURON_FUSE_SOFTMAX=1
export NEURON_RT_ASYNC_EXEC_MAX_INFLIGHT_REQUESTS=3   # let the host run ahead of the device by 3 steps
# Stochastic rounding follows PRECISION (see the header): off while ZeRO-1's fp32 masters carry the
# small updates, as NxD's default; on, the runtime rounds every fp32 -> bf16 cast stochastically,
# including the master -> bf16 parameter copy and the activations.
export NEURON_RT_STOCHASTIC_ROUNDING_EN=$STOCHASTIC_ROUNDING
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
FD_LIMIT=
if [ -n "${SLURM_JOB_NODELIST:-}" ]; then
  NUM_NODES=${SLURM_NNODES:-1}
  NODE_RANK=${SLURM_NODEID:-0}
  MASTER_ADDR=${MASTER_ADDR:-$(scontrol show hostnames "$SLURM_JOB_NODELIST" | awk 'NR == 1')}
elif [ -n "${OMPI_COMM_WORLD_RANK:-}" ]; then
  # Open MPI, one process per node (NxD's EKS path, S7 l.76-113): its rank is the node rank.
  NUM_NODES=${OMPI_COMM_WORLD_SIZE:?OMPI_COMM_WORLD_RANK is set but OMPI_COMM_WORLD_SIZE is not}
  NODE_RANK=$OMPI_COMM_WORLD_RANK
  NODELIST_HELPER=${NODELIST_HELPER:-/root/nodelist_helper.py}
  if [ -z "${MASTER_ADDR:-}" ] && [ -x "$NODELIST_HELPER" ]; then
    MASTER_ADDR=$("$NODELIST_HELPER" | awk 'NR == 1 { print $1 }')   # hosts, space-separated
  fi
  # The pod's interface for the collectives' socket bootstrap, and a higher open-file limit (containers
  # start with 1024; 32 processes with their compile and runtime files need more), as NxD's scripts.
  export CCOM_SOCKET_IFNAME=${CCOM_SOCKET_IFNAME:-eth0}
  ENV_VARS+=(CCOM_SOCKET_IFNAME)
  FD_LIMIT=65535
else
  NUM_NODES=${NUM_NODES:-1}
  NODE_RANK=${NODE_RANK:-0}
fi
if [ "$NUM_NODES" -gt 1 ]; then
  [ -n "${MASTER_ADDR:-}" ] || die "NUM_NODES=$NUM_NODES needs MASTER_ADDR, the address of node 0 (the rendezvous host)"
  [ "$NODE_RANK" -ge 0 ] && [ "$NODE_RANK" -lt "$NUM_NODES" ] || die "NODE_RANK must be in [0, $NUM_NODES), got $NODE_RANK"
  # EFA between nodes (trn1.32xlarge: 8 x 100 Gb/s), however the nodes were launched: libfabric's EFA
  # provider with device RDMA, and fork safety (the launcher and data loading fork).
  export FI_PROVIDER=efa FI_EFA_USE_DEVICE_RDMA=1 FI_EFA_FORK_SAFE=1
  ENV_VARS+=(FI_PROVIDER FI_EFA_USE_DEVICE_RDMA FI_EFA_FORK_SAFE)
fi
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
# Rendezvous port and reserved ports as in the NxD scripts: torchrun --master_port 44000 and
# `sudo sysctl -w net.ipv4.ip_local_reserved_ports=44000,48620`. 48620 is the port AWS's NxD training
# troubleshooting page gives for NEURON_RT_ROOT_COMM_ID (host:port of the root node, where the Neuron
# runtime's collectives bootstrap; "localhost:48620" in its example, for runs that hang at collective
# init); aws-neuron-samples' llama_batch_training.sh exports it so. NxD's scripts and this one reserve
# the port and leave the variable to torch-neuronx. Reserving a port keeps the kernel from handing it
# out as the ephemeral source port of some outgoing connection (32 processes per node open many),
# which would make the rendezvous fail with "address in use". A MASTER_PORT override is reserved in
# place of 44000.
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
DATA=${DATA:-$DEFAULT_DATA}
OUT=${OUT:-$HOME/runs/${RUN_NAME}_tp${TP_DEGREE}${CP_TAG}${PP_TAG}_zero1${RUN_SUFFIX}}   # per recipe and layout: a resume never mixes two
MAX_STEPS=${MAX_STEPS:-$DEFAULT_MAX_STEPS}

# The sequence length is the data file's (train.py reads it from there): refuse a file packed for another
# model. A packed file is safetensors: an 8-byte little-endian header length, then a JSON header whose
# metadata holds "block_len". A file that is not there yet (or not ours) is left to train.py.
data_block_len() {
  local n
  n=$(od -An -t u8 -N 8 "$1" 2>/dev/null | tr -d ' ') || return 0
  [ -n "$n" ] && [ "$n" -gt 0 ] && [ "$n" -lt 100000000 ] || return 0
  head -c $((8 + n)) "$1" | tail -c "$n" | grep -o '"block_len": *"[0-9]*"' | grep -o '[0-9][0-9]*' | head -n 1 || true
}
if [ -f "$DATA" ]; then
  block_len=$(data_block_len "$DATA")
  if [ -n "$block_len" ] && [ "$block_len" != "$SEQ_LEN" ]; then
    die "DATA $DATA is packed at sequence length $block_len, but MODEL=$MODEL trains at $SEQ_LEN (NxD's);" \
        "pack it with prepare_data.py --seq-len $SEQ_LEN, or point DATA at such a file"
  fi
fi

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
         --metrics-file "$OUT/metrics.jsonl" --tensorboard-dir "$OUT/tb")
fi

CMD=("${LAUNCH[@]}" "${DISTRIBUTED_ARGS[@]}" train.py
  --model-config "$MODEL" --data "$DATA"
  --tp "$TP_DEGREE" ${CP_ARGS[@]+"${CP_ARGS[@]}"} ${PP_ARGS[@]+"${PP_ARGS[@]}"} --sequence-parallel --attention "$ATTENTION"
  --recompute "$RECOMPUTE" --dtype bf16 --micro-batch-size 1 --global-batch-size "$GLOBAL_BATCH"
  --lr "$LR" --warmup-steps "$WARMUP_STEPS" --max-steps "$MAX_STEPS" "${RECIPE_ARGS[@]}" --grad-clip 1.0
  --log-every "$LOG_EVERY" --device-kind trn1 ${EXTRA[@]+"${EXTRA[@]}"} "$@")

# A dry run's note on the pipeline's layout: the replicas (DP) and micro-batches per step of this topology.
pp_layout() {
  local ranks=$((NUM_NODES * PROCESSES_PER_NODE)) replica=$((TP_DEGREE * PP_DEGREE))
  if [ $((ranks % replica)) -ne 0 ]; then
    echo "# TP $TP_DEGREE x PP $PP_DEGREE = $replica ranks hold one replica, and the $ranks ranks here (NUM_NODES=$NUM_NODES x $PROCESSES_PER_NODE) are not a multiple of it (NxD runs TP 32 x PP 8 on 32 nodes)"
    return 0
  fi
  local dp=$((ranks / replica))
  if [ $((1024 % dp)) -ne 0 ]; then
    echo "# TP $TP_DEGREE x PP $PP_DEGREE x DP $dp on $NUM_NODES node(s): the global batch 1024 is not a multiple of DP $dp"
    return 0
  fi
  echo "# TP $TP_DEGREE x PP $PP_DEGREE x DP $dp on $NUM_NODES node(s): $((1024 / dp)) micro-batches of 1 per step through the stages"
}

# A dry run's note on context parallelism's layout: the ranks per replica and the tokens per rank.
cp_layout() {
  local ranks=$((NUM_NODES * PROCESSES_PER_NODE)) replica=$((TP_DEGREE * CP_DEGREE))
  local note="# TP $TP_DEGREE x CP $CP_DEGREE = $replica ranks split each sequence of $SEQ_LEN tokens ($((SEQ_LEN / CP_DEGREE)) per rank)"
  if [ $((ranks % replica)) -ne 0 ]; then
    echo "$note; the $ranks ranks here (NUM_NODES=$NUM_NODES x $PROCESSES_PER_NODE) are not a multiple of it"
    return 0
  fi
  echo "$note: DP $((ranks / replica)) on $NUM_NODES node(s), $GLOBAL_BATCH sequences per step"
}

if [ "$DRY_RUN" = "1" ]; then
  # Shell-quoted, so the lines can be pasted into a shell. Nothing is run, created or changed.
  printf 'cd %q\n' "$PWD"
  echo "# MODEL=$MODEL (seq $SEQ_LEN) RECIPE=${RECIPE:-default} PRECISION=$PRECISION TP_DEGREE=$TP_DEGREE CP_DEGREE=$CP_DEGREE PP_DEGREE=$PP_DEGREE; not done in a dry run: reserve ports $RESERVED_PORTS (sysctl net.ipv4.ip_local_reserved_ports)"
  if [ "$PP_DEGREE" -gt 1 ]; then
    echo "# $PP_REFUSAL; a real run stops here, before anything is launched"
    pp_layout
  fi
  [ "$CP_DEGREE" -eq 1 ] || cp_layout
  echo "unset XLA_USE_BF16 XLA_DOWNCAST_BF16"
  for var in "${ENV_VARS[@]}"; do
    printf 'export %s=%q\n' "$var" "${!var}"
  done
  [ -z "$FD_LIMIT" ] || echo "ulimit -n $FD_LIMIT"
  line=$(printf '%q ' "${CMD[@]}")
  echo "${line% }"
  exit 0
fi
[ "$PP_DEGREE" -eq 1 ] || die "$PP_REFUSAL; DRY_RUN=1 prints the command it would run"

if [ -n "$FD_LIMIT" ]; then
  ulimit -n "$FD_LIMIT" 2>/dev/null || echo "run_trn1.sh: warning: could not raise the open-file limit to $FD_LIMIT (now $(ulimit -n))" >&2
fi
reserve_ports
[ "${COMPILE:-0}" = "1" ] || mkdir -p "$OUT"
exec "${CMD[@]}"
