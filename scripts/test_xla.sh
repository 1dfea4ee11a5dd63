#!/usr/bin/env bash
# Set up the torch-xla environment (scripts/setup_xla.sh) and run tests_xla/ in it on XLA:CPU at
# world size 1 (multi-rank XLA:CPU collectives do not work). Extra arguments go to pytest.
# neuron_ckpt comes from this clone via PYTHONPATH, so one cached environment serves every clone.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_xla.sh
venv=${NEURON_CKPT_XLA_VENV:-$HOME/.cache/neuron_ckpt/xla-venv}
export PJRT_DEVICE=CPU
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "$venv/bin/python" -m pytest tests_xla "$@"
