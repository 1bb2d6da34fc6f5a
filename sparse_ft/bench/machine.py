"""Name the machine a number was measured on, and measure peak memory honestly on it."""

from __future__ import annotations

import ctypes
import gc
import platform
import re
import statistics
import time
from contextlib import contextmanager
from typing import Callable, Iterator, Optional

import torch
from torch.profiler import ProfilerActivity, profile

from sparse_ft.modeling.dtypes import SHORT_NAMES as DTYPE_NAMES  # the benchmarks' --dtype values -> recipe names
from sparse_ft.modeling.dtypes import torch_dtype

DTYPES = {short: torch_dtype(name) for short, name in DTYPE_NAMES.items()}


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


def held_bytes(device: torch.device) -> int:
    """Bytes held now: the CUDA allocator's, or (CPU) the process's resident size once freed
    heap went back to the OS (what a model and its optimizer state occupy, measured as the
    difference of two calls)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return torch.cuda.memory_allocated(device)
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    return _rss_kib("VmRSS") * 1024


def allocated(fn: Callable[[], object]) -> tuple[object, int, int]:
    """``fn()``, the peak growth and the net growth of the bytes torch's CPU allocator holds
    while it runs: the profiler's memory events (allocations attributed to the op that made
    them, frees outside ops as ``[memory]`` events) summed in time order. Transients allocated
    and freed inside one op are not seen."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    held = peak = 0
    for _, change in sorted((e.time_range.start, e.self_cpu_memory_usage) for e in prof.events()
                            if e.self_cpu_memory_usage):
        held += change
        peak = max(peak, held)
    return result, peak, held


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


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _timed(fn: Callable[[], object], device: torch.device) -> float:
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return (time.perf_counter() - start) * 1e3


def _peak(fn: Callable[[], object], device: torch.device) -> float:
    peak = PeakMemory(device)
    with peak.measure():
        fn()
    return peak.mib


def measure(fn: Callable[[], object], device: torch.device, warmup: int, repeats: int) -> Optional[tuple[float, float]]:
    """Median milliseconds of ``fn`` over ``repeats`` runs after ``warmup``, and the peak
    memory growth (MiB) of one more run; None if the device ran out of memory, so that a
    sweep records the size as OOM and goes on (full attention at 32k is expected to)."""
    try:
        for _ in range(warmup):
            fn()
        times = [_timed(fn, device) for _ in range(repeats)]
        return statistics.median(times), _peak(fn, device)
    except torch.cuda.OutOfMemoryError:
        _free(device)
        return None


def interleaved(fns: dict[str, Callable[[], object]], device: torch.device, warmup: int,
                repeats: int) -> dict[str, Optional[tuple[float, float]]]:
    """Fastest of ``repeats`` alternating runs of each function (a shared machine slows runs,
    never speeds them up, so the minimum is the least disturbed one and alternation exposes
    all to the same load), and the peak memory growth (MiB) of one more run of each. A
    function that runs out of memory gets None and drops out; the others go on."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    results: dict[str, Optional[tuple[float, float]]] = {name: None for name in fns}
    alive = dict(fns)

    def attempt(name: str, run: Callable[[], object]) -> object:
        try:
            return run()
        except torch.cuda.OutOfMemoryError:
            alive.pop(name)
            _free(device)
            return None

    for _ in range(warmup):
        for name, fn in list(alive.items()):
            attempt(name, fn)
    for _ in range(repeats):
        for name, fn in list(alive.items()):
            ms = attempt(name, lambda: _timed(fn, device))  # noqa: B023 (called at once)
            if ms is not None:
                times[name].append(ms)
    for name, fn in list(alive.items()):
        mib = attempt(name, lambda: _peak(fn, device))  # noqa: B023 (called at once)
        if mib is not None:
            results[name] = (min(times[name]), mib)
    return results

def cell(value: Optional[float], fmt: str, missing: str = "OOM", suffix: str = "") -> str:
    """A table cell of a measurement: ``OOM`` where :func:`measure` gave none, ``–`` for a
    ratio to a measurement that is missing."""
    return missing if value is None else format(value, fmt) + suffix
