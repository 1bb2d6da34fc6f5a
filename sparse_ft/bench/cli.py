"""``sparse-ft bench attention``: patterns against dense causal SDPA in the same run."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

HELP = "benchmarks against the dense baseline"
DTYPES = ["fp32", "bf16", "fp16"]
QUICK = dict(lengths="2048,4096", heads="8", head_dims="64", repeats=2)


def _ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} must be a comma-separated list of integers") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must list positive integers")
    return values


def _common(p: argparse.ArgumentParser, lengths: str, patterns: str) -> None:
    """The flags both benchmarks take."""
    p.add_argument("--lengths", default=lengths, help="sequence lengths (comma list)")
    p.add_argument("--patterns", default=patterns, help="patterns to measure beside the dense baseline (comma list)")
    p.add_argument("--dtype", choices=DTYPES, default=None, help="default: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured runs first")
    p.add_argument("--repeats", type=int, default=3, help="measured runs; the median is reported")
    p.add_argument("--output", type=Path, default=None, help="write results as JSON (default: the table only)")


def configure(bench: argparse.ArgumentParser) -> None:
    which = bench.add_subparsers(dest="bench", required=True, metavar="KIND")
    p = which.add_parser("attention", help="forward+backward time and peak memory of each pattern vs dense causal SDPA")
    _common(p, "2048,4096,8192,16384", "s2,scca_fixed,scca_flow,sda,longmixed")
    p.add_argument("--heads", default="8", help="query heads (comma list)")
    p.add_argument("--kv-heads", type=int, default=None, help="key/value heads (default: as many as query heads)")
    p.add_argument("--head-dims", default="64", help="head dimensions (comma list)")
    p.add_argument("--quick", action="store_true", help="N in {2k, 4k}, H=8, D=64, 2 repeats (overrides those flags): a quick CPU check")
    p.set_defaults(func=main)
    t = which.add_parser("train", help="tokens/s and peak memory of a training step per pattern vs full attention")
    _common(t, "2048,4096,8192", "s2,scca_fixed,scca_flow,longmixed")
    t.set_defaults(func=main_train)


def main(args: argparse.Namespace) -> int:
    import torch

    from sparse_ft.bench import attention
    from sparse_ft.bench.machine import describe

    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = args.dtype or ("bf16" if device.type == "cuda" else "fp32")
    try:
        lengths, heads, dims = (_ints(x) for x in (args.lengths, args.heads, args.head_dims))
    except argparse.ArgumentTypeError as err:
        raise ValueError(f"bench attention: {err}") from None
    patterns = [p for p in args.patterns.split(",") if p]
    import attn_patterns

    for h in heads:  # bad names and head counts fail before any measurement
        if args.kv_heads is not None and (args.kv_heads < 1 or h % args.kv_heads):
            raise ValueError(f"bench attention: --kv-heads={args.kv_heads} must divide every --heads value (got {h})")
        for name in patterns:
            attn_patterns.get(name).check_heads(h)
    if args.warmup < 0 or args.repeats < 1:
        raise ValueError(f"bench attention: --warmup={args.warmup} must be >= 0 and --repeats={args.repeats} >= 1")
    machine = describe(device)
    rows = attention.run(lengths, heads, dims, patterns, dtype, str(device), args.kv_heads, args.warmup, args.repeats)
    memory = attention.PEAK_MEMORY.get(device.type, "not measured")
    title = (f"forward+backward, batch 1, {dtype}, median of {args.repeats} after {args.warmup} warm-up, "
             f"on {machine}; peak memory: {memory}")
    return _report(args, title, attention.markdown(rows),
                   {"machine": machine, "device": str(device), "dtype": dtype, "warmup": args.warmup,
                    "repeats": args.repeats, "peak_memory": memory, "results": attention.as_dicts(rows)})


def main_train(args: argparse.Namespace) -> int:
    import torch

    from sparse_ft import methods
    from sparse_ft.bench import train_step
    from sparse_ft.bench.machine import describe

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = args.dtype or ("bf16" if device.type == "cuda" else "fp32")
    try:
        lengths = _ints(args.lengths)
    except argparse.ArgumentTypeError as err:
        raise ValueError(f"bench train: {err}") from None
    patterns = [p for p in args.patterns.split(",") if p]
    for name in patterns:  # the names a recipe trains through
        methods.for_training(name, {}, None, "float32")
    machine = describe(device)
    rows = train_step.run(lengths, patterns, str(device), dtype, args.warmup, args.repeats)
    title = f"training step (4-layer 256-dim Llama, 8 heads, batch 1, {dtype}) on {machine}"
    return _report(args, title, train_step.markdown(rows),
                   {"machine": machine, "device": str(device), "dtype": dtype, "model": train_step.MODEL,
                    "results": train_step.as_dicts(rows)})


def _report(args: argparse.Namespace, title: str, table: str, payload: dict) -> int:
    print(f"\n{title}\n\n{table}")
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(payload, indent=2))
        print(f"\nwrote {args.output}")
    return 0
