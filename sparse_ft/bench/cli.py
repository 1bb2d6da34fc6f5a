"""``sparse-ft bench attention|train|dca|eval``: each against its baseline in the same run.

``--output X.json`` writes the JSON and ``X.md`` (title, command, table) after every row, so a
sweep stopped by a time limit keeps what it measured (``"complete": false`` until the end).
Both carry a marker naming the command; existing files are replaced only when they carry one
and ``--overwrite`` is given, checked before anything is measured."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import attn_patterns  # names only until first used (PEP 562): no torch for --help
from sparse_ft.files.outputs import OUTPUT_FIELD, atomic_file, markdown_marker
from sparse_ft.modeling.dtypes import SHORT_NAMES

HELP = "benchmarks against the dense baseline"
# attn_patterns.kernels.BACKENDS for the help texts (a test checks they agree); a backend itself is
# checked by the patterns' own resolve_backend.
BACKENDS = "sdpa, flash, flex, triton"
QUICK = dict(lengths="2048,4096", heads="8", head_dims="64", repeats=2)
# dense_kernel.BACKENDS, named here so that building the parser loads no torch (a test checks they agree)
SDPA_BACKENDS = ["flash", "cudnn", "efficient", "math", "overrideable"]
# The repeats a min and a median need to be read: the default, and fewer is marked in the output.
REPEATS = {"attention": 5, "dca": 5, "train": 3, "eval": 3}


def _ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} must be a comma-separated list of integers") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must list positive integers")
    return values


def _common(p: argparse.ArgumentParser, lengths: str, repeats: int) -> None:
    """The flags every benchmark takes."""
    p.add_argument("--lengths", default=lengths, help="sequence lengths (comma list)")
    p.add_argument("--dtype", choices=list(SHORT_NAMES), default=None, help="default: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured rounds first")
    p.add_argument("--repeats", type=int, default=repeats,
                   help=f"measured rounds, min and median reported (default {repeats}; fewer is marked in the output)")
    p.add_argument("--output", type=Path, default=None,
                   help="write results as JSON here and a markdown table beside it (default: the table only)")
    p.add_argument("--overwrite", action="store_true", help="replace --output (and its .md) when they hold an earlier sparse-ft output")


def _sdpa_backend(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sdpa-backend", choices=["auto", *SDPA_BACKENDS], default="auto",
                   help="the SDPA kernel pinned for the baseline and the patterns alike (default auto: the one the "
                        "profiler sees SDPA pick for a dense causal call)")


def _model(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", choices=["tiny", "1b", "8b"], default="tiny",
                   help="tiny: 4 layers x 256 (CPU); 1b: 16 layers x 2048, 32 heads, 8 KV heads (GPU); "
                        "8b: Llama-3.1-8B's shapes (GPU)")


def _sink_tokens(p: argparse.ArgumentParser, only: str = "") -> None:
    p.add_argument("--sink-tokens", type=int, default=0, metavar="K",
                   help="as attention.params.sink_tokens: each query also sees the first K keys. Each pattern is also "
                        f"measured with K sink tokens (sf_attn's own 4 replaced by K), its row 'PATTERN + K sinks' beside "
                        f"the plain one{only} (default 0: no sink rows)")


def configure(bench: argparse.ArgumentParser) -> None:
    which = bench.add_subparsers(dest="bench", required=True, metavar="KIND")
    p = which.add_parser("attention", help="forward+backward time and peak memory of each pattern vs dense causal SDPA")
    _common(p, "2048,4096,8192,16384", REPEATS["attention"])
    p.add_argument("--patterns", default=None, help="patterns (comma list; default: every registered pattern that "
                   "builds from its name alone, except causal, the baseline's own visible set)")
    p.add_argument("--backends", default="sdpa", help=f"pattern backends, one row each (comma list of {BACKENDS})")
    p.add_argument("--heads", default="8", help="query heads (comma list)")
    p.add_argument("--kv-heads", type=int, default=None, help="key/value heads (default: as many as query heads)")
    p.add_argument("--head-dims", default="64", help="head dimensions (comma list)")
    _sink_tokens(p)
    _sdpa_backend(p)
    p.add_argument("--quick", action="store_true",
                   help="N in {2k, 4k}, H=8, D=64, 2 repeats (overrides those flags): a quick CPU check, marked as too few repeats")
    p.set_defaults(func=main)
    t = which.add_parser("train", help="tokens/s and peak memory of a LoRA+ training step per pattern vs full attention")
    _common(t, "2048,4096,8192", REPEATS["train"])
    t.add_argument("--patterns", default=None,
                   help="patterns beside full attention (comma list; default: SCCA's Table 2, the patterns "
                        "tagged scca_table2)")
    _model(t)
    t.add_argument("--gradient-checkpointing", action=argparse.BooleanOptionalAction, default=None,
                   help="default: on for the GPU models, 1b and 8b (as the recipes train), off for tiny")
    t.add_argument("--backend", default=None, help=f"the patterns' backend, as attention.backend: {BACKENDS} (default: sdpa)")
    t.add_argument("--dense-layers", default=None,
                   help="as attention.dense_layers: layers that attend fully (comma list of indices, or 'last n'); "
                        "each pattern is also measured with them (default: none)")
    t.add_argument("--dense-final-fraction", type=float, default=0.0,
                   help="as train.dense_final_fraction: the all-dense step is measured too, and each pattern's run "
                        "as the mean of its step and the dense step weighted by this fraction")
    _sink_tokens(t, " (of the plain pattern only: no sink row with --dense-layers or a dense tail)")
    t.set_defaults(func=main_train)
    d = which.add_parser("dca", help="DCA prefill time and peak memory vs causal SDPA (pinned to the kernel SDPA picks)")
    _common(d, "4096,8192,16384,32768", REPEATS["dca"])
    d.add_argument("--heads", type=int, default=8, help="query heads")
    d.add_argument("--kv-heads", type=int, default=2, help="key/value heads")
    d.add_argument("--head-dim", type=int, default=64, help="head dimension")
    d.add_argument("--pretraining-length", type=int, default=4096, help="c (Llama-2: 4096); s = 3c/4, w = c - s")
    d.add_argument("--longheads", action="store_true", help="also LongHeads on the same q, k, v (its throughput vs DCA's)")
    d.add_argument("--longheads-backend", default=None,
                   help="LongHeads' kernel, one of attn_patterns.kernels.LSE_BACKENDS (implies --longheads; default: "
                        "automatic, the torch path; triton: its one-kernel path, CUDA only)")
    _sdpa_backend(d)
    d.set_defaults(func=main_dca)
    e = which.add_parser("eval", help="sliding-window PPL tokens/s of a 4-bit NF4 model vs the same model unquantised")
    _common(e, "8192", REPEATS["eval"])
    _model(e)
    e.set_defaults(func=main_eval)


def _setup(args: argparse.Namespace, name: str) -> tuple[Any, str, list[int]]:
    """Device, dtype and lengths, with the checks every benchmark shares (the output file
    among them: a sweep must not end in a traceback after its measurements)."""
    import torch

    from sparse_ft.modeling.devices import check_device, default_device

    try:
        if args.device == "auto":
            raise ValueError("--device auto: a benchmark runs on one device; name it (cpu, cuda, cuda:0)")
        device = torch.device(check_device(args.device or default_device()))
    except ValueError as err:
        raise ValueError(f"bench {name}: {err}") from None
    dtype = args.dtype or ("bf16" if device.type == "cuda" else "fp32")
    try:
        lengths = _ints(args.lengths)
    except argparse.ArgumentTypeError as err:
        raise ValueError(f"bench {name}: {err}") from None
    if args.warmup < 0 or args.repeats < 1:
        raise ValueError(f"bench {name}: --warmup={args.warmup} must be >= 0 and --repeats={args.repeats} >= 1")
    if args.output is not None:
        _check_output(args.output, args.overwrite, f"bench {name}: --output")
    return device, dtype, lengths


def _machine(device: Any, args: argparse.Namespace) -> dict:
    """What every benchmark's JSON records of where and how it measured."""
    from sparse_ft.bench.machine import describe, versions

    return {"machine": describe(device), "device": str(device), "versions": versions(device),
            "warmup": args.warmup, "repeats": args.repeats, "too_few_repeats": args.repeats < REPEATS[args.bench]}


