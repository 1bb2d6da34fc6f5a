"""Dual Chunk Attention prefill against causal SDPA on the same q, k, v, in the same run.

The paper's claim is cost "comparable to Flash Attention": DCA computes every causal pair
exactly once (intra-chunk causal, successive and inter-chunk non-causal pieces), plus O(N·D)
rotations and log-sum-exp merges. Targets: at most 1.2× causal SDPA's time at 32k on a GPU
(1.5× on CPU), memory growing linearly with N. With ``longheads``, LongHeads (chunks of 256 tokens,
or c/16 for a shorter c, as many per head as fit c) runs on the same q, k, v: its target is at least
half of DCA's throughput, the price of choosing chunks per head.

Method, per length: one unpinned causal SDPA call under the profiler names the kernel SDPA
picks (``dense_kernel``); the baseline, DCA and LongHeads then run with SDPA pinned to that
backend. DCA's pieces call torch's fused attention ops directly (they need the log-sum-exp),
which the pin does not steer, so one profiled DCA call names the ops and kernels DCA ran
(``dca_ops``), for a reader to see both sides' kernels. Then round-robin rounds (dense, DCA,
LongHeads, dense, ...), min and median of ``repeats``; ratios from the medians and the mins.
TFLOP/s count the causal pairs' forward FLOPs (DCA computes each causal pair once).
"""

from __future__ import annotations

import math
from typing import Iterable, Iterator, Optional

import torch
import torch.nn.functional as F
from tqdm import tqdm

import attn_patterns
from attn_patterns.dca import dca_attention, dca_sizes
from attn_patterns.longheads import LongHeads
from attn_patterns.rotary import default_inv_freq, rotate
from sparse_ft.bench import dense_kernel
from sparse_ft.bench.machine import bench_dtype, cell, interleaved, ratio

PEAK_MEMORY = {"cuda": "growth of torch.cuda.max_memory_allocated over one call above its inputs",
               "cpu": "growth of the process's resident-set high-water mark (VmHWM) over one call above its inputs"}


def _causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])


