"""Name the machine a number was measured on, and measure peak memory honestly on it."""

from __future__ import annotations

import ctypes
import platform
import re
import statistics
import time
from contextlib import contextmanager
from typing import Callable, Iterator

import torch


def describe(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}"
    cpu = platform.processor() or "cpu"
    try:
        with open("/proc/cpuinfo") as f:
            found = re.search(r"model name\s*:\s*(.+)", f.read())
            cpu = found.group(1).strip() if found else cpu
    except OSError:
        pass
    return f"{cpu}, {torch.get_num_threads()} torch threads, torch {torch.__version__}"


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


class PeakMemory:
    """Peak memory growth of one measured region, in MiB. CUDA: the allocator's peak. CPU
    (Linux): the process's resident high-water mark, reset through /proc/self/clear_refs
    after returning freed heap to the OS, minus the resident size before."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.mib = float("nan")

    @contextmanager
    def measure(self) -> Iterator["PeakMemory"]:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            before = torch.cuda.memory_allocated(self.device)
            yield self
            torch.cuda.synchronize(self.device)
            self.mib = (torch.cuda.max_memory_allocated(self.device) - before) / 2**20
            return
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            before = _rss_kib("VmRSS")
        except OSError:
            yield self
            return
        yield self
        self.mib = (_rss_kib("VmHWM") - before) / 1024


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(fn: Callable[[], object], device: torch.device, warmup: int, repeats: int) -> tuple[float, float]:
    """Median milliseconds of ``fn`` over ``repeats`` runs after ``warmup``, and the peak
    memory growth (MiB) of one more run."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    peak = PeakMemory(device)
    with peak.measure():
        fn()
    return statistics.median(times), peak.mib