def _pinned(args: argparse.Namespace) -> str | None:
    return None if args.sdpa_backend == "auto" else args.sdpa_backend


def _kernel_note(args: argparse.Namespace) -> str:
    if args.sdpa_backend == "auto":
        return "the one the profiler saw SDPA pick for an unpinned dense causal call"
    return f"{args.sdpa_backend}, as --sdpa-backend asked (its kernels named by the profiler)"


def _rounds(args: argparse.Namespace) -> str:
    """How the runs were measured, for a title, marking fewer repeats than a reader should trust."""
    few = (f" (fewer than {REPEATS[args.bench]}: too few for a min and a median to be read)"
           if args.repeats < REPEATS[args.bench] else "")
    return (f"interleaved round-robin, min and median of {args.repeats} measured rounds{few} "
            f"after {args.warmup} warm-up")


def _check_output(output: Path, overwrite: bool, flag: str) -> None:
    """The JSON and the markdown beside it: new, or sparse-ft's own with ``--overwrite``."""
    from sparse_ft.files.outputs import check_output_file

    check_output_file(output, flag, overwrite)
    if output.suffix != ".json":
        raise ValueError(f"{flag} {output} must end in .json (the markdown table is written beside it, as .md)")
    check_output_file(output.with_suffix(".md"), flag, overwrite)


