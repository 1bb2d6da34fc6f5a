"""Text every Python installation has: the standard library's module sources. A corpus built
from it is the same on every machine with the same Python, needs no download, and mixes
prose (docstrings, comments) with code."""

from __future__ import annotations

import sysconfig
from pathlib import Path
from typing import Iterable, Iterator, Optional

DEFAULT_MODULES = (
    "argparse", "asyncio/events", "calendar", "collections/__init__", "csv", "dataclasses", "datetime",
    "difflib", "email/message", "fractions", "functools", "heapq", "inspect", "json/decoder", "logging/__init__",
    "pathlib", "pprint", "queue", "random", "shutil", "statistics", "string", "textwrap", "threading",
    "typing", "unittest/case", "urllib/parse", "uuid", "zipfile",
)


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def iter_stdlib_documents(modules: Optional[Iterable[str]] = DEFAULT_MODULES) -> Iterator[str]:
    """Module sources in a fixed order (``modules=None``: every top-level .py file). Modules a
    Python build lacks are skipped, so the corpus differs only across Python versions."""
    root = stdlib_dir()
    paths = sorted(root.glob("*.py")) if modules is None else [root / f"{m}.py" for m in modules]
    for path in paths:
        if path.is_file():
            yield path.read_text(encoding="utf-8", errors="replace")
