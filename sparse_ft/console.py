"""What a command prints besides its results: how much (``-q`` / ``-v``), and which library
warnings are dropped because they say nothing the user can act on.

The filters are narrow: each names the library, the warning's category or logger, and the
start of its message, so any other warning of the same library still shows (docs/training.md
lists them). ``-v`` installs none of them."""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from typing import Iterator

QUIET, NORMAL, VERBOSE = -1, 0, 1
_level = NORMAL

# (category, module the warning is raised from, start of its message): Python warnings
WARNINGS = [
    # PEFT's get_peft_model probes model.is_gradient_checkpointing, deprecated in transformers 5
    (FutureWarning, r"transformers\.modeling_utils", r"`is_gradient_checkpointing` is deprecated"),
    # older bitsandbytes: LLM.int8 casts its inputs to fp16 on every matmul, by design
    (UserWarning, r"bitsandbytes\.autograd\._functions", r"MatMul8bitLt: inputs will be cast"),
]
# (logger, start of its message): library log records
LOG_RECORDS = [
    # at import, on CPUs with AVX512-BF16: an optional CPU kernel for 4-bit layers (QLoRA on a
    # CPU) from the `kernels` package; bitsandbytes falls back to its own
    ("bitsandbytes.backends.cpu.ops", "Failed to load CPU gemm_4bit_forward"),
    # newer bitsandbytes logs LLM.int8's cast instead of warning it
    ("bitsandbytes.autograd._functions", "MatMul8bitLt: inputs will be cast"),
]


class _DropRecords(logging.Filter):
    """Drops its logger's records that start with ``starts``, unless the verbosity is -v (a
    logger keeps its filters for the life of the process)."""

    def __init__(self, starts: str) -> None:
        super().__init__()
        self.starts = starts

    def filter(self, record: logging.LogRecord) -> bool:
        return _level >= VERBOSE or not str(record.msg).startswith(self.starts)


def quiet_library_warnings() -> None:
    """Drop the library warnings of ``WARNINGS`` and ``LOG_RECORDS``, and no other."""
    for category, module, message in WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)
    for name, starts in LOG_RECORDS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropRecords) and f.starts == starts for f in logger.filters):
            logger.addFilter(_DropRecords(starts))


def set_verbosity(level: int) -> None:
    """``QUIET``: results, warnings and errors only, no progress bars (tqdm's own ``TQDM_DISABLE``, which
    the libraries' bars read too); ``NORMAL``: also a short summary of each run and progress
    bars; ``VERBOSE``: also the full resolved recipe, and no library warning filtered."""
    global _level
    _level = level
    if level == QUIET:
        os.environ["TQDM_DISABLE"] = "1"
    if level < VERBOSE:
        quiet_library_warnings()


def verbosity() -> int:
    return _level


def say(text: str, level: int = NORMAL) -> None:
    """Print ``text`` when the verbosity is at least ``level``."""
    if _level >= level:
        print(text, flush=True)


@contextlib.contextmanager
def quieter() -> Iterator[None]:
    """One level less inside: what a command runs as one step of its own (the experiment's
    training runs) prints what it would print one level down."""
    global _level
    saved = _level
    _level = saved - 1
    try:
        yield
    finally:
        _level = saved
