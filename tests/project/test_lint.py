"""The tree passes ruff with the configuration in pyproject.toml (``[tool.ruff]``): pyflakes'
errors (unused or undefined names), pycodestyle's errors and warnings, lines of at most 140
characters. The lock pins ruff, so every machine checks the same rules."""

from __future__ import annotations

import subprocess
import sys

from tests import ROOT


def test_tree_passes_ruff():
    assert (ROOT / "pyproject.toml").is_file(), ROOT  # the repository, not a folder above it
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", str(ROOT)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
