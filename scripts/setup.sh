#!/usr/bin/env bash
# Idempotent installer of the locked test environment: a virtual environment in .venv holding
# exactly requirements/lock-cpu.txt (so every fresh machine gets what CI got, not whatever the
# package index serves that day), then this package on top without resolving anything more.
# Where no CUDA is present torch is the lock's CPU build (an unpinned torch would pull gigabytes
# of CUDA wheels); where CUDA is present torch is TORCH_SPEC (default: the newest) and its CUDA
# packages are left to pip. Regenerate the lock with scripts/lock.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
LOCK=requirements/lock-cpu.txt
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
PIP=(.venv/bin/python -m pip --disable-pip-version-check -q)
stamp=.venv/.sparse-ft-installed
want=$(cat pyproject.toml scripts/setup.sh "$LOCK" | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then exit 0; fi
pins=$(mktemp)
trap 'rm -f "$pins"' EXIT
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  .venv/bin/python -c "import torch" 2>/dev/null || "${PIP[@]}" install "${TORCH_SPEC:-torch}"
  grep -v '^torch==' "$LOCK" > "$pins"
else
  cp "$LOCK" "$pins"
fi
"${PIP[@]}" install -r "$pins"
"${PIP[@]}" install --no-deps --no-build-isolation -e .
"${PIP[@]}" check
.venv/bin/python scripts/lock_compare.py --require "$pins"
echo "$want" > "$stamp"
