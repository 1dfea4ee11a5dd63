#!/usr/bin/env bash
# The house checks on the neuron_ckpt package, configured in pyproject.toml: ruff (lint), ruff
# format (--check) and mypy. Fails on the first finding. scripts/test.sh runs it before pytest;
# to fix what ruff can fix: .venv/bin/ruff check --fix neuron_ckpt && .venv/bin/ruff format neuron_ckpt
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/ruff check --quiet neuron_ckpt
.venv/bin/ruff format --check --quiet neuron_ckpt
# Files and settings: [tool.mypy] in pyproject.toml. The cache lives outside the clone, as the XLA
# venv does, so a fresh CI clone reuses torch's analysis (cold ~30-90 s, warm ~3 s here).
.venv/bin/mypy --cache-dir "${NEURON_CKPT_MYPY_CACHE:-$HOME/.cache/neuron_ckpt/mypy}"
