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
# PYTHONPATH, so one cached environment serves every clone. Idempotent: a stamp holding this file's hash skips the work.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
venv=${NEURON_CKPT_XLA_VENV:-$HOME/.cache/neuron_ckpt/xla-venv}
stamp=$venv/.neuron_ckpt-xla-stamp
want=$(sha256sum scripts/setup_xla.sh | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi

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
