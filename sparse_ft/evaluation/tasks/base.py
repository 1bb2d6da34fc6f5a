"""The task protocol: what ``sparse-ft eval`` needs to know of an evaluation.

A task is one class, registered in ``TASKS`` where it is defined (as patterns and methods
are): its command-line flags, how it is built from them (every flag checked before anything
loads), what it asks the model through a method, and its rows in the report (JSON and a
markdown table, optionally a picture). ``sparse-ft eval NAME`` exists for every registered
name, and the experiment builds its evaluations from the same registry.

Task modules import nothing heavy at the top: the command line builds every task's parser
to answer ``--help`` at once, without torch.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Optional

from attn_patterns.registry import Registry


class Task:
    """Base class. A subclass's constructor parameters are what a caller may set
    (``TASKS.get(name, **params)`` checks them); :meth:`from_args` builds it from the flags
    that :meth:`configure` adds."""

    name: str = "task"
    summary: str = ""  # one line in ``sparse-ft eval --help``
    description: str = ""  # the sub-command's description (default: the summary)
    picture: Optional[str] = None  # the flag naming its PNG (``plot``, ``heatmap``), if it draws one
    lengths: list[int] = []  # the lengths it runs the method at (the method is checked at each first)

    @classmethod
    def configure(cls, parser: argparse.ArgumentParser) -> None:
        """Add the task's own flags (the model flags are shared)."""

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "Task":
        """The task the flags describe; a bad flag is a one-line ValueError, before the model loads."""
        raise NotImplementedError(f"task {cls.name!r} has no command line")

    def inputs(self) -> dict[str, Any]:
        """Local files the task reads, by flag: no output may overlap them."""
        return {}

    def check_method(self, method: Any) -> None:
        """Refuse a method this task cannot run through, before the model loads."""

    def needs_tokenizer(self) -> bool:
        return True

    def prepare(self, tokenizer: Any) -> None:
        """Work that needs the tokenizer but not the weights (building prompts): its errors
        come before the weights load."""

    def evaluate(self, model: Any, tokenizer: Any, method: Any) -> list[dict]:
        """The result rows of ``model`` attending through ``method``."""
        raise NotImplementedError

    def table(self, rows: list[dict], label: str) -> str:
        """The rows as a markdown table."""
        raise NotImplementedError

    def summary_of(self, rows: list[dict]) -> dict:
        """Fields the results JSON carries beside its rows (none by default)."""
        return {}

    def draw(self, rows: list[dict], output: Path, *, label: str, model: str, writer: str) -> Path:
        """The picture named by the ``picture`` flag; its title names ``model`` and the run's ``label``."""
        raise NotImplementedError(f"task {self.name!r} draws no picture")


TASKS: Registry[Task] = Registry("task", Task)
register = TASKS.register


def lengths_flag(text: str, flag: str = "--lengths") -> list[int]:
    """A comma list of positive integers, as every length flag takes."""
    try:
        values = [int(x) for x in text.split(",") if x]
    except ValueError:
        raise ValueError(f"{flag} {text!r} must be a comma-separated list of integers") from None
    if not values or min(values) < 1:
        raise ValueError(f"{flag} {text!r} must list positive integers")
    return values
