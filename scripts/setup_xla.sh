#!/usr/bin/env bash
# Create the torch-xla environment that tests_xla/ runs in: torch 2.9.0 + torch-xla 2.9.0 from
# PyPI, driven on the CPU with PJRT_DEVICE=CPU (the same lazy-tensor lowering Neuron uses).
#
# It lives OUTSIDE the clone (default ~/.cache/neuron_ckpt/xla-venv, override with
# NEURON_CKPT_XLA_VENV) because it is big: PyPI's only Linux x86_64 torch 2.9.0 wheel is the
# CUDA build (torch==2.9.0+cpu is not on PyPI), which pulls the nvidia-* wheels; installing it
# --no-deps without them fails at `import torch` (libcudart/libcublas missing), but with them it
# runs torch-xla on the CPU fine. Measured here: ~4 GB download, 2 min 8 s, 7.2 GB installed
# (4.3 GB nvidia-*, 1.7 GB torch, 0.6 GB triton, 0.3 GB torch-xla). A later CI run on the same
# machine reuses it. neuron_ckpt is NOT installed into it: scripts/test_xla.sh puts the clone on
# PYTHONPATH, so one cached environment serves every clone.
#
# Beside it, an overlay holding transformers 5.24.0 (default ~/.cache/neuron_ckpt/xla-hf5,
# override with NEURON_CKPT_XLA_HF5) for tests_xla_moe/: the MoE recompute modules need
# transformers 5 (3-D experts, set_experts_implementation), while the venv keeps 4.57.1, the 4.x
# line NxD's trn1 models are written against. It is a `pip install --target` directory that
# test_xla.sh puts first on PYTHONPATH for that run only. It reuses the venv's torch; pip --target
# copies every dependency into it, and those the venv has too are pinned to the venv's versions,
# so the overlay shadows only transformers, huggingface-hub and tokenizers with other versions
# (5.24.0, 2.4.0, 0.23.3 here) and adds the hub's new dependencies. Measured here: ~20 s, 277 MB
# (31 packages).
#
# Idempotent: each part has a stamp holding this file's hash and is skipped while it matches.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
venv=${NEURON_CKPT_XLA_VENV:-$HOME/.cache/neuron_ckpt/xla-venv}
hf5=${NEURON_CKPT_XLA_HF5:-$HOME/.cache/neuron_ckpt/xla-hf5}
stamp=$venv/.neuron_ckpt-xla-stamp
hf5_stamp=$hf5/.neuron_ckpt-xla-stamp
want=$(sha256sum scripts/setup_xla.sh | cut -d' ' -f1)
current() { [ -f "$1" ] && [ "$(cat "$1")" = "$want" ]; }

if ! current "$stamp"; then
  # ~4 GB download, ~7 GB installed, plus pip's cache of the wheels: ask for 12 GB up front
  # rather than dying half way through an install.
  mkdir -p "$(dirname "$venv")"
  free_kb=$(df -Pk "$(dirname "$venv")" | awk 'NR==2 {print $4}')
  if [ "$free_kb" -lt $((12 * 1024 * 1024)) ]; then
    echo "setup_xla.sh: need ~12 GB free under $(dirname "$venv"), have $((free_kb / 1024 / 1024)) GB" >&2
    exit 1
  fi
  rm -f "$stamp"
  [ -x "$venv/bin/python" ] || "$PY" -m venv "$venv"
  "$venv/bin/pip" install -q --upgrade pip
  # One resolver call so torch-xla's exact torch pin and ours agree. transformers 4.57 is the
  # last 4.x line and supports torch 2.9; the library's own runtime deps come next.
  "$venv/bin/pip" install -q \
    "torch==2.9.0" "torch-xla==2.9.0" \
    "transformers==4.57.1" "pytest>=7" numpy safetensors tqdm
  echo "$want" > "$stamp"
fi

if ! current "$hf5_stamp"; then
  # --target does not replace what is there: start from an empty directory.
  rm -rf "$hf5"
  mkdir -p "$hf5"
  pins=$(mktemp)
  trap 'rm -f "$pins"' EXIT
  # The venv's versions of everything but the three packages transformers 5 needs newer.
  "$venv/bin/pip" list --format=freeze | grep -viE '^(transformers|huggingface[-_]hub|tokenizers)==' > "$pins"
  "$venv/bin/pip" install -q --target "$hf5" -c "$pins" "transformers==5.24.0"
  echo "$want" > "$hf5_stamp"
fi
