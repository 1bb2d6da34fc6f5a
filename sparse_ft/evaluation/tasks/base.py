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
from sparse_ft.evaluation.names import FLAGS, BadParameter, Names


class Task:
    """Base class. A subclass's constructor parameters are what a caller may set
    (``TASKS.get(name, **params)`` checks them); :meth:`from_args` builds it from the flags
    that :meth:`configure` adds."""

    name: str = "task"
    summary: str = ""  # one line in ``sparse-ft eval --help``
    description: str = ""  # the sub-command's description (default: the summary)
    picture: Optional[str] = None  # the flag naming its PNG (``plot``, ``heatmap``), if it draws one
    lengths: list[int] = []  # the lengths it runs the method at (the method is checked at each first)
    names: Names = FLAGS  # what its messages call its parameters: set by :meth:`check`

    @classmethod
    def configure(cls, parser: argparse.ArgumentParser) -> None:
        """Add the task's own flags (the model flags are shared)."""

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "Task":
        """The task the flags describe; a bad flag is a one-line ValueError, before the model loads."""
        raise NotImplementedError(f"task {cls.name!r} has no command line")

    def check(self, names: Names) -> None:
        """Refuse a parameter the task cannot run with (a :class:`BadParameter` naming it as
        ``names`` says), before anything loads: ``from_args`` calls it with eval's flags,
        validation during training with the recipe's keys. A subclass checks its own
        parameters after calling this, which checks the lengths and keeps ``names`` for
        :meth:`prepare`'s messages."""
        self.names = names
        check_lengths(self.lengths, names)

    def inputs(self) -> dict[str, Any]:
        """Local files the task reads, by flag: no output may overlap them."""
        return {}

    def check_method(self, method: Any) -> None:
        """Refuse a method this task cannot run through, before the model loads."""

    def check_model(self, config: Any) -> None:
        """Refuse a model this task cannot measure, from its config, before the weights load."""

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
    """A comma list of integers, as every length flag takes (:func:`check_lengths` checks them)."""
    try:
        return [int(x) for x in text.split(",") if x]
    except ValueError:
        raise ValueError(f"{flag} {text!r} must be a comma-separated list of integers") from None


def check_lengths(lengths: Any, names: Names) -> None:
    """A non-empty list of positive integers, each a length a model can be asked for
    (``attn_patterns.checks.length_rule``)."""
    from attn_patterns.checks import length_rule

    if not isinstance(lengths, list) or not lengths:
        raise BadParameter(f"{names.say('lengths', lengths)} must list positive integers")
    for n in lengths:
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise BadParameter(f"{names.entry('lengths', n)} must be a positive integer")
        if length_rule(n) is not None:
            raise BadParameter(f"{names.entry('lengths', n)}: {length_rule(n)}")


def check_number(names: Names, param: str, value: Any, *, least: float = 1, integer: bool = True) -> None:
    """An integer (or with ``integer=False`` a number) ``>= least``."""
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not value >= least:
        bound = f" >= {least:g}" if least > float("-inf") else ""
        raise BadParameter(f"{names.say(param, value)} must be {'an integer' if integer else 'a number'}{bound}")


# What prompts cost in memory, rounded up from 1M-token prompts of passkey and RULER's tasks (about
# 400 bytes a token at the peak of a build with the tiny tokenizer): the text, its encoding and
# the ids of the prompt being built; and a prompt kept (RULER's are all built before the weights
# load): its ids, a Python int and a list slot each, and its text.
BUILD_BYTES_PER_TOKEN = 1024
KEPT_BYTES_PER_TOKEN = 48


def available_memory() -> int:
    """Bytes of memory this process may still take without swapping."""
    import psutil

    return int(psutil.virtual_memory().available)


def check_memory(lengths: list[int], names: Names, *, kept: int) -> None:
    """The prompts at ``lengths`` fit in the memory available now: building one takes about
    ``BUILD_BYTES_PER_TOKEN`` a token of the longest, and a task that keeps ``kept`` prompts of
    every length ``KEPT_BYTES_PER_TOKEN`` a token of each. Checked before anything is built:
    beyond it, building would swap or be killed (or seem to hang), not fail."""
    need = BUILD_BYTES_PER_TOKEN * max(lengths) + KEPT_BYTES_PER_TOKEN * kept * sum(lengths)
    available = available_memory()
    if need > available:
        keeping = f", and {KEPT_BYTES_PER_TOKEN} a token to keep each of its {kept} prompts per length" if kept else ""
        raise BadParameter(f"{names.entry('lengths', max(lengths))}: its prompts need about {_gib(need)} of memory "
                           f"({BUILD_BYTES_PER_TOKEN} bytes a token to build one{keeping}), more than the "
                           f"{_gib(available)} available here; lower it")


def _gib(size: int) -> str:
    return f"{size / 2**30:,.1f} GiB"
