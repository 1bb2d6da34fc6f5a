"""The test suite, one folder per wing of the code (docs/architecture.md); ``ROOT`` is the
repository's root."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
