#!/usr/bin/env bash
# Idempotent installer: a virtual environment in .venv, the CPU torch where no CUDA
# is present (an unpinned torch would pull gigabytes of CUDA wheels), then this package.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
PIP=(.venv/bin/python -m pip --disable-pip-version-check -q)
stamp=.venv/.sparse-ft-installed
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then exit 0; fi
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    "${PIP[@]}" install "${TORCH_SPEC:-torch}"
  else
    "${PIP[@]}" install "${TORCH_SPEC:-torch==2.13.0}"
  fi
fi
"${PIP[@]}" install -e ".[dev]"
echo "$want" > "$stamp"
