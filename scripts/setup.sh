#!/usr/bin/env bash
# One-time, idempotent set-up: a virtual environment in .venv with hotloop-serve, its SDK and
# the dev tools. llama-cpp-python compiles llama.cpp from source on the first run (about 6
# minutes on 2 cores); pip caches the wheel, so later runs and fresh venvs reuse it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.hotloop-installed
want=$(cat pyproject.toml clients/python/pyproject.toml | sha256sum | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  .venv/bin/python -m pip install --quiet --upgrade pip
  # A portable CPU build of llama.cpp; set CMAKE_ARGS="-DGGML_CUDA=on" for NVIDIA GPUs.
  export CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=OFF}"
  echo "hotloop-serve: installing into .venv (the first install compiles llama.cpp: several minutes)" >&2
  .venv/bin/python -m pip install --quiet -e clients/python -e ".[dev,bench]"
  echo "$want" > "$stamp"
fi
