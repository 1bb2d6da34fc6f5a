"""Dual Chunk Attention prefill against causal SDPA on the same q, k, v, in the same run.

The paper's claim is cost "comparable to Flash Attention": DCA computes every causal pair
exactly once (intra-chunk causal, successive and inter-chunk non-causal pieces), plus O(N·D)
rotations and log-sum-exp merges. Targets: at most 1.2× causal SDPA's time at 32k on a GPU
(1.5× on CPU), memory growing linearly with N. With ``longheads``, LongHeads (chunks of 256 tokens,
or c/16 for a shorter c, as many per head as fit c) runs on the same q, k, v: its target is at least
half of DCA's throughput, the price of choosing chunks per head. On CUDA the baseline is pinned to SDPA's flash
kernel, the one it is compared with, so that a fallback to another kernel cannot flatter DCA.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from typing import Iterable, Iterator, Optional

import torch
import torch.nn.functional as F
from tqdm import tqdm

from attn_patterns.dca import dca_attention, resolve
from attn_patterns.longheads import LongHeads
from attn_patterns.rotary import default_inv_freq, rotate
from sparse_ft.bench.machine import DTYPES, cell, interleaved


def _flash_only(device: torch.device):
    if device.type != "cuda":
        return nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(SDPBackend.FLASH_ATTENTION)


def _causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    with _flash_only(q.device):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])


def run(lengths: Iterable[int], heads: int = 8, kv_heads: int = 2, head_dim: int = 64, *,
        pretraining_length: int = 4096, longheads: bool = False,
        dtype: str = "fp32", device: str = "cpu", warmup: int = 1, repeats: int = 3) -> Iterator[dict]:
    """One row per length: the fastest of alternating runs (robust on a shared machine) and
    the peak memory growth of one call of each; ``memory_exponent`` is the log-log slope of
    DCA's peak memory against N since the previous length (1 = linear, 2 = quadratic)."""
    dev = torch.device(device)
    s, w, c = resolve(pretraining_length)
    inv_freq = default_inv_freq(head_dim).to(dev)
    previous: Optional[tuple[int, float]] = None
    for n in tqdm(list(lengths), desc="dca prefill", unit="length"):
        g = torch.Generator(device=dev).manual_seed(n)
        make = lambda h: torch.randn(1, h, n, head_dim, generator=g, device=dev, dtype=DTYPES[dtype])  # noqa: E731
        q, k, v = make(heads), make(kv_heads), make(kv_heads)
        pos = torch.arange(n, device=dev)
        q, k = rotate(q, pos, inv_freq), rotate(k, pos, inv_freq)  # as transformers hands them over
        runs = {"dense": lambda: _causal(q, k, v),
                "dca": lambda: dca_attention(q, k, v, inv_freq=inv_freq, chunk_size=s, local_window=w, pretraining_length=c)}
        if longheads:
            runs["longheads"] = lambda: LongHeads(chunk_size=min(256, c // 16), pretraining_length=c).attend(
                q, k, v, inv_freq=inv_freq)
        with torch.inference_mode():
            got = interleaved(runs, dev, warmup, repeats)
        del q, k, v
        dense_ms, dense_mib = got["dense"] or (None, None)
        dca_ms, dca_mib = got["dca"] or (None, None)
        longheads_ms, longheads_mib = got.get("longheads") or (None, None)
        exponent = None
        if previous and dca_mib and previous[1] > 0:
            exponent = math.log(dca_mib / previous[1]) / math.log(n / previous[0])
        previous = (n, dca_mib) if dca_mib else None
        yield {"seq_len": n, "dca_ms": dca_ms, "dense_ms": dense_ms,
               "time_ratio": dca_ms / dense_ms if dca_ms and dense_ms else None,
               "dca_peak_mib": dca_mib, "dense_peak_mib": dense_mib, "memory_exponent": exponent,
               "chunk_size": s, "local_window": w,
               **({"longheads_ms": longheads_ms, "longheads_peak_mib": longheads_mib,
                   "longheads_vs_dca_throughput": dca_ms / longheads_ms if dca_ms and longheads_ms else None}
                  if longheads else {})}


def markdown(rows: list[dict]) -> str:
    longheads = bool(rows) and "longheads_ms" in rows[0]
    extra = " LongHeads ms | LongHeads peak MiB | LongHeads / DCA throughput |" if longheads else ""
    table = ["| N | DCA ms | causal SDPA ms | DCA / SDPA | DCA peak MiB | SDPA peak MiB | DCA memory exponent |" + extra,
             "|---:|---:|---:|---:|---:|---:|---:|" + "---:|" * (3 if longheads else 0)]
    for r in rows:
        line = (f"| {r['seq_len']} | {cell(r['dca_ms'], '.1f')} | {cell(r['dense_ms'], '.1f')} | "
                f"{cell(r['time_ratio'], '.3f', '–')} | {cell(r['dca_peak_mib'], '.1f')} | "
                f"{cell(r['dense_peak_mib'], '.1f')} | {cell(r['memory_exponent'], '.2f', '–')} |")
        if longheads:
            line += (f" {cell(r['longheads_ms'], '.1f')} | {cell(r['longheads_peak_mib'], '.1f')} | "
                     f"{cell(r['longheads_vs_dca_throughput'], '.2f', '–')} |")
        table.append(line)
    return "\n".join(table)
