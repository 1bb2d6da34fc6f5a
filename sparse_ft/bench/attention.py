"""Forward+backward time and peak memory of each pattern against dense causal SDPA.

The ideal speedup is what a kernel doing only the visible work would reach: visible
(head, query, key) pairs of causal attention ÷ those of the pattern. The fraction of it that
the measured speedup reaches tells how much the fast path loses to padding, copies and
kernel launch overheads; it equals the pattern's TFLOP/s over its own pairs ÷ the dense
kernel's TFLOP/s (FLOPs as ``sparse_ft.bench.dense_kernel`` counts them).

Method, per (N, H, D): the baseline is one causal SDPA call over the whole sequence (the call
the patterns' blocks make, ``attn_patterns.kernels.sdpa``). One unpinned run of it under the
profiler names the kernel SDPA picked; from then on the baseline and every pattern run under
that one backend (``dense_kernel.DenseKernel.pin``), so neither side gets a kernel the other
does not. Baseline and patterns then run round-robin (baseline, p1, p2, ..., baseline, p1, ...):
``warmup`` rounds, ``repeats`` measured rounds, min and median of each, speedups from the
medians and from the mins. Every backend's rows share the baseline, so backends compare with
each other as well. A pattern whose piece the pinned backend cannot take, or that runs out of
memory, gets a row saying so.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator, Optional

import torch
from tqdm import tqdm

import attn_patterns
from attn_patterns.kernels import sdpa
from sparse_ft.bench import dense_kernel
from sparse_ft.bench.dense_kernel import DenseKernel
from sparse_ft.bench.machine import bench_dtype, cell, interleaved, ratio

# FlexAttention compiles one kernel per (pattern, length, grad mode); a sweep needs more than
# torch's default of 8 recompilations, past which it would silently run unfused.
FLEX_RECOMPILES = 256
# What the peak-memory columns measure (sparse_ft.bench.machine.PeakMemory), for the report: the
# measured step is the attention call's forward and backward, so this is the call's own peak.
PEAK_MEMORY = {
    "cuda": "growth of torch.cuda.max_memory_allocated over one forward+backward of the attention call above its "
    "inputs q, k, v (output, gradients of q, k, v, and the kernels' workspace)",
    "cpu": "growth of the process's resident-set high-water mark (VmHWM, reset through /proc/self/clear_refs) "
    "over one forward+backward of the attention call above its inputs: includes allocator slack, excludes "
    "nothing torch allocates",
}
DENSE = ("dense", "")  # the baseline's key among the interleaved runs; patterns are (backend, name)


@dataclass
class Row:
    pattern: str
    backend: str
    seq_len: int
    heads: int
    kv_heads: int
    head_dim: int
    ms_min: Optional[float]  # None: failed, ``error`` says why
    ms_median: Optional[float]
    dense_ms_min: Optional[float]
    dense_ms_median: Optional[float]
    speedup: Optional[float]  # of the medians
    speedup_min: Optional[float]  # of the mins
    ideal: float  # causal pairs / pattern pairs
    fraction_of_ideal: Optional[float]  # speedup / ideal
    fraction_of_ideal_min: Optional[float]
    tflops: Optional[float]  # the pattern's own pairs, forward+backward, at its median
    dense_tflops: Optional[float]
    dense_kernel: Optional[DenseKernel]  # None: the profiled dense call ran out of memory (nothing pinned)
    peak_mib: Optional[float]  # PEAK_MEMORY
    dense_peak_mib: Optional[float]
    error: Optional[str] = None
    dense_error: Optional[str] = None


def default_patterns() -> list[str]:
    """Every registered pattern that builds from its name alone, in registration order, but
    ``causal``: the baseline's own visible set (``mixed`` needs its parts)."""
    registry = attn_patterns.PATTERNS
    return [name for name in registry.names() if name != "causal" and not registry.required(name)]


def sinks_name(pattern: str, sink_tokens: int) -> str:
    """``pattern`` built with ``sink_tokens`` sink tokens, as tables name it (beside
    ``dense_layers_name``'s ``s2 + full in [0]``): its own row, so the sinks' cost reads
    against the plain pattern's."""
    return f"{pattern} + {sink_tokens} sinks"


def _step(attend, q, k, v):
    def run():
        attend(q, k, v).sum().backward()
        for x in (q, k, v):  # drop the gradients so no run starts holding the last one's
            x.grad = None

    return run


def _dense(q, k, v):
    return sdpa(q, k, v, causal=True)


