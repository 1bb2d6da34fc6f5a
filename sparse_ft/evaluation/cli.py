"""``sparse-ft eval ppl | passkey | plot``.

Everything that can be checked without the model is checked first (flags, method, data file,
that every output path can be written), so a mistake costs seconds, not a whole evaluation.
An output file is new, or an earlier output of sparse-ft replaced with ``--overwrite`` (the
results JSON and the PNGs carry a marker naming the command), and lies outside every input.
"""

from __future__ import annotations

import argparse
import platform
from pathlib import Path

from sparse_ft.config.keyvalue import parse_assignments
from sparse_ft.modeling.dtypes import NAMES as DTYPES

HELP = "perplexity and passkey retrieval of a model, an adapter or a training-free method"
DEFAULT_STRIDE = 256


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
    p.add_argument("--model", default=None, help="HF id, local directory, or 'tiny' (built-in test model); "
                   "default: with --adapter, the base it was trained on, else required")
    p.add_argument("--adapter", default=None, help="adapter directory written by sparse-ft train (default: none)")
    p.add_argument("--allow-other-base", action="store_true",
                   help="evaluate --adapter on a --model with other weights than the base it was trained on")
    p.add_argument("--method", default="full", help="full, an attention pattern, pi, ntk, yarn, or a registered method")
    p.add_argument("--method-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="method parameter, repeatable; values are YAML scalars (default: the method's defaults)")
    p.add_argument("--dtype", default="float32", choices=DTYPES, help="weights dtype")
    p.add_argument("--load-in-4bit", action="store_true", help="bitsandbytes NF4 with double quantisation")
    p.add_argument("--load-in-8bit", action="store_true", help="bitsandbytes LLM.int8")
    p.add_argument("--bnb-compute-dtype", default="float32", choices=DTYPES, help="dtype the 4-bit matmuls run in")
    p.add_argument("--device", default=None, help="e.g. cuda:0 or cpu (default: cuda when available, else cpu)")
    p.add_argument("--trust-remote-code", action="store_true", help="run code from the model repository")
    p.add_argument("--output", type=Path, default=None, help="results JSON (default: none, the table only)")
    p.add_argument("--label", default=None, help="name of this run in tables and plots (default: the method)")
    _overwrite_flag(p)


def _overwrite_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--overwrite", action="store_true", help="replace output files that hold an earlier sparse-ft output")


def configure(ev: argparse.ArgumentParser) -> None:
    which = ev.add_subparsers(dest="eval", required=True, metavar="KIND")
    p = which.add_parser("ppl", help="sliding-window perplexity at several lengths", description="sliding-window "
                         "perplexity at several lengths (docs/evaluation.md says exactly which tokens are scored)")
    _model_flags(p)
    p.add_argument("--data", required=True, help=".bin token file (with its .json sidecar), a text/jsonl/json/parquet "
                   "file or directory (any other file is read as UTF-8 text), or an HF dataset id")
    p.add_argument("--data-dtype", default=None, choices=["uint16", "uint32"],
                   help=".bin token width (default: from the file's JSON sidecar, else uint16)")
    p.add_argument("--split", default="validation", help="split of an HF dataset id")
    p.add_argument("--text-column", default="text", help="column holding the text (jsonl/json/parquet, HF datasets)")
    p.add_argument("--lengths", default="1024,2048,4096,8192", help="window lengths (comma list)")
    p.add_argument("--stride", type=int, default=None,
                   help="window step, at most the shortest window (default: 256, or the shortest --lengths when shorter)")
    p.add_argument("--scoring", default="standard", choices=["standard", "longlora"],
                   help="standard: every token once; longlora: LongLoRA eval.py's numbers")
    p.add_argument("--max-tokens", type=int, default=None, help="use only the first N tokens of --data (default: all)")
    p.add_argument("--num-windows", type=int, default=None, help="at most N windows per length (default: all)")
    p.add_argument("--batch-size", type=int, default=1, help="windows per forward")
    p.add_argument("--plot", type=Path, default=None, help="PPL-vs-length PNG (default: none)")
    p.set_defaults(func=run_ppl)
    k = which.add_parser("passkey", help="passkey retrieval over lengths x needle depths",
                         description="passkey retrieval over lengths x needle depths (landmark attention's prompt)")
    _model_flags(k)
    k.add_argument("--lengths", default="1024,2048,4096,8192", help="prompt lengths in the model's tokens (comma list)")
    k.add_argument("--depths", default="0,0.25,0.5,0.75,1", help="needle depths in [0, 1] (comma list)")
    k.add_argument("--trials", type=int, default=5, help="random keys per cell, the same keys in every cell")
    k.add_argument("--seed", type=int, default=0, help="seed of the keys")
    k.add_argument("--heatmap", type=Path, default=None, help="accuracy heatmap PNG (default: none)")
    k.set_defaults(func=run_passkey)
    g = which.add_parser("plot", help="PPL vs length, one line per results file",
                         description="PPL vs length, one line per results file of eval ppl --output")
    g.add_argument("results", nargs="+", type=Path, help="results JSON files of eval ppl --output")
    g.add_argument("--output", type=Path, required=True, help="the PNG to write")
    _overwrite_flag(g)
    g.set_defaults(func=run_plot)


def _method(args, lengths: list[int]):
    """The method, checked at every length it will run at (a pattern whose chunks would hold
    fewer than 2 keys there is refused, not run as attention to each token alone)."""
    from sparse_ft import methods

    params = _method_args(args.method_arg)
    method = methods.get(args.method, **params)
    for n in lengths:
        try:
            method.check_length(n)
        except ValueError as err:
            given = " ".join(f"--method-arg {item}" for item in args.method_arg) or "its default parameters"
            raise ValueError(f"--method {args.method} with {given} at --lengths {n}: {err}") from None
    return method


def _writer(args) -> str:
    return f"sparse-ft eval {args.eval}"


def _check_outputs(args, inputs: dict, *flags: str, pictures: tuple[str, ...] = ()) -> None:
    """Before the model loads: every output file can be written (its folder is made), is new
    or an earlier output of sparse-ft (with --overwrite), lies outside every input, and each
    of ``pictures`` is in a format matplotlib writes."""
    from sparse_ft.evaluation.plots import check_format
    from sparse_ft.files.outputs import check_apart, check_output_file

    for flag in (*flags, *pictures):
        path = getattr(args, flag)
        if path is None:
            continue
        check_apart(path, f"--{flag}", inputs)
        check_output_file(path, f"--{flag}", args.overwrite)
        if flag in pictures:
            check_format(path, f"--{flag}")


def _model_inputs(args) -> dict:
    """The local inputs of a model's evaluation, by flag."""
    from sparse_ft.modeling.tiny import is_built_in

    return {"--model": None if not args.model or is_built_in(args.model) else args.model, "--adapter": args.adapter}


def _load(args, method, tokenizer: bool = True):
    """The model and tokenizer (the method checked against the model's config before the
    weights load); says what the method reads from the config."""
    from sparse_ft.modeling.attention import pretrained
    from sparse_ft.evaluation import loading

    args.model = args.model or loading.recorded_base(args.adapter)  # what the results record
    model, tok = loading.load(args.model, args.adapter, args.dtype, args.load_in_4bit, load_in_8bit=args.load_in_8bit,
                              compute_dtype=args.bnb_compute_dtype, trust_remote_code=args.trust_remote_code,
                              device=args.device, tokenizer=tokenizer, allow_other_base=args.allow_other_base,
                              check_config=method.check_model)
    said = method.describe(pretrained(model).config)
    if said:
        print(said)
    return model, tok


def _label(args) -> str:
    return args.label or args.method + (f" + {Path(args.adapter).name}" if args.adapter else "")


def _config(args, model) -> dict:
    import torch
    import transformers

    from sparse_ft.modeling.attention import pretrained
    from sparse_ft.modeling.quantization import unquantised_layers

    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k not in ("func", "prog")}
    quantised = {"unquantised_layers": unquantised_layers(pretrained(model))} if args.load_in_4bit or args.load_in_8bit else {}
    return config | quantised | {"device": str(next(model.parameters()).device), "python": platform.python_version(),
                                 "torch": torch.__version__, "transformers": transformers.__version__}


def run_ppl(args) -> int:
    from sparse_ft.evaluation import loading, plots, ppl, report, tokens, windows

    lengths = _ints(args.lengths, "--lengths")
    if args.stride is None:
        args.stride = min(DEFAULT_STRIDE, *lengths)
    windows.check(lengths, args.stride)
    for flag in ("max_tokens", "num_windows", "batch_size"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise ValueError(f"--{flag.replace('_', '-')} {value} must be >= 1")
    method = _method(args, lengths)
    if not method.supports.ppl:
        raise ValueError(f"--method {args.method} cannot report perplexity: {method.supports.no_ppl_reason}")
    # the data is read before the weights load: a file without text costs seconds, not a load
    args.model = args.model or loading.recorded_base(args.adapter)
    _check_outputs(args, {**_model_inputs(args), "--data": args.data}, "output", pictures=("plot",))
    is_token_file = tokens.check_data(args.data, args.data_dtype)
    tokenizer = None if is_token_file else loading.tokenizer_for(args.model, args.adapter, args.trust_remote_code)
    stream = tokens.load_tokens(args.data, tokenizer, None, args.data_dtype, split=args.split,
                                text_column=args.text_column, max_tokens=args.max_tokens)
    too_long = [n for n in lengths if n > len(stream)]
    if too_long:
        raise ValueError(f"--lengths {','.join(map(str, too_long))} longer than the {len(stream)} tokens of --data (lower it or add data)")
    model, _ = _load(args, method, tokenizer=False)
    tokens.check_vocabulary(stream, model.get_output_embeddings().weight.shape[0], args.data)
    results = [ppl.evaluate_length(model, stream, n, args.stride, scoring=args.scoring, method=method,
                                   batch_size=args.batch_size, max_windows=args.num_windows)
               for n in lengths]
    label = _label(args)
    _emit(args, model, label, report.ppl_table(results, label), results=results)
    if args.plot:
        print(f"wrote {plots.plot_ppl([(label, results)], args.plot, writer=_writer(args))}")
    return 0


def _emit(args, model, label: str, table: str, *, results: list) -> None:
    """The markdown table on stdout and, with --output, the results JSON with the full configuration."""
    from sparse_ft.evaluation import report
    from sparse_ft.files.outputs import OUTPUT_FIELD

    print(table)
    if args.output:
        payload = {OUTPUT_FIELD: _writer(args), "label": label, "results": results, "config": _config(args, model)}
        report.write_json(args.output, payload)
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
    method = _method(args, lengths)
    _check_outputs(args, _model_inputs(args), "output", pictures=("heatmap",))
    model, tokenizer = _load(args, method)
    cells = passkey.evaluate(model, tokenizer, lengths, depths, trials=args.trials, method=method, seed=args.seed)
    label = _label(args)
    _emit(args, model, label, report.passkey_table(cells), results=cells)
    if args.heatmap:
        print(f"wrote {plots.plot_passkey(cells, args.heatmap, f'passkey retrieval: {label}', writer=_writer(args))}")
    return 0


def run_plot(args) -> int:
    from sparse_ft.evaluation import plots, report

    series = [report.read_ppl(path) for path in args.results]
    _check_outputs(args, {f"results file {index}": path for index, path in enumerate(args.results, 1)},
                   pictures=("output",))
    print(f"wrote {plots.plot_ppl(series, args.output, writer=_writer(args))}")
    return 0
