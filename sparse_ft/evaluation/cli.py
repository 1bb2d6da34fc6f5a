"""``sparse-ft eval ppl | passkey | plot``."""

from __future__ import annotations

import argparse
import platform
from pathlib import Path

from sparse_ft.config.keyvalue import parse_assignments


def _ints(text: str, flag: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x]
    except ValueError:
        raise ValueError(f"{flag} {text!r} must be a comma-separated list of integers") from None
    if not values or min(values) < 1:
        raise ValueError(f"{flag} {text!r} must list positive integers")
    return values


def _method_args(items: list[str]) -> dict:
    return dict(parse_assignments(items, "--method-arg"))


def _model_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="HF id, local directory, or 'tiny' (built-in test model)")
    p.add_argument("--adapter", default=None, help="adapter directory written by train.py")
    p.add_argument("--method", default="full", help="full, an attention pattern, pi, ntk, yarn, or a registered method")
    p.add_argument("--method-arg", action="append", default=[], metavar="KEY=VALUE", help="method parameter (repeatable)")
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--load-in-4bit", action="store_true", help="bitsandbytes NF4 with double quantisation")
    p.add_argument("--load-in-8bit", action="store_true")
    p.add_argument("--bnb-compute-dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--device", default=None, help="e.g. cuda:0 or cpu (default: cuda when available)")
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--output", type=Path, default=None, help="results JSON")


def add_parser(sub) -> None:
    ev = sub.add_parser("eval", help="perplexity and passkey retrieval")
    which = ev.add_subparsers(dest="eval", required=True)
    p = which.add_parser("ppl", help="sliding-window perplexity at several lengths")
    _model_flags(p)
    p.add_argument("--data", required=True, help=".bin token file, text/jsonl file, or HF dataset id")
    p.add_argument("--data-dtype", default=None, choices=["uint16", "uint32"],
                   help=".bin token width (default: from the file's JSON sidecar, else uint16)")
    p.add_argument("--split", default="validation")
    p.add_argument("--text-column", default="text")
    p.add_argument("--lengths", default="1024,2048,4096,8192")
    p.add_argument("--stride", type=int, default=256)
    p.add_argument("--scoring", default="standard", choices=["standard", "longlora"])
    p.add_argument("--max-tokens", type=int, default=None, help="use only the first N tokens of --data")
    p.add_argument("--num-windows", type=int, default=None, help="at most N windows per length")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--plot", type=Path, default=None, help="PPL-vs-length PNG")
    p.add_argument("--label", default=None, help="name of this run in tables and plots (default: the method)")
    p.set_defaults(func=run_ppl)
    k = which.add_parser("passkey", help="passkey retrieval over lengths x needle depths")
    _model_flags(k)
    k.add_argument("--lengths", default="1024,2048,4096,8192")
    k.add_argument("--depths", default="0,0.25,0.5,0.75,1", help="needle depths in [0, 1]")
    k.add_argument("--trials", type=int, default=5)
    k.add_argument("--seed", type=int, default=0)
    k.add_argument("--heatmap", type=Path, default=None, help="accuracy heatmap PNG")
    k.add_argument("--label", default=None, help="name of this run in tables and plots (default: the method)")
    k.set_defaults(func=run_passkey)
    g = which.add_parser("plot", help="PPL vs length, one line per results file")
    g.add_argument("results", nargs="+", type=Path)
    g.add_argument("--output", type=Path, required=True)
    g.set_defaults(func=run_plot)


def _method(args):
    from sparse_ft import methods

    return methods.get(args.method, **_method_args(args.method_arg))


def _load(args):
    from sparse_ft.evaluation import loading

    return loading.load(args.model, args.adapter, args.dtype, args.load_in_4bit, args.load_in_8bit,
                        args.bnb_compute_dtype, args.trust_remote_code, args.device)


def _label(args) -> str:
    return args.label or args.method + (f" + {Path(args.adapter).name}" if args.adapter else "")


def _config(args, model) -> dict:
    import torch
    import transformers

    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "func"}
    return config | {"device": str(next(model.parameters()).device), "python": platform.python_version(),
                     "torch": torch.__version__, "transformers": transformers.__version__}


def run_ppl(args) -> int:
    from sparse_ft.evaluation import plots, ppl, report, tokens

    lengths = _ints(args.lengths, "--lengths")
    if args.stride < 1:
        raise ValueError(f"--stride {args.stride} must be >= 1")
    for flag in ("max_tokens", "num_windows", "batch_size"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise ValueError(f"--{flag.replace('_', '-')} {value} must be >= 1")
    method = _method(args)
    if not method.supports.ppl:
        raise ValueError(f"--method {args.method} cannot report perplexity: {method.supports.no_ppl_reason}")
    model, tokenizer = _load(args)
    vocab = model.get_output_embeddings().weight.shape[0]
    stream = tokens.load_tokens(args.data, tokenizer, vocab, args.data_dtype, args.split, args.text_column, args.max_tokens)
    too_long = [n for n in lengths if n > len(stream)]
    if too_long:
        raise ValueError(f"--lengths {','.join(map(str, too_long))} longer than the {len(stream)} tokens of --data (lower it or add data)")
    results = [ppl.evaluate_length(model, stream, n, args.stride, args.scoring, method, args.batch_size, args.num_windows)
               for n in lengths]
    label = _label(args)
    _emit(args, model, label, report.ppl_table(results, label), results)
    if args.plot:
        print(f"wrote {plots.plot_ppl([(label, results)], args.plot)}")
    return 0


def _emit(args, model, label: str, table: str, results: list) -> None:
    """The markdown table on stdout and, with --output, the results JSON with the full configuration."""
    from sparse_ft.evaluation import report

    print(table)
    if args.output:
        report.write_json(args.output, {"label": label, "results": results, "config": _config(args, model)})
        print(f"wrote {args.output}")


def run_passkey(args) -> int:
    from sparse_ft.evaluation import passkey, plots, report

    lengths = _ints(args.lengths, "--lengths")
    try:
        depths = [float(x) for x in args.depths.split(",") if x]
    except ValueError:
        depths = []
    if not depths or not all(0 <= d <= 1 for d in depths):
        raise ValueError(f"--depths {args.depths!r} must be a comma-separated list of numbers in [0, 1]")
    if args.trials < 1:
        raise ValueError(f"--trials {args.trials} must be >= 1")
    method = _method(args)
    model, tokenizer = _load(args)
    cells = passkey.evaluate(model, tokenizer, lengths, depths, args.trials, method, args.seed)
    label = _label(args)
    _emit(args, model, label, report.passkey_table(cells), cells)
    if args.heatmap:
        print(f"wrote {plots.plot_passkey(cells, args.heatmap, f'passkey retrieval: {label}')}")
    return 0


def run_plot(args) -> int:
    from sparse_ft.evaluation import plots, report

    print(f"wrote {plots.plot_ppl([report.read_ppl(path) for path in args.results], args.output)}")
    return 0
