"""What a command prints besides its results: how much (``-q`` / ``-v``), and which library
warnings are dropped because they say nothing the user can act on.

The filters are narrow: each names the library, the warning's category or logger, and the
start of its message, so any other warning of the same library still shows (docs/training.md
lists them). ``-v`` installs none of them."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import warnings
from typing import Callable, Iterator, Optional

QUIET, NORMAL, VERBOSE = -1, 0, 1
_level = NORMAL

# (category, module the warning is raised from, start of its message): Python warnings
WARNINGS = [
    # PEFT's get_peft_model probes model.is_gradient_checkpointing, deprecated in transformers 5
    (FutureWarning, r"transformers\.modeling_utils", r"`is_gradient_checkpointing` is deprecated"),
    # older bitsandbytes: LLM.int8 casts its inputs to fp16 on every matmul, by design
    (UserWarning, r"bitsandbytes\.autograd\._functions", r"MatMul8bitLt: inputs will be cast"),
]


def _torch_without_gpus() -> bool:
    """torch built for CPUs only (no CUDA, no ROCm): there is no accelerator to miss. Asked when
    the record is logged, by which time the library has imported torch."""
    torch = sys.modules.get("torch")
    return torch is not None and torch.version.cuda is None and getattr(torch.version, "hip", None) is None


# (logger, start of its message[, when: dropped only while this holds]): library log records
LOG_RECORDS: list[tuple] = [
    # at import, on CPUs with AVX512-BF16: an optional CPU kernel for 4-bit layers (QLoRA on a
    # CPU) from the `kernels` package; bitsandbytes falls back to its own
    ("bitsandbytes.backends.cpu.ops", "Failed to load CPU gemm_4bit_forward"),
    # newer bitsandbytes logs LLM.int8's cast instead of warning it
    ("bitsandbytes.autograd._functions", "MatMul8bitLt: inputs will be cast"),
    # at import, "Setting accelerator to CPU. If you have GPU ...": news only where a GPU could
    # have been found, so kept where torch was built with CUDA or ROCm
    ("DeepSpeed", "Setting accelerator to CPU", _torch_without_gpus),
]


# Libraries whose loggers print on stdout, which holds a command's results only
# (``sparse-ft eval ppl ... > table.md``): DeepSpeed's handler writes to stdout, and its import
# logs "Setting accelerator to CPU" in every command that loads a model.
STDOUT_LOGGERS = ("DeepSpeed",)


class _ToStderr(logging.Filter):
    """On a library logger that prints on stdout: each record it would print goes to stderr,
    formatted as the library formats it, and its own handlers see none. A logger filter, set
    before the library creates its logger and kept when it adds its handler, so it holds for
    records logged while the library is being imported."""

    def __init__(self) -> None:
        super().__init__()
        self.formatter = logging.Formatter("[%(asctime)s] [%(levelname)s] [%(filename)s:%(lineno)d:%(funcName)s] %(message)s")

    def filter(self, record: logging.LogRecord) -> bool:
        print(self.formatter.format(record), file=sys.stderr, flush=True)
        return False


def library_logs_to_stderr() -> None:
    """Route the loggers of :data:`STDOUT_LOGGERS` to stderr (once per process)."""
    for name in STDOUT_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _ToStderr) for f in logger.filters):
            logger.addFilter(_ToStderr())


class _DropRecords(logging.Filter):
    """Drops its logger's records that start with ``starts``, unless the verbosity is -v (a
    logger keeps its filters for the life of the process)."""

    def __init__(self, starts: str, when: Optional[Callable[[], bool]] = None) -> None:
        super().__init__()
        self.starts, self.when = starts, when

    def filter(self, record: logging.LogRecord) -> bool:
        dropped = str(record.msg).startswith(self.starts) and (self.when is None or self.when())
        return _level >= VERBOSE or not dropped


def quiet_library_warnings() -> None:
    """Drop the library warnings of ``WARNINGS`` and ``LOG_RECORDS``, and no other."""
    for category, module, message in WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)
    for name, starts, *when in LOG_RECORDS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropRecords) and f.starts == starts for f in logger.filters):
            logger.addFilter(_DropRecords(starts, *when))


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


_row: Optional[str] = None  # what the progress bars run for, when a command runs several (the experiment's rows)


@contextlib.contextmanager
def row(name: str) -> Iterator[None]:
    """Inside, every progress bar's label starts with ``name``: the experiment's bars say which
    row (pattern and seed, or training-free method) they train or measure."""
    global _row
    saved = _row
    _row = name
    try:
        yield
    finally:
        _row = saved


def bar_label(text: str) -> str:
    """A progress bar's label, after the row it runs for (:func:`row`), if any."""
    return f"{_row}: {text}" if _row else text


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
