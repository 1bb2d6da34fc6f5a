"""Name the machine a number was measured on, and measure peak memory honestly on it."""

from __future__ import annotations

import ctypes
import functools
import gc
import platform
import re
import statistics
import time
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import metadata
from typing import Callable, Hashable, Iterator, Optional

import torch
from torch.profiler import ProfilerActivity, profile

from sparse_ft.modeling.devices import default_device
from sparse_ft.modeling.dtypes import SHORT_NAMES, torch_dtype



def bench_dtype(short: str) -> torch.dtype:
    """A benchmark's ``--dtype`` (the short name, ``bf16``) as a torch dtype."""
    return torch_dtype(SHORT_NAMES[short])


def _cpu_name() -> str:
    cpu = platform.processor() or "cpu"
    try:
        with open("/proc/cpuinfo") as f:
            found = re.search(r"model name\s*:\s*(.+)", f.read())
            return found.group(1).strip() if found else cpu
    except OSError:
        return cpu


def describe(device: Optional[torch.device] = None) -> str:
    """The machine a number was measured on, in one line, as every benchmark, the experiment
    and pretraining record it: the GPU, else the CPU and its torch threads, and torch's
    version. None: the device this process computes on (CUDA where there is one)."""
    device = torch.device(default_device()) if device is None else device
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}"
    return f"{_cpu_name()}, {torch.get_num_threads()} torch threads, torch {torch.__version__}"


def versions(device: torch.device) -> dict[str, object]:
    """What a number depends on besides this code, for every benchmark's JSON: the kernels SDPA
    and Triton can pick change with torch, Triton, CUDA and cuDNN, and their speed with the GPU.
    None where this machine has none (CUDA, cuDNN and GPU on a CPU-only torch)."""
    try:
        triton: Optional[str] = metadata.version("triton")
    except metadata.PackageNotFoundError:
        triton = None
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return {"python": platform.python_version(), "torch": torch.__version__, "triton": triton,
            "cuda": torch.version.cuda, "cudnn": None if cudnn is None else str(cudnn),
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
            "cpu": _cpu_name(), "torch_threads": torch.get_num_threads()}


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
    while it runs: every allocation and free the profiler records (its ``[memory]`` events,
    each with its own time), summed in time order. Not the per-op sums ``prof.events()``
    gives: they date an op's frees at its start, so the inputs a backward op frees counted as
    gone before the outputs it makes; the tiny model's step at 4k tokens read 21.5 MiB that
    way against 25.5 MiB allocated (docs/memory.md)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    held = peak = 0
    for _, change in sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                            if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU):
        held += change
        peak = max(peak, held)
    return result, peak, held


class _HighWater:
    """The highest CUDA allocator peak read just before a reset inside the region PeakMemory
    measures (:class:`CallPeak` resets the counter to see one call's own peak), folded back
    into the region's peak."""

    bytes = 0


class PeakMemory:
    """Peak memory growth of one measured region, in MiB. CUDA: the allocator's peak (resets
    by :class:`CallPeak` inside the region folded back in). CPU (Linux): the process's resident
    high-water mark, reset through /proc/self/clear_refs after returning freed heap to the OS,
    minus the resident size before."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.mib = float("nan")

    @contextmanager
    def measure(self) -> Iterator["PeakMemory"]:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            _HighWater.bytes = 0
            before = torch.cuda.memory_allocated(self.device)
            yield self
            torch.cuda.synchronize(self.device)
            self.mib = (max(torch.cuda.max_memory_allocated(self.device), _HighWater.bytes) - before) / 2**20
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


class CallPeak:
    """A function's own peak: the most any call of the wrapped function allocated above what
    was allocated when that call began, in MiB, the largest since :meth:`start` (CUDA only: the
    CPU's resident high-water mark is process-wide and costs a system call to reset, so
    ``mib`` stays None there). The CUDA allocator keeps its counters on the host, so reading
    and resetting them per call needs no synchronisation; a :class:`PeakMemory` region around
    the calls keeps its own peak (the resets are folded back)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.mib: Optional[float] = None

    def start(self) -> None:
        self.mib = 0.0 if self.device.type == "cuda" else None

    def wrap(self, fn: Callable) -> Callable:
        if self.device.type != "cuda":
            return fn

        @functools.wraps(fn)
        def call(*args, **kwargs):
            _HighWater.bytes = max(_HighWater.bytes, torch.cuda.max_memory_allocated(self.device))
            torch.cuda.reset_peak_memory_stats(self.device)
            before = torch.cuda.memory_allocated(self.device)
            try:
                return fn(*args, **kwargs)
            finally:
                own = (torch.cuda.max_memory_allocated(self.device) - before) / 2**20
                self.mib = max(self.mib or 0.0, own)

        return call


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


class Unrunnable(Exception):
    """A run that cannot run here (a piece no kernel of the pinned backend takes): dropped from
    the measurement like one out of memory, its message recorded as the reason."""


@dataclass
class Timing:
    """Milliseconds of the measured runs and the peak memory growth (MiB) of one more; all None
    when the function failed, ``error`` saying why (``OOM``, or an :class:`Unrunnable`'s
    message)."""

    min_ms: Optional[float] = None
    median_ms: Optional[float] = None
    peak_mib: Optional[float] = None
    error: Optional[str] = None


def ratio(num: Optional[float], den: Optional[float]) -> Optional[float]:
    """``num / den``, None where either is missing (a failed measurement)."""
    return num / den if num and den else None


def interleaved(fns: dict[Hashable, Callable[[], object]], device: torch.device, warmup: int,
                repeats: int) -> dict[Hashable, Timing]:
    """``repeats`` rounds in which every function runs once, in order (baseline, p1, p2, ...,
    baseline, p1, ...), after ``warmup`` such rounds, then one more run of each for its peak
    memory growth. Round-robin exposes all to the same drift of a shared or heating machine;
    the minimum is the least disturbed run (load slows runs, never speeds them up) and the
    median the typical one. A function that runs out of memory or is :class:`Unrunnable`
    drops out with its reason; the others go on."""
    times: dict[Hashable, list[float]] = {name: [] for name in fns}
    results = {name: Timing() for name in fns}
    alive = dict(fns)

    def attempt(name: Hashable, run: Callable[[], object]) -> object:
        try:
            return run()
        except torch.cuda.OutOfMemoryError:
            results[name].error = "OOM"
        except Unrunnable as err:
            results[name].error = str(err)
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
            results[name] = Timing(min(times[name]), statistics.median(times[name]), mib)
    return results


def cell(value: Optional[float], fmt: str, missing: str = "OOM", suffix: str = "") -> str:
    """A table cell of a measurement: ``OOM`` where :func:`measure` gave none, ``–`` for a
    ratio to a measurement that is missing."""
    return missing if value is None else format(value, fmt) + suffix