def _names(text: str, flag: str) -> list[str]:
    names = [p for p in text.split(",") if p]
    if not names:
        raise ValueError(f"{flag}={text!r} names no pattern")
    return names


def _backends(text: str, device: Any, dtype: str, flag: str, *, head_dim: int = 8) -> list[str]:
    """The backends of ``flag`` that can run a forward+backward here; the others fail now, before
    anything is measured, rather than at their first row. Which names exist and what each
    needs is the patterns' own check (``attn_patterns.kernels.resolve_backend``), asked with a
    tensor of this device, dtype and head dimension."""
    import torch

    from attn_patterns.kernels import resolve_backend
    from sparse_ft.bench.machine import bench_dtype

    backends = [b for b in text.split(",") if b]
    if not backends:
        raise ValueError(f"{flag}={text!r} names no backend")
    if "flex" in backends and device.type != "cuda":
        raise ValueError(f"{flag} flex needs CUDA (torch has no FlexAttention backward on CPU)")
    probe = torch.empty(1, 1, 1, head_dim, device=device, dtype=bench_dtype(dtype))
    for backend in backends:
        try:
            resolve_backend(backend, probe)
        except ValueError as err:
            raise ValueError(f"{flag} {backend}: {err}") from None
    return backends


def main(args: argparse.Namespace) -> int:
    from sparse_ft.bench import attention, dense_kernel

    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    device, dtype, lengths = _setup(args, "attention")
    try:
        heads, dims = _ints(args.heads), _ints(args.head_dims)
    except argparse.ArgumentTypeError as err:
        raise ValueError(f"bench attention: {err}") from None
    patterns = (attention.default_patterns() if args.patterns is None
                else _names(args.patterns, "bench attention: --patterns"))
    backends = _backends(args.backends, device, dtype, "bench attention: --backends", head_dim=max(dims))
    for h in heads:  # bad names and head counts fail before any measurement
        if args.kv_heads is not None and (args.kv_heads < 1 or h % args.kv_heads):
            raise ValueError(f"bench attention: --kv-heads={args.kv_heads} must divide every --heads value (got {h})")
        for name in patterns:
            attn_patterns.get(name).check_heads(h)
    _check_sinks(args.sink_tokens, patterns, lengths, "bench attention: --sink-tokens")
    machine = _machine(device, args)
    memory = attention.PEAK_MEMORY.get(device.type, "not measured")
    flops = (f"{dense_kernel.FORWARD_FLOPS_PER_PAIR}·pairs·D forward, {1 + dense_kernel.BACKWARD_FACTOR:g}× that "
             f"forward+backward")
    title = (f"forward+backward, batch 1, {dtype}, dense causal SDPA and the patterns {_rounds(args)}, on "
             f"{machine['machine']}. Dense kernel: {_kernel_note(args)}, pinned (sdpa_kernel) for the baseline and every "
             f"pattern's SDPA calls alike. Speedup: of the medians (and of the "
             f"mins); of ideal: speedup ÷ (causal pairs ÷ pattern pairs) = TFLOP/s ÷ dense TFLOP/s, each over its "
             f"own pairs at its median ({flops}). Peak memory: {memory}{_sink_rows(args.sink_tokens)}")
    rows = attention.run(lengths, heads, dims, patterns, dtype=dtype, device=str(device), kv_heads=args.kv_heads,
                         warmup=args.warmup, repeats=args.repeats, backends=backends, sdpa_backend=_pinned(args),
                         sink_tokens=args.sink_tokens)
    return _sweep(args, title, rows, attention.markdown,
                  payload={**machine, "dtype": dtype, "sdpa_backend": args.sdpa_backend, "peak_memory": memory,
                           "flops": flops, "sink_tokens": args.sink_tokens})


