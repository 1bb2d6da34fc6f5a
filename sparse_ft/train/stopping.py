"""Why a run stops before its last step, or saves between its ``train.save_steps``:

* a stop signal (SIGTERM from Slurm, Kubernetes, ``timeout`` or a launcher; SIGINT from
  Ctrl-C) lets the optimizer step in progress finish, then the run writes a checkpoint and
  exits with 128 + the signal's number (143, 130): the code a shell reports for a process that
  signal ended, so schedulers read it as what it was, and a requeued job resumes;
* ``train.save_minutes`` adds a checkpoint whenever that much time passed since the last one,
  for the kills no signal announces (SIGKILL, a lost node);
* a non-finite loss or gradient norm stops the run before anything is saved from it.

A signal may reach one rank only, and clocks differ between ranks: each rank reports what it
saw and every rank acts on the maximum (``Engine.agree``), so all save at the same step.

No torch here: the command line catches :class:`RunStopped` without importing it.
"""

from __future__ import annotations

import math
import os
import signal
import threading
from time import monotonic
from types import FrameType, TracebackType
from typing import Optional

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class RunStopped(Exception):
    """The run stopped on purpose with its checkpoints intact: the command prints the message
    (once, on the rank that ``announce``s) and exits with ``exit_code``, no traceback."""

    def __init__(self, message: str, exit_code: int, *, announce: bool) -> None:
        super().__init__(message)
        self.exit_code = exit_code
        self.announce = announce


class Preempted(RunStopped):
    """A stop signal: exit code 128 + its number."""

    def __init__(self, message: str, signum: int, *, announce: bool) -> None:
        super().__init__(message, 128 + signum, announce=announce)


class Failed(RunStopped):
    """An error that stopped the run with its checkpoints intact: exit code 1."""

    def __init__(self, message: str, *, announce: bool) -> None:
        super().__init__(f"error: {message}", 1, announce=announce)


class Diverged(Failed):
    """A non-finite loss, gradient norm or weight: nothing of it saved."""


class ValidationFailed(Failed):
    """A validation task that failed during training (what no check could foresee: memory, a
    library's error): the step's checkpoint is saved first, so the run resumes there once the
    validation keys, which are no resume keys, are corrected."""


class WrongAttention(Failed):
    """The launch's first step did not run the attention method the recipe installed (a
    library routed its layers around it, ``sparse_ft.modeling.attention.checked_calls``):
    nothing of that step saved."""


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


class StopSignals:
    """SIGTERM and SIGINT caught for a run's duration (in the main thread, the only one Python
    delivers signals to). Until ``deferred`` (before training begins) a signal stops the run
    at once: nothing trained is lost. Once deferred, a signal is only recorded, for the loop to
    act on after the step in progress; so is every later one, since a launcher forwards the
    signal its process group already got (a rank sees it twice) and a second one must not cost
    the save. SIGKILL still ends a run at once; ``train.save_minutes`` bounds what that loses."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.received = 0  # the first signal's number; 0: none
        self.deferred = False
        self._previous: dict[int, object] = {}

    def __enter__(self) -> "StopSignals":
        if self.enabled and threading.current_thread() is threading.main_thread():
            for signum in SIGNALS:
                if signal.getsignal(signum) is not signal.SIG_IGN:  # ignored on purpose (nohup, a background job)
                    self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, kind: Optional[type], error: Optional[BaseException], trace: Optional[TracebackType]) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: Optional[FrameType]) -> None:
        self.received = self.received or signum
        if not self.deferred:
            # the launchers export RANK; every rank stops, one says so
            raise Preempted(f"stopped by {signal_name(signum)} before training began: nothing to save; "
                            "the same command starts (or resumes) the run", signum,
                            announce=os.environ.get("RANK", "0") == "0")


class SaveClock:
    """``train.save_minutes``: due once that long has passed since the last checkpoint (or the
    start); never when 0. Each rank reads its own clock, so the ranks agree before they save."""

    def __init__(self, minutes: float) -> None:
        self.seconds = minutes * 60
        self.restart()

    def restart(self) -> None:
        self.since = monotonic()

    def due(self) -> bool:
        return self.seconds > 0 and monotonic() - self.since >= self.seconds


def non_finite(loss: float, grad_norm: float, *, norm_expected: bool) -> Optional[str]:
    """What in a step is non-finite, or None. ``norm_expected``: the engine says a non-finite
    gradient norm is no divergence this step (fp16's loss scaler skipped it:
    ``Engine.non_finite_norm_expected``); a non-finite loss always is, since the forward
    pass itself overflowed and no loss scale changes that."""
    if not math.isfinite(loss):
        return f"the loss is {loss}"
    if not math.isfinite(grad_norm) and not norm_expected:
        return f"the gradient norm is {grad_norm}"
    return None
