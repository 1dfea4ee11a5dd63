#!/usr/bin/env bash
# Set up the torch-xla environment (scripts/setup_xla.sh) and run the XLA suite in it on XLA:CPU at
# world size 1 (multi-rank XLA:CPU collectives do not work), in two pytest runs:
#   tests_xla/      with the venv's transformers 4.57.1 (the 4.x line NxD's trn1 models use);
#   tests_xla_hf5/  with the transformers 5.24.0 overlay first on PYTHONPATH (the MoE recompute
#                   modules need 5.x; its conftest fails, never skips, if it finds 4.x).
# Extra arguments go to both runs. Both always run; the script fails if either fails, and a run that
# collects no test (pytest's exit code 5, e.g. a -k that matches nothing there) counts as failed.
# neuron_ckpt comes from this clone via PYTHONPATH, so one cached environment serves every clone.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_xla.sh
venv=${NEURON_CKPT_XLA_VENV:-$HOME/.cache/neuron_ckpt/xla-venv}
hf5=${NEURON_CKPT_XLA_HF5:-$HOME/.cache/neuron_ckpt/xla-hf5}
export PJRT_DEVICE=CPU
clone_path="$PWD${PYTHONPATH:+:$PYTHONPATH}"
status=0
PYTHONPATH="$clone_path" "$venv/bin/python" -m pytest tests_xla "$@" || status=$?
hf5_status=0
PYTHONPATH="$hf5:$clone_path" "$venv/bin/python" -m pytest tests_xla_hf5 "$@" || hf5_status=$?
if [ "$status" -ne 0 ] || [ "$hf5_status" -ne 0 ]; then
  echo "test_xla.sh: tests_xla exited $status, tests_xla_hf5 exited $hf5_status (5: no test collected)" >&2
  exit 1
fi