def run(lengths: Iterable[int], heads: int = 8, kv_heads: int = 2, head_dim: int = 64, *,
        pretraining_length: int = 4096, longheads: bool = False, longheads_backend: Optional[str] = None,
        dtype: str = "fp32", device: str = "cpu", warmup: int = 1, repeats: int = 5,
        sdpa_backend: Optional[str] = None) -> Iterator[dict]:
    """One row per length; ``memory_exponent`` is the log-log slope of DCA's peak memory
    against N since the previous length (1 = linear, 2 = quadratic). ``sdpa_backend`` (a key of
    ``dense_kernel.BACKENDS``) pins that backend instead of the one SDPA picks."""
    dev = torch.device(device)
    s, w, c = dca_sizes(pretraining_length)
    inv_freq = default_inv_freq(head_dim).to(dev)
    previous: Optional[tuple[int, float]] = None
    for n in tqdm(list(lengths), desc="dca prefill", unit="length"):
        g = torch.Generator(device=dev).manual_seed(n)

        def make(h: int) -> torch.Tensor:
            return torch.randn(1, h, n, head_dim, generator=g, device=dev, dtype=bench_dtype(dtype))

        q, k, v = make(heads), make(kv_heads), make(kv_heads)
        pos = torch.arange(n, device=dev)
        q, k = rotate(q, pos, inv_freq), rotate(k, pos, inv_freq)  # as transformers hands them over
        # F821 off on these lines: ruff checks the lambdas after the ``del q, k, v`` below, which no call follows
        runs = {"dense": lambda: _causal(q, k, v),  # noqa: F821
                "dca": lambda: dca_attention(q, k, v, inv_freq=inv_freq, chunk_size=s, local_window=w, pretraining_length=c)}  # noqa: F821
        if longheads:
            runs["longheads"] = lambda: LongHeads(chunk_size=min(256, c // 16), pretraining_length=c).attend(
                q, k, v, inv_freq=inv_freq, backend=longheads_backend)  # noqa: F821
        with torch.inference_mode():
            kernel = dense_kernel.find(runs["dense"], dev, sdpa_backend)
            pin = kernel.pin if kernel else (lambda fn: fn)
            # LongHeads runs unpinned: its chunk representations are an fp32 call by design (eq. 1-2),
            # which a pinned half-precision kernel (cuDNN's, an H200 found) refuses
            runs = {name: fn if name == "longheads" else pin(fn) for name, fn in runs.items()}
            dca_ops = dense_kernel.describe_ops(dense_kernel.attention_ops(runs["dca"], dev))
            got = interleaved(runs, dev, warmup, repeats)
        del q, k, v, runs  # the runs hold them too
        dense, dca = got["dense"], got["dca"]
        exponent = None
        if previous and dca.peak_mib and previous[1] > 0:
            exponent = math.log(dca.peak_mib / previous[1]) / math.log(n / previous[0])
        previous = (n, dca.peak_mib) if dca.peak_mib else None
        pairs = attn_patterns.get("causal").visible_pairs(n, heads)
        row = {"seq_len": n, "dense_kernel": kernel, "dca_ops": dca_ops,
               "dca_ms_min": dca.min_ms, "dca_ms_median": dca.median_ms,
               "dense_ms_min": dense.min_ms, "dense_ms_median": dense.median_ms,
               "time_ratio": ratio(dca.median_ms, dense.median_ms), "time_ratio_min": ratio(dca.min_ms, dense.min_ms),
               "dca_tflops": dense_kernel.tflops(pairs, head_dim, dca.median_ms, backward=False),
               "dense_tflops": dense_kernel.tflops(pairs, head_dim, dense.median_ms, backward=False),
               "dca_peak_mib": dca.peak_mib, "dense_peak_mib": dense.peak_mib, "memory_exponent": exponent,
               "chunk_size": s, "local_window": w,
               "errors": {name: t.error for name, t in got.items() if t.error}}
        if longheads:
            mine = got["longheads"]
            row.update({"longheads_ms_min": mine.min_ms, "longheads_ms_median": mine.median_ms,
                        "longheads_peak_mib": mine.peak_mib,
                        "longheads_vs_dca_throughput": ratio(dca.median_ms, mine.median_ms)})
        yield row


def markdown(rows: list[dict]) -> str:
    longheads = bool(rows) and "longheads_ms_median" in rows[0]
    extra = " LongHeads ms median | LongHeads peak MiB | LongHeads / DCA throughput |" if longheads else ""
    table = ["| N | DCA ms min | DCA ms median | causal SDPA ms min | causal SDPA ms median | DCA / SDPA | "
             "DCA / SDPA (mins) | DCA TFLOP/s | SDPA kernel | SDPA TFLOP/s | DCA peak MiB | SDPA peak MiB | "
             "DCA memory exponent |" + extra,
             "|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|" + "---:|" * (3 if longheads else 0)]
    for r in rows:
        line = (f"| {r['seq_len']} | {cell(r['dca_ms_min'], '.2f')} | {cell(r['dca_ms_median'], '.2f')} | "
                f"{cell(r['dense_ms_min'], '.2f')} | {cell(r['dense_ms_median'], '.2f')} | "
                f"{cell(r['time_ratio'], '.3f', '–')} | {cell(r['time_ratio_min'], '.3f', '–')} | "
                f"{cell(r['dca_tflops'], '.3g', '–')} | {r['dense_kernel'].label if r['dense_kernel'] else 'not pinned'} | "
                f"{cell(r['dense_tflops'], '.3g', '–')} | {cell(r['dca_peak_mib'], '.1f')} | "
                f"{cell(r['dense_peak_mib'], '.1f')} | {cell(r['memory_exponent'], '.2f', '–')} |")
        if longheads:
            missing = "OOM" if r["errors"].get("longheads", "OOM") == "OOM" else "failed"  # the reason is in the notes
            line += (f" {cell(r['longheads_ms_median'], '.1f', missing)} | {cell(r['longheads_peak_mib'], '.1f', missing)} | "
                     f"{cell(r['longheads_vs_dca_throughput'], '.2f', '–')} |")
        table.append(line)
    notes = {f"- SDPA kernel {r['dense_kernel'].label}: {r['dense_kernel'].backend}, {r['dense_kernel'].detail}": None
             for r in rows if r["dense_kernel"]}
    # an empty list on CUDA is DCA's prefill in one pass of its Triton kernel, which is no aten op
    notes.update({f"- DCA ran: {', '.join(r['dca_ops']) or 'no aten attention op (its Triton kernel, attn_patterns.dca_triton)'}": None
                  for r in rows})
    notes.update({f"- {name} at N={r['seq_len']}: {error}": None for r in rows for name, error in r["errors"].items()})
    return "\n".join(table + ([""] + list(notes) if notes else []))
