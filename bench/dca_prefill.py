"""Dual Chunk Attention prefill against dense causal SDPA, measured in the same run.

The paper's claim is cost "comparable to Flash Attention": DCA computes every causal pair
exactly once (intra-chunk causal, successive and inter-chunk non-causal pieces), plus O(N·D)
rotations and log-sum-exp merges. Target: at most 1.5× the time of causal attention at the
same length, memory growing linearly with N.

    .venv/bin/python bench/dca_prefill.py                       # 4k..32k, H=8/2, D=64
    .venv/bin/python bench/dca_prefill.py --lengths 4096,8192 --output bench/results/dca.json

Times are the fastest of alternating runs (robust on a shared machine); peak memory is the growth over the inputs during one call (CUDA: the
allocator's peak; CPU: resident high-water mark, see sparse_ft.bench.machine).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from attn_patterns.dca import dca_attention, resolve  # noqa: E402
from attn_patterns.rotary import default_inv_freq, rotate  # noqa: E402
from sparse_ft.bench.machine import PeakMemory, describe  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _ints(text: str) -> list[int]:
    values = [int(x) for x in text.split(",") if x]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be a comma-separated list of positive integers")
    return values


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=_ints, default=[4096, 8192, 16384, 32768])
    p.add_argument("--pretraining-length", type=int, default=4096, help="c (Llama-2: 4096); s = 3c/4, w = c - s")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--output", type=Path, default=None, help="write JSON here and a markdown table beside it")
    return p.parse_args(argv)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def interleaved(dense, dca, device: torch.device, warmup: int, repeats: int) -> tuple[float, float, float, float]:
    """Fastest of ``repeats`` alternating runs of each (a shared machine slows runs, never
    speeds them up, so the minimum is the least disturbed one and alternation exposes both
    to the same load), then the peak memory of one more run of each."""
    times: dict = {dense: [], dca: []}
    for _ in range(warmup):
        dense(), dca()
    for _ in range(repeats):
        for fn in (dense, dca):
            _sync(device)
            began = time.perf_counter()
            fn()
            _sync(device)
            times[fn].append((time.perf_counter() - began) * 1e3)
    peaks = []
    for fn in (dense, dca):
        peak = PeakMemory(device)
        with peak.measure():
            fn()
        peaks.append(peak.mib)
    return min(times[dense]), peaks[0], min(times[dca]), peaks[1]


def run(args: argparse.Namespace) -> dict:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = DTYPES[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    s, w, c = resolve(args.pretraining_length)
    inv_freq = default_inv_freq(args.head_dim).to(device)
    rows = []
    for n in tqdm(args.lengths, desc="dca prefill", unit="length"):
        g = torch.Generator(device=device).manual_seed(n)
        make = lambda h: torch.randn(1, h, n, args.head_dim, generator=g, device=device, dtype=dtype)  # noqa: E731
        q, k, v = make(args.heads), make(args.kv_heads), make(args.kv_heads)
        pos = torch.arange(n, device=device)
        q, k = rotate(q, pos, inv_freq), rotate(k, pos, inv_freq)  # as transformers hands them over
        with torch.inference_mode():
            dense_ms, dense_mib, dca_ms, dca_mib = interleaved(
                lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
                lambda: dca_attention(q, k, v, inv_freq, s, w, c),
                device, args.warmup, args.repeats,
            )
        rows.append({"seq_len": n, "dca_ms": round(dca_ms, 1), "dense_ms": round(dense_ms, 1),
                     "time_ratio": round(dca_ms / dense_ms, 3), "dca_peak_mib": round(dca_mib, 1),
                     "dense_peak_mib": round(dense_mib, 1)})
    return {"device": describe(device), "dtype": str(dtype).removeprefix("torch."), "heads": args.heads,
            "kv_heads": args.kv_heads, "head_dim": args.head_dim, "chunk_size": s, "local_window": w,
            "pretraining_length": c, "rows": rows}


def markdown(result: dict) -> str:
    head = (f"DCA prefill vs causal SDPA — {result['device']}, {result['dtype']}, H={result['heads']}/"
            f"{result['kv_heads']}, D={result['head_dim']}, c={result['pretraining_length']}, "
            f"s={result['chunk_size']}, w={result['local_window']}\n\n")
    table = ["| N | DCA ms | causal SDPA ms | DCA / SDPA | DCA peak MiB | SDPA peak MiB |", "|---|---|---|---|---|---|"]
    table += [f"| {r['seq_len']} | {r['dca_ms']} | {r['dense_ms']} | {r['time_ratio']} | {r['dca_peak_mib']} | "
              f"{r['dense_peak_mib']} |" for r in result["rows"]]
    return head + "\n".join(table) + "\n"


def main(argv=None) -> int:
    args = parse(argv)
    result = run(args)
    text = markdown(result)
    print(text)
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(result, indent=2) + "\n")
        args.output.with_suffix(".md").write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
