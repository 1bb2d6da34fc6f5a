"""Forward+backward time and peak memory of each pattern against dense causal SDPA.

The ideal speedup is what a kernel doing only the visible work would reach: visible
(head, query, key) pairs of causal attention ÷ those of the pattern. The fraction of it that
the measured speedup reaches tells how much the fast path loses to padding, copies and
kernel launch overheads.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Iterable, Optional

import torch
import torch.nn.functional as F
from tqdm import tqdm

import attn_patterns
from sparse_ft.bench.machine import measure

DEFAULT_PATTERNS = ("s2", "scca_fixed", "scca_flow", "sda", "longmixed")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# What the peak-memory columns measure (sparse_ft.bench.machine.PeakMemory), for the report.
PEAK_MEMORY = {
    "cuda": "growth of torch.cuda.max_memory_allocated over one forward+backward",
    "cpu": "growth of the process's resident-set high-water mark (VmHWM, reset through /proc/self/clear_refs) "
    "over one forward+backward: includes allocator slack, excludes nothing torch allocates",
}


@dataclass
class Row:
    pattern: str
    seq_len: int
    heads: int
    kv_heads: int
    head_dim: int
    ms: float
    dense_ms: float
    speedup: float
    ideal: float
    fraction_of_ideal: float
    peak_mib: float
    dense_peak_mib: float


def _step(attend, q, k, v):
    def run():
        attend(q, k, v).sum().backward()
        for x in (q, k, v):  # drop the gradients so no run starts holding the last one's
            x.grad = None

    return run


def _dense(q, k, v):
    groups = q.shape[1] // k.shape[1]
    k, v = (x.repeat_interleave(groups, dim=1) for x in (k, v))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def run(
    lengths: Iterable[int],
    heads: Iterable[int],
    head_dims: Iterable[int],
    patterns: Iterable[str] = DEFAULT_PATTERNS,
    dtype: str = "fp32",
    device: str = "cpu",
    kv_heads: Optional[int] = None,
    warmup: int = 1,
    repeats: int = 3,
) -> list[Row]:
    dev = torch.device(device)
    rows: list[Row] = []
    configs = [(n, h, d) for n in lengths for h in heads for d in head_dims]
    patterns = list(patterns)
    bar = tqdm(total=len(configs) * (len(patterns) + 1), desc="bench attention", unit="run")
    for n, h, d in configs:
        hk = kv_heads or h
        gen = torch.Generator(device=dev).manual_seed(0)
        make = lambda heads_: torch.randn(1, heads_, n, d, generator=gen, device=dev, dtype=DTYPES[dtype], requires_grad=True)  # noqa: E731
        q, k, v = make(h), make(hk), make(hk)
        dense_ms, dense_mib = measure(_step(_dense, q, k, v), dev, warmup, repeats)
        bar.update()
        causal_pairs = attn_patterns.get("full").visible_pairs(n, h)
        for name in patterns:
            pattern = attn_patterns.get(name)
            ms, mib = measure(_step(pattern, q, k, v), dev, warmup, repeats)
            ideal = causal_pairs / pattern.visible_pairs(n, h)
            speedup = dense_ms / ms
            rows.append(Row(name, n, h, hk, d, ms, dense_ms, speedup, ideal, speedup / ideal, mib, dense_mib))
            bar.update()
    bar.close()
    return rows


def markdown(rows: list[Row]) -> str:
    lines = [
        "| pattern | N | H | Hkv | D | ms | dense ms | speedup | ideal | of ideal | peak MiB | dense peak MiB |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.pattern} | {r.seq_len} | {r.heads} | {r.kv_heads} | {r.head_dim} | {r.ms:.1f} | {r.dense_ms:.1f} | "
            f"{r.speedup:.2f}× | {r.ideal:.2f}× | {r.fraction_of_ideal:.2f} | {r.peak_mib:.0f} | {r.dense_peak_mib:.0f} |"
        )
    return "\n".join(lines)


def as_dicts(rows: list[Row]) -> list[dict]:
    return [asdict(r) for r in rows]
