"""``sparse-ft eval ppl | passkey | plot``."""

from __future__ import annotations

import argparse
import platform
from pathlib import Path

import yaml


def _ints(text: str, flag: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x]
    except ValueError:
        raise ValueError(f"{flag} {text!r} must be a comma-separated list of integers") from None
    if not values or min(values) < 1:
        raise ValueError(f"{flag} {text!r} must list positive integers")
    return values


def _method_args(items: list[str]) -> dict:
    params = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--method-arg {item!r} must look like key=value")
        params[key] = yaml.safe_load(raw)
    return params


def _model_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="HF id, local directory, or 'tiny' (built-in test model)")
    p.add_argument("--adapter", default=None, help="adapter directory written by train.py")
    p.add_argument("--method", default="full", help="full, an attention pattern, pi, ntk, yarn, or a registered method")
    p.add_argument("--method-arg", action="append", default=[], metavar="KEY=VALUE", help="method parameter (repeatable)")
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--load-in-4bit", action="store_true", help="bitsandbytes NF4 with double quantisation")
    p.add_argument("--load-in-8bit", action="store_true")
    p.add_argument("--bnb-compute-dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--device", default=None, help="e.g. cuda:0 (default: where transformers puts it)")
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--output", type=Path, default=None, help="results JSON")


def add_parser(sub) -> None:
    ev = sub.add_parser("eval", help="perplexity and passkey retrieval")
    which = ev.add_subparsers(dest="eval", required=True)
    p = which.add_parser("ppl", help="sliding-window perplexity at several lengths")
    _model_flags(p)
    p.add_argument("--data", required=True, help=".bin token file, text/jsonl file, or HF dataset id")
    p.add_argument("--data-dtype", default="uint16", choices=["uint16", "uint32"])
    p.add_argument("--split", default="validation")
    p.add_argument("--text-column", default="text")
    p.add_argument("--lengths", default="1024,2048,4096,8192")
    p.add_argument("--stride", type=int, default=256)
    p.add_argument("--scoring", default="standard", choices=["standard", "longlora"])
    p.add_argument("--max-tokens", type=int, default=None, help="use only the first N tokens of --data")
    p.add_argument("--num-windows", type=int, default=None, help="at most N windows per length")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--plot", type=Path, default=None, help="PPL-vs-length PNG")
    p.set_defaults(func=run_ppl)
    k = which.add_parser("passkey", help="passkey retrieval over lengths x needle depths")
    _model_flags(k)
    k.add_argument("--lengths", default="1024,2048,4096,8192")
    k.add_argument("--depths", default="0,0.25,0.5,0.75,1", help="needle depths in [0, 1]")
    k.add_argument("--trials", type=int, default=5)
    k.add_argument("--seed", type=int, default=0)
    k.add_argument("--heatmap", type=Path, default=None, help="accuracy heatmap PNG")
    k.set_defaults(func=run_passkey)
    g = which.add_parser("plot", help="PPL vs length, one line per results file")
    g.add_argument("results", nargs="+", type=Path)
    g.add_argument("--output", type=Path, required=True)
    g.set_defaults(func=run_plot)


def _prepare(args):
    from sparse_ft.evaluation import loading, methods

    method = methods.get(args.method, **_method_args(args.method_arg))
    model, tokenizer = loading.load(args.model, args.adapter, args.dtype, args.load_in_4bit, args.load_in_8bit,
                                    args.bnb_compute_dtype, args.trust_remote_code, args.device)
    return method, model, tokenizer


def _config(args) -> dict:
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "func"} | {"python": platform.python_version()}


def run_ppl(args) -> int:
    from sparse_ft.evaluation import ppl, report, tokens

    lengths = _ints(args.lengths, "--lengths")
    if args.stride < 1:
        raise ValueError(f"--stride {args.stride} must be >= 1")
    method, model, tokenizer = _prepare(args)
    if not method.supports_ppl:
        raise ValueError(f"--method {args.method} cannot report perplexity: {method.why_no_ppl}")
    vocab = model.get_output_embeddings().weight.shape[0] if hasattr(model, "get_output_embeddings") else model.config.vocab_size
    stream = tokens.load_tokens(args.data, tokenizer, vocab, args.data_dtype, args.split, args.text_column, args.max_tokens)
    results = [ppl.evaluate_length(model, stream, n, args.stride, args.scoring, method, args.batch_size, args.num_windows)
               for n in lengths]
    label = args.method + (f" + {Path(args.adapter).parent.name}" if args.adapter else "")
    print(report.ppl_table(results, label))
    if args.output:
        report.write_json(args.output, {"label": label, "results": results, "config": _config(args)})
        print(f"wrote {args.output}")
    if args.plot:
        if not args.output:
            raise ValueError("--plot needs --output (the plot is drawn from the results file)")
        report.plot_ppl([args.output], args.plot)
        print(f"wrote {args.plot}")
    return 0


def run_passkey(args) -> int:
    from sparse_ft.evaluation import passkey, report

    lengths = _ints(args.lengths, "--lengths")
    try:
        depths = [float(x) for x in args.depths.split(",") if x]
    except ValueError:
        raise ValueError(f"--depths {args.depths!r} must be a comma-separated list of numbers in [0, 1]") from None
    if args.trials < 1:
        raise ValueError(f"--trials {args.trials} must be >= 1")
    method, model, tokenizer = _prepare(args)
    cells = passkey.evaluate(model, tokenizer, lengths, depths, args.trials, method, args.seed)
    print(report.passkey_table(cells))
    if args.output:
        report.write_json(args.output, {"label": args.method, "results": cells, "config": _config(args)})
        print(f"wrote {args.output}")
    if args.heatmap:
        report.plot_passkey(cells, args.heatmap, f"passkey retrieval: {args.method}")
        print(f"wrote {args.heatmap}")
    return 0


def run_plot(args) -> int:
    from sparse_ft.evaluation import report

    for path in args.results:
        if not path.is_file():
            raise FileNotFoundError(f"results file {path} does not exist")
    print(f"wrote {report.plot_ppl(args.results, args.output)}")
    return 0
