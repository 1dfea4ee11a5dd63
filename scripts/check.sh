#!/usr/bin/env bash
# The house checks, on the whole tree (the package, tests, tests_xla, tests_xla_hf5, scripts,
# tutorials, and the Python blocks of the Markdown files): ruff (lint) and ruff format (--check),
# configured in pyproject.toml; then mypy on the package, configured in setup.cfg. Fails on the
# first finding. scripts/test.sh runs it before pytest; to fix what ruff can fix:
# .venv/bin/ruff check --fix . && .venv/bin/ruff format .
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/ruff check --quiet .
.venv/bin/ruff format --check --quiet .
# Files and settings: [mypy] in setup.cfg. The cache lives outside the clone, as the XLA venv does,
# so a fresh CI clone reuses torch's analysis (cold ~30-90 s, warm ~3 s here).
.venv/bin/mypy --cache-dir "${NEURON_CKPT_MYPY_CACHE:-$HOME/.cache/neuron_ckpt/mypy}"
