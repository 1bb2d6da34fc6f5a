#!/usr/bin/env bash
# Runs the tests against the newest releases that pyproject.toml's ranges admit, instead of the
# lock, and reports what broke: which packages differ from requirements/lock-cpu.txt and which
# tests failed. Not part of CI: run it before regenerating the lock (scripts/lock.sh), or to
# learn whether a user installing today's releases meets a failure the lock hides.
# Usage: bash scripts/test_newest.sh [pytest arguments]   (default: the whole suite)
# torch stays the lock's CPU build (TORCH_SPEC overrides): its newest would be a CUDA one.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
LOCK=requirements/lock-cpu.txt
venv=${NEWEST_VENV:-.venv-newest}
[ -x "$venv/bin/python" ] || "$PYTHON" -m venv "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
torch_pin=$(mktemp)
log=$(mktemp)
trap 'rm -f "$torch_pin" "$log"' EXIT
echo "${TORCH_SPEC:-$(grep '^torch==' "$LOCK")}" > "$torch_pin"
"${pip[@]}" install --upgrade pip setuptools wheel
"${pip[@]}" install --upgrade --upgrade-strategy eager -c "$torch_pin" -e ".[dev,harness]"
status=0
"$venv/bin/python" -m pytest -q "$@" 2>&1 | tee "$log" || status=$?
echo
echo "== today's newest releases =="
"$venv/bin/python" scripts/lock_compare.py "$LOCK"
broke=$(grep -E '^(FAILED|ERROR) ' "$log" || true)
echo "broke: ${broke:-nothing}"
exit "$status"
