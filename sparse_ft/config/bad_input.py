"""How a bad recipe value or input is refused: one exception type, one message shape. The
recipe's checks (``schema``, ``loader``), the trainer's preflight, checkpoints, metrics and
validation during training, and ``plan`` all raise it, so ``train.py`` tells a bad input (its
one line, exit 2) from a failure (a traceback) by type alone."""

from __future__ import annotations

from typing import Any, NoReturn


class BadInput(ValueError):
    """A recipe value or input file the run cannot use, found before anything loaded or was
    written: train.py prints its one line and exits 2, where any other error keeps its
    traceback."""


def fail(key: str, value: Any, allowed: str) -> NoReturn:
    raise BadInput(f"recipe key {key}={value!r} is invalid: {allowed}")


def one_line(err: BaseException) -> str:
    """The message of the error that caused ``err`` (transformers wraps its config checks in a
    multi-line validation error), on one line."""
    cause = err.__cause__ or err
    return " ".join(str(cause).split()) or type(cause).__name__