def main_train(args: argparse.Namespace) -> int:
    from sparse_ft.bench import models, train_step

    device, dtype, lengths = _setup(args, "train")
    patterns = (attn_patterns.PATTERNS.names(tag="scca_table2") if args.patterns is None
                else _names(args.patterns, "bench train: --patterns"))
    if args.backend is not None:
        if "," in args.backend:
            raise ValueError(f"bench train: --backend={args.backend!r} names one backend (the patterns' attention.backend)")
        _backends(args.backend, device, dtype, "bench train: --backend")
    dense_layers = _dense_layers(args.dense_layers, models.config(args.model, 1).num_hidden_layers)
    if not 0 <= args.dense_final_fraction <= 1:
        raise ValueError(f"bench train: --dense-final-fraction {args.dense_final_fraction} must be in [0, 1] "
                         "(the fraction of a run's steps, the last ones, with full attention in every layer)")
    train_step.trained_methods(patterns, args.backend, dtype)  # the names and backend a recipe takes
    _check_sinks(args.sink_tokens, [p for p in patterns if p != "full"], lengths, "bench train: --sink-tokens")
    checkpointing = args.model != "tiny" if args.gradient_checkpointing is None else args.gradient_checkpointing
    machine = _machine(device, args)
    memory = train_step.PEAK_MEMORY
    title = (f"training step (forward+backward, LoRA+ as the recipes train, gradient checkpointing "
             f"{'on' if checkpointing else 'off'}, batch 1, {dtype}, patterns on {args.backend or 'sdpa'}, full attention "
             f"the model's own; {models.describe(args.model)}), full attention, attention replaced by a no-op and the "
             f"patterns {_rounds(args)}, on {machine['machine']}. Speedup: of the medians (and of the mins). Attention "
             f"share a = 1 − no-op step ÷ full step (medians); Amdahl bound = 1 / ((1 − a) + a / ideal), ideal = causal "
             f"pairs ÷ pattern pairs; of bound = speedup ÷ bound. Step peak: {memory['step']}. Attention peak: "
             f"{memory['attention']}{_dense_rows(dense_layers, args.dense_final_fraction)}{_sink_rows(args.sink_tokens)}")
    rows = train_step.run(lengths, patterns, str(device), dtype, warmup=args.warmup, repeats=args.repeats,
                          model=args.model, gradient_checkpointing=checkpointing,
                          backend=args.backend, dense_layers=dense_layers, dense_final_fraction=args.dense_final_fraction,
                          sink_tokens=args.sink_tokens)
    return _sweep(args, title, rows, train_step.markdown,
                  payload={**machine, "dtype": dtype, "model": args.model,
                   "model_config": models.MODELS[args.model], "gradient_checkpointing": checkpointing,
                   "backend": args.backend, "peak_memory": memory, "dense_layers": dense_layers,
                   "dense_final_fraction": args.dense_final_fraction, "sink_tokens": args.sink_tokens})


