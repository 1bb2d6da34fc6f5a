"""Devices named on a command line (``--device``): the default, and a device that does not
exist here refused in one line before anything loads (torch would say so in a traceback at
the first tensor moved there, after the weights have loaded)."""

from __future__ import annotations

import torch


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def check_device(device: str, flag: str = "--device") -> str:
    """``device`` when it exists here (``auto``, accelerate's placement, passes); ``ValueError``
    naming ``flag`` otherwise."""
    if device == "auto":
        return device
    try:
        parsed = torch.device(device)
    except RuntimeError as err:
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise ValueError(f"{flag} {device!r} is not a device ({first}); e.g. cpu, cuda, cuda:0, auto") from None
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{flag} {device!r}: torch sees no CUDA device here; use cpu (or omit {flag})")
        if parsed.index is not None and parsed.index >= torch.cuda.device_count():
            raise ValueError(f"{flag} {device!r}: torch sees {torch.cuda.device_count()} CUDA device(s) here, "
                             f"numbered from 0")
    return device
