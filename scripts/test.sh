#!/usr/bin/env bash
# Set up .venv, run the checks (ruff, ruff format, mypy: scripts/check.sh), then the test suite
# (eager CPU / gloo), then the XLA suite. Extra arguments go to pytest. NEURON_CKPT_SKIP_XLA=1
# skips the XLA suite (not in CI).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/check.sh
.venv/bin/python -m pytest "$@"
# The Trainium path: torch 2.9 + torch-xla 2.9 (the Neuron SDK's pairing) on XLA's CPU device, in
# an environment cached outside the clone (~4 GB download once, ~7 GB on disk). See docs/trainium.md.
[ "${NEURON_CKPT_SKIP_XLA:-0}" = 1 ] || bash scripts/test_xla.sh "$@"