def _dense_rows(dense_layers: Any, fraction: float) -> str:
    """What the rows of ``--dense-layers`` and ``--dense-final-fraction`` are, for the title."""
    from sparse_ft.bench.train_step import DENSE

    said = [] if not dense_layers else ["Rows '+ full in ...': those layers attend fully (the pattern causal), as "
                                         "attention.dense_layers trains, ideal over the mean pairs of the layers"]
    if fraction:
        said.append(f"Rows 'dense tail {fraction:g}': a run whose last {fraction:g} of steps attend fully in every layer, "
                    f"(1 − {fraction:g}) × its step + {fraction:g} × the all-dense step (the {DENSE} row), both measured; "
                    "peak memory the larger")
    return "".join(f". {sentence}" for sentence in said)


def _check_sinks(k: int, patterns: list[str], lengths: list[int], flag: str) -> None:
    """``--sink-tokens K`` refused before anything is measured, as a run refuses
    ``attention.params.sink_tokens``: K >= 0, and each pattern built with K sink tokens takes
    every benchmarked length (its own ``check_length``: K below its chunk width there)."""
    if k < 0:
        raise ValueError(f"{flag} {k} must be in [0, each pattern's chunk width at every --lengths value) (0: no sink rows)")
    for name in patterns if k else ():
        try:
            pattern = attn_patterns.get(name, sink_tokens=k)
            for n in lengths:
                pattern.check_length(n)
        except ValueError as err:
            raise ValueError(f"{flag} {k}: {err}") from None


def _sink_rows(k: int) -> str:
    """What the rows of ``--sink-tokens`` are, for the title."""
    from sparse_ft.bench.attention import sinks_name

    if not k:
        return ""
    return (f". Rows '{sinks_name('PATTERN', k)}': the pattern with attention.params.sink_tokens={k} (each query also "
            f"sees the first {k} keys; sf_attn's own 4 replaced), ideal over its own pairs, the sinks' included")


def _dense_layers(text: Any, layers: int) -> Any:
    """``--dense-layers`` as ``attention.dense_layers`` takes it (``last n``, or indices), checked
    by its rule against the model's ``layers``; ``[]`` when not given."""
    from sparse_ft.methods import dense_layers_option

    return [] if text is None else dense_layers_option(text, "bench train: --dense-layers", layers)


