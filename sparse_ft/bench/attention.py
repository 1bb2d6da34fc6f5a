"""Forward+backward time and peak memory of each pattern against dense causal SDPA.

The ideal speedup is what a kernel doing only the visible work would reach: visible
(head, query, key) pairs of causal attention ÷ those of the pattern. The fraction of it that
the measured speedup reaches tells how much the fast path loses to padding, copies and
kernel launch overheads. The baseline is the one SDPA call the patterns' blocks make
(``attn_patterns.kernels.sdpa``), causal over the whole sequence: on an H100 in bf16 torch runs
its flash kernel there, with grouped K/V natively. Every backend's rows share it, so the
backends compare with each other as well.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator, Optional

import torch
from tqdm import tqdm

import attn_patterns
from attn_patterns.kernels import sdpa
from sparse_ft.bench.machine import DTYPES, cell, measure

DEFAULT_PATTERNS = ("s2", "scca_fixed", "scca_flow", "sda", "longmixed")
# FlexAttention compiles one kernel per (pattern, length, grad mode); a sweep needs more than
# torch's default of 8 recompilations, past which it would silently run unfused.
FLEX_RECOMPILES = 256
# What the peak-memory columns measure (sparse_ft.bench.machine.PeakMemory), for the report.
PEAK_MEMORY = {
    "cuda": "growth of torch.cuda.max_memory_allocated over one forward+backward",
    "cpu": "growth of the process's resident-set high-water mark (VmHWM, reset through /proc/self/clear_refs) "
    "over one forward+backward: includes allocator slack, excludes nothing torch allocates",
}


@dataclass
class Row:
    pattern: str
    backend: str
    seq_len: int
    heads: int
    kv_heads: int
    head_dim: int
    ms: Optional[float]  # None: out of memory
    dense_ms: Optional[float]
    speedup: Optional[float]
    ideal: float
    fraction_of_ideal: Optional[float]
    peak_mib: Optional[float]
    dense_peak_mib: Optional[float]


def _step(attend, q, k, v):
    def run():
        attend(q, k, v).sum().backward()
        for x in (q, k, v):  # drop the gradients so no run starts holding the last one's
            x.grad = None

    return run


def _dense(q, k, v):
    return sdpa(q, k, v, mask=None, causal=True)


def run(
    lengths: Iterable[int],
    heads: Iterable[int],
    head_dims: Iterable[int],
    patterns: Iterable[str] = DEFAULT_PATTERNS,
    *, dtype: str = "fp32",
    device: str = "cpu",
    kv_heads: Optional[int] = None,
    warmup: int = 1,
    repeats: int = 3,
    backends: Iterable[str] = ("sdpa",),
) -> Iterator[Row]:
    dev = torch.device(device)
    configs = [(n, h, d) for n in lengths for h in heads for d in head_dims]
    patterns, backends = list(patterns), list(backends)
    bar = tqdm(total=len(configs) * (len(patterns) * len(backends) + 1), desc="bench attention", unit="run")
    for n, h, d in configs:
        hk = kv_heads or h
        gen = torch.Generator(device=dev).manual_seed(0)
        make = lambda heads_: torch.randn(1, heads_, n, d, generator=gen, device=dev, dtype=DTYPES[dtype], requires_grad=True)  # noqa: E731
        q, k, v = make(h), make(hk), make(hk)
        dense_ms, dense_mib = measure(_step(_dense, q, k, v), dev, warmup, repeats) or (None, None)
        bar.update()
        causal_pairs = attn_patterns.get("causal").visible_pairs(n, h)
        for backend in backends:
            for name in patterns:
                pattern = attn_patterns.get(name, backend=backend)
                with torch._dynamo.config.patch(cache_size_limit=FLEX_RECOMPILES):
                    ms, mib = measure(_step(pattern, q, k, v), dev, warmup, repeats) or (None, None)
                ideal = causal_pairs / pattern.visible_pairs(n, h)
                speedup = dense_ms / ms if ms and dense_ms else None
                bar.update()
                yield Row(name, backend, n, h, hk, d, ms, dense_ms, speedup, ideal,
                          None if speedup is None else speedup / ideal, mib, dense_mib)
        del q, k, v
    bar.close()


def markdown(rows: list[Row]) -> str:
    lines = [
        "| pattern | backend | N | H | Hkv | D | ms | dense ms | speedup | ideal | of ideal | peak MiB | dense peak MiB |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.pattern} | {r.backend} | {r.seq_len} | {r.heads} | {r.kv_heads} | {r.head_dim} | {cell(r.ms, '.1f')} | "
            f"{cell(r.dense_ms, '.1f')} | {cell(r.speedup, '.2f', '–', '×')} | {r.ideal:.2f}× | "
            f"{cell(r.fraction_of_ideal, '.2f', '–')} | {cell(r.peak_mib, '.0f')} | {cell(r.dense_peak_mib, '.0f')} |"
        )
    return "\n".join(lines)