def run(
    lengths: Iterable[int],
    heads: Iterable[int],
    head_dims: Iterable[int],
    patterns: Optional[Iterable[str]] = None,
    *, dtype: str = "fp32",
    device: str = "cpu",
    kv_heads: Optional[int] = None,
    warmup: int = 1,
    repeats: int = 5,
    backends: Iterable[str] = ("sdpa",),
    sdpa_backend: Optional[str] = None,
    sink_tokens: int = 0,
) -> Iterator[Row]:
    """Rows of one (N, H, D) come together, after its last round (round-robin needs them all).
    ``patterns`` defaults to :func:`default_patterns`. ``sdpa_backend`` (a key of
    ``dense_kernel.BACKENDS``) pins that backend instead of the one SDPA picks. With
    ``sink_tokens`` each pattern is also measured with that many sink tokens, a row of its own
    (:func:`sinks_name`) whose ideal counts its own pairs, the sinks' included."""
    dev = torch.device(device)
    configs = [(n, h, d) for n in lengths for h in heads for d in head_dims]
    patterns, backends = list(default_patterns() if patterns is None else patterns), list(backends)
    for n, h, d in tqdm(configs, desc="bench attention", unit="size"):
        hk = kv_heads or h
        gen = torch.Generator(device=dev).manual_seed(0)
        make = lambda heads_: torch.randn(1, heads_, n, d, generator=gen, device=dev, dtype=bench_dtype(dtype), requires_grad=True)  # noqa: E731
        q, k, v = make(h), make(hk), make(hk)
        kernel = dense_kernel.find(_step(_dense, q, k, v), dev, sdpa_backend)
        pin = kernel.pin if kernel else (lambda fn, pieces=False: fn)
        chosen: dict[tuple[str, str], attn_patterns.Pattern] = {}
        for backend in backends:
            for name in patterns:
                chosen[(backend, name)] = attn_patterns.get(name, backend=backend)
                if sink_tokens:  # as a recipe's attention.params.sink_tokens sets them (sf_attn's own 4 replaced)
                    sinks = attn_patterns.get(name, backend=backend, sink_tokens=sink_tokens)
                    chosen[(backend, sinks_name(name, sink_tokens))] = sinks
        runs = {DENSE: pin(_step(_dense, q, k, v)),
                **{key: pin(_step(pattern, q, k, v), pieces=True) for key, pattern in chosen.items()}}
        with torch._dynamo.config.patch(cache_size_limit=FLEX_RECOMPILES):
            got = interleaved(runs, dev, warmup, repeats)
        del q, k, v, runs  # the runs hold them too
        causal_pairs = attn_patterns.get("causal").visible_pairs(n, h)
        dense = got[DENSE]
        dense_tflops = dense_kernel.tflops(causal_pairs, d, dense.median_ms, backward=True)
        for (backend, name), pattern in chosen.items():
            mine = got[(backend, name)]
            pairs = pattern.visible_pairs(n, h)
            ideal = causal_pairs / pairs
            speedup, speedup_min = ratio(dense.median_ms, mine.median_ms), ratio(dense.min_ms, mine.min_ms)
            yield Row(name, backend, n, h, hk, d, mine.min_ms, mine.median_ms, dense.min_ms, dense.median_ms,
                      speedup, speedup_min, ideal, ratio(speedup, ideal), ratio(speedup_min, ideal),
                      dense_kernel.tflops(pairs, d, mine.median_ms, backward=True), dense_tflops, kernel,
                      mine.peak_mib, dense.peak_mib, mine.error, dense.error)


def _failed(error: Optional[str]) -> str:
    return "OOM" if error in (None, "OOM") else "no kernel"


def markdown(rows: list[Row]) -> str:
    """The table, then each distinct dense kernel with the names the profiler gave it."""
    lines = [
        "| pattern | backend | N | H | Hkv | D | ms min | ms median | dense ms min | dense ms median | speedup | "
        "speedup (mins) | ideal | of ideal | TFLOP/s | dense kernel | dense TFLOP/s | fwd+bwd peak MiB | "
        "dense fwd+bwd peak MiB |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|",
    ]
    for r in rows:
        mine, dense = _failed(r.error), _failed(r.dense_error)
        lines.append(
            f"| {r.pattern} | {r.backend} | {r.seq_len} | {r.heads} | {r.kv_heads} | {r.head_dim} | "
            f"{cell(r.ms_min, '.2f', mine)} | {cell(r.ms_median, '.2f', mine)} | {cell(r.dense_ms_min, '.2f', dense)} | "
            f"{cell(r.dense_ms_median, '.2f', dense)} | {cell(r.speedup, '.2f', '–', '×')} | "
            f"{cell(r.speedup_min, '.2f', '–', '×')} | {r.ideal:.2f}× | {cell(r.fraction_of_ideal, '.2f', '–')} | "
            f"{cell(r.tflops, '.3g', '–')} | {r.dense_kernel.label if r.dense_kernel else 'not pinned'} | "
            f"{cell(r.dense_tflops, '.3g', '–')} | {cell(r.peak_mib, '.0f', mine)} | {cell(r.dense_peak_mib, '.0f', dense)} |"
        )
    kernels = {r.dense_kernel: None for r in rows if r.dense_kernel}
    notes = [f"- {k.label}: {k.backend}, {k.detail}" + ("" if k.piece_backend == k.backend else
             f"; the patterns' SDPA pieces pinned to {k.piece_backend} (cuDNN is wrong on strided views)") for k in kernels]
    notes += [f"- {r.pattern} ({r.backend}) at N={r.seq_len}: {r.error}" for r in rows if r.error not in (None, "OOM")]
    return "\n".join(lines + ([""] + notes if notes else []))