def main_dca(args: argparse.Namespace) -> int:
    from attn_patterns.dca import dca_sizes
    from sparse_ft.bench import dca

    device, dtype, lengths = _setup(args, "dca")
    if min(args.heads, args.kv_heads, args.head_dim) < 1 or args.heads % args.kv_heads or args.head_dim % 2:
        raise ValueError(f"bench dca: --heads={args.heads} must be a multiple of --kv-heads={args.kv_heads} and "
                         f"--head-dim={args.head_dim} a positive even number")
    from attn_patterns.kernels import LSE_BACKENDS

    if args.longheads_backend not in (None, *LSE_BACKENDS):
        raise ValueError(f"bench dca: --longheads-backend={args.longheads_backend!r} is unknown; allowed: "
                         f"{', '.join(LSE_BACKENDS)}")
    s, w, c = dca_sizes(args.pretraining_length)
    machine = _machine(device, args)
    memory = dca.PEAK_MEMORY.get(device.type, "not measured")
    title = (f"DCA prefill vs causal SDPA, {dtype}, H={args.heads}/{args.kv_heads}, D={args.head_dim}, c={c}, s={s}, "
             f"w={w}, {_rounds(args)}, on {machine['machine']}. SDPA kernel: {_kernel_note(args)}, pinned for the "
             f"baseline and DCA (DCA's fused ops, named below, are called directly; LongHeads runs unpinned: its "
             f"chunk representations are an fp32 call; LongHeads' backend: {args.longheads_backend or 'automatic'}). "
             "Ratios of the medians (and of the mins); TFLOP/s: 4·pairs·D over the causal pairs at the median. "
             f"Peak memory: {memory}")
    longheads = args.longheads or args.longheads_backend is not None
    rows = dca.run(lengths, args.heads, args.kv_heads, args.head_dim, pretraining_length=c, longheads=longheads,
                   longheads_backend=args.longheads_backend, dtype=dtype, device=str(device), warmup=args.warmup,
                   repeats=args.repeats, sdpa_backend=_pinned(args))
    return _sweep(args, title, rows, dca.markdown,
                  payload={**machine, "dtype": dtype, "heads": args.heads,
                   "kv_heads": args.kv_heads, "head_dim": args.head_dim, "pretraining_length": c, "longheads": longheads,
                   "longheads_backend": args.longheads_backend,
                   "sdpa_backend": args.sdpa_backend, "peak_memory": memory})


def main_eval(args: argparse.Namespace) -> int:
    from sparse_ft.bench import eval_throughput, models
    from sparse_ft.evaluation import windows

    device, dtype, lengths = _setup(args, "eval")
    try:
        windows.check(lengths, stride=1)
    except ValueError as err:
        raise ValueError(f"bench eval: {err}") from None
    machine = _machine(device, args)
    title = (f"sliding-window PPL throughput, one window per run, NF4 (double quantisation, {dtype} compute) vs "
             f"{dtype}, {models.describe(args.model)}, random weights, fastest of {args.repeats} alternating runs "
             f"after {args.warmup} warm-up, on {machine['machine']}")
    rows = eval_throughput.run(lengths, args.model, dtype, str(device), warmup=args.warmup, repeats=args.repeats)
    return _sweep(args, title, rows, lambda r: eval_throughput.markdown(r, dtype),
                  payload={**machine, "dtype": dtype, "model": args.model, "model_config": models.MODELS[args.model]})


def _sweep(args: argparse.Namespace, title: str, rows: Iterable[Any], table: Callable[[list], str], *,
           payload: dict) -> int:
    command = getattr(args, "command_line", None)
    writer = f"sparse-ft bench {args.bench}"
    done: list = []
    for row in rows:
        done.append(row)
        _write(args.output, title, command, table(done), payload={OUTPUT_FIELD: writer, **payload, "complete": False}, rows=done)
    _write(args.output, title, command, table(done), payload={OUTPUT_FIELD: writer, **payload, "complete": True}, rows=done)
    print(f"\n{title}\n\n{table(done)}")
    if args.output:
        print(f"\nwrote {args.output} and {args.output.with_suffix('.md')}")
    return 0


def _plain(value: Any) -> Any:
    """JSON for a row or a field that is a dataclass (a row, the dense kernel it was measured against)."""
    if is_dataclass(value) and not isinstance(value, type):
        return asdict(value)
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def _write(output: Path | None, title: str, command: str | None, table: str, *, payload: dict, rows: list) -> None:
    if output is None:
        return
    output.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(output) as f:
        f.write(json.dumps({**payload, "command": command, "results": rows}, indent=2, default=_plain) + "\n")
    made = f"Command: `{command}`\n\n" if command else ""
    with atomic_file(output.with_suffix(".md")) as f:
        f.write(f"{title}\n\n{made}{table}\n\n{markdown_marker(payload[OUTPUT_FIELD])}\n")
