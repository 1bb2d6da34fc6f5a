"""``sparse-ft eval TASK | plot``: every task of ``sparse_ft.evaluation.tasks`` (perplexity,
passkey retrieval, RULER's synthetic tasks and their suite) through one path.

Everything that can be checked without the model is checked first (flags, method, data file,
that every output path can be written), so a mistake costs seconds, not a whole evaluation.
An output file is new, or an earlier output of sparse-ft replaced with ``--overwrite`` (the
results JSON and the PNGs carry a marker naming the command), and lies outside every input.
"""

from __future__ import annotations

import argparse
import platform
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, TextIO

from sparse_ft.files.keyvalue import parse_assignments
from sparse_ft.modeling import dtypes

if TYPE_CHECKING:
    from sparse_ft.methods import Method
    from sparse_ft.methods.dense_layers import DenseSpec

HELP = "perplexity, passkey retrieval and RULER's tasks of a model, an adapter or a training-free method"


def _method_args(items: list[str]) -> dict:
    return dict(parse_assignments(items, "--method-arg"))


def _model_flags(p: argparse.ArgumentParser) -> None:
    loading_flags(p)
    p.add_argument("--output", type=Path, default=None, help="results JSON (default: none, the table only)")
    p.add_argument("--label", default=None, help="name of this run in tables and plots (default: the method)")
    overwrite_flag(p)


def loading_flags(p: argparse.ArgumentParser) -> None:
    """The model, adapter, method and how they load: ``eval`` and ``generate`` take the same."""
    p.add_argument("--model", default=None, help="HF id, local directory, or 'tiny' (built-in test model with random "
                   "weights; assets/tiny-base-bpe and assets/tiny-base are pretrained ones); default: with --adapter, the base "
                   "it was trained on, else required")
    p.add_argument("--adapter", default=None, help="adapter directory written by sparse-ft train (default: none)")
    p.add_argument("--allow-other-base", action="store_true",
                   help="evaluate --adapter on a --model with other weights than the base it was trained on")
    p.add_argument("--method", default="full", help="full, an attention pattern, pi, ntk, yarn, or a registered method")
    p.add_argument("--method-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="method parameter, repeatable; values are YAML scalars (default: the method's defaults)")
    p.add_argument("--dtype", default="float32", choices=dtypes.NAMES, help="weights dtype")
    p.add_argument("--load-in-4bit", action="store_true", help="bitsandbytes NF4 with double quantisation")
    p.add_argument("--load-in-8bit", action="store_true", help="bitsandbytes LLM.int8")
    p.add_argument("--bnb-compute-dtype", default="float32", choices=dtypes.NAMES,
                   help="dtype the 4-bit matmuls run in")
    p.add_argument("--device", default=None, help="e.g. cuda:0 or cpu (default: cuda when available, else cpu)")
    p.add_argument("--trust-remote-code", action="store_true", help="run code from the model repository")
    p.add_argument("--dense-layers", default=None, metavar="SPEC",
                   help="as attention.dense_layers: these layers attend fully (comma list of indices, or 'last n') while "
                        "the others run --method, an attention pattern: an adapter as it was trained with dense layers "
                        "(default: none, --method in every layer)")


def overwrite_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--overwrite", action="store_true", help="replace output files that hold an earlier sparse-ft output")


def configure(ev: argparse.ArgumentParser) -> None:
    from sparse_ft.evaluation import tasks

    which = ev.add_subparsers(dest="eval", required=True, metavar="TASK")
    for name in tasks.names():
        task = tasks.TASKS.factory(name)
        p = which.add_parser(name, help=task.summary, description=task.description or task.summary)
        _model_flags(p)
        task.configure(p)
        p.set_defaults(func=run_task)
    g = which.add_parser("plot", help="PPL vs length, one line per results file",
                         description="PPL vs length, one line per results file of eval ppl --output")
    g.add_argument("results", nargs="+", type=Path, help="results JSON files of eval ppl --output")
    g.add_argument("--output", type=Path, required=True, help="the PNG to write")
    overwrite_flag(g)
    g.set_defaults(func=run_plot)


def method_from_args(args, lengths: list[int]):
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


def dense_layers_from_args(args: argparse.Namespace, method: Method) -> Optional[DenseSpec]:
    """``--dense-layers`` as ``attention.dense_layers`` takes it, its form checked before
    anything loads (None without the flag; the range needs the model's config): those layers
    attend fully while the others run ``method``, which must be an attention pattern."""
    import attn_patterns
    from sparse_ft import methods

    if args.dense_layers is None:
        return None
    spec = methods.dense_layers_option(args.dense_layers, "--dense-layers")
    if not isinstance(method, methods.PatternMethod):
        raise ValueError(f"--dense-layers {args.dense_layers!r}: the other layers run --method, which must be an attention "
                         f"pattern; --method {args.method} is not one (allowed: {', '.join(attn_patterns.PATTERNS.names())})")
    return spec


def dense_layers_range(args: argparse.Namespace) -> Callable[[Any], None]:
    """A check of ``--dense-layers``' indices against a model's config, named by the flag, for
    :func:`load_model`'s ``check_config`` (before the weights load; nothing without the flag)."""
    def check(config: Any) -> None:
        from sparse_ft import methods
        from sparse_ft.methods.dense_layers import num_layers

        if args.dense_layers is not None:
            methods.dense_layers_option(args.dense_layers, "--dense-layers", num_layers(config))
    return check


def _writer(args) -> str:
    return f"sparse-ft eval {args.eval}"


def _check_outputs(args, inputs: dict, *flags: str, pictures: tuple[str, ...] = ()) -> None:
    """Before the model loads: every output file can be written (its folder is made), is new
    or an earlier output of sparse-ft (with --overwrite), lies outside every input, and each
    of ``pictures`` is in a format matplotlib writes."""
    from sparse_ft.evaluation.plots import check_format
    from sparse_ft.files.outputs import check_apart, check_output_file

    written: dict[Path, str] = {}  # one command's outputs must not replace each other either
    for flag in (*flags, *pictures):
        path = getattr(args, flag)
        if path is None:
            continue
        if Path(path).resolve() in written:
            raise ValueError(f"--{flag} {path} is also {written[Path(path).resolve()]}: name two different files")
        written[Path(path).resolve()] = f"--{flag}"
        check_apart(path, f"--{flag}", inputs)
        check_output_file(path, f"--{flag}", args.overwrite)
        if flag in pictures:
            check_format(path, f"--{flag}")


def model_inputs(args) -> dict:
    """The local inputs of a model's evaluation, by flag."""
    from sparse_ft.modeling.tiny import is_built_in

    return {"--model": None if not args.model or is_built_in(args.model) else args.model, "--adapter": args.adapter}


def _check_markdown(args, inputs: dict) -> Path:
    """The markdown table written beside ``--output``, checked as the JSON is."""
    from sparse_ft.files.outputs import check_apart, check_output_file

    if args.output.suffix == ".md":
        raise ValueError(f"--output {args.output} names the results JSON; its markdown table is written beside it as "
                         f"{args.output.with_suffix('.md').name}: name it {args.output.with_suffix('.json').name}")
    markdown = args.output.with_suffix(".md")
    check_apart(markdown, "--output", inputs)
    check_output_file(markdown, "--output", args.overwrite)
    return markdown


def load_model(args, method, tokenizer: bool = True, *, check_config: Optional[Callable[[Any], None]] = None,
          log: Optional[TextIO] = None):
    """The model and tokenizer (the method, and ``check_config`` if given, checked against the
    model's config before the weights load); says on ``log`` (default stdout) what the method
    reads from the config. ``args.model`` is the command's, resolved once by it (the adapter's
    recorded base when ``--model`` was not given: what the results record)."""
    from sparse_ft.modeling.attention import pretrained
    from sparse_ft.modeling.devices import default_device
    from sparse_ft.modeling.dtypes import torch_dtype
    from sparse_ft.evaluation import loading

    method.check_device(args.device or default_device(), torch_dtype(args.dtype))
    model, tok = loading.load(args.model, args.adapter, args.dtype, args.load_in_4bit, load_in_8bit=args.load_in_8bit,
                              compute_dtype=args.bnb_compute_dtype, trust_remote_code=args.trust_remote_code,
                              device=args.device, tokenizer=tokenizer, allow_other_base=args.allow_other_base,
                              check_config=lambda config: _check_config(config, method, check_config))
    said = method.describe(pretrained(model).config)
    if said:
        print(said, file=log)
    return model, tok


def _check_config(config: Any, method, check: Optional[Callable[[Any], None]]) -> None:
    method.check_model(config)
    if check is not None:
        check(config)


QUANTISED = {"load_in_4bit": "NF4", "load_in_8bit": "LLM.int8"}


def _label(args, method: str) -> str:
    """The run's name in tables and plots: the ``method`` (its dense layers included), the
    adapter, the quantisation (an NF4 run is not the model in full precision), and the built-in
    model's random weights (its numbers measure no pretrained model)."""
    from sparse_ft.modeling.tiny import RANDOM_LABEL, is_built_in

    if args.label:
        return args.label
    bits = [name for flag, name in QUANTISED.items() if getattr(args, flag)]
    random = f" on {RANDOM_LABEL}" if is_built_in(getattr(args, "model", None) or "") else ""
    return method + (f" + {Path(args.adapter).name}" if args.adapter else "") + "".join(f" ({b})" for b in bits) + random


def _model_name(args) -> str:
    from sparse_ft.evaluation.report import model_name

    return model_name(args.model)


def _config(args, model) -> dict:
    import torch
    import transformers

    from sparse_ft.modeling.attention import pretrained
    from sparse_ft.modeling.quantization import unquantised_layers

    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k not in ("func", "prog")}
    quantised = {"unquantised_layers": unquantised_layers(pretrained(model))} if args.load_in_4bit or args.load_in_8bit else {}
    return config | quantised | {"device": str(next(model.parameters()).device), "python": platform.python_version(),
                                 "torch": torch.__version__, "transformers": transformers.__version__}


def run_task(args) -> int:
    """Any registered task: flags, method and outputs checked, then what needs only the
    tokenizer (text data tokenised, RULER's prompts built: a length too short fails here),
    then the weights, the evaluation, the table, the results JSON and markdown, the picture."""
    from sparse_ft import methods
    from sparse_ft.evaluation import loading, tasks
    from sparse_ft.modeling.attention import FirstForwardCheck

    task = tasks.TASKS.factory(args.eval).from_args(args)
    method = method_from_args(args, task.lengths)
    dense = dense_layers_from_args(args, method)
    task.check_method(method)
    args.model = args.model or loading.recorded_base(args.adapter)  # once per run: what the results record
    inputs = {**model_inputs(args), **task.inputs()}
    _check_outputs(args, inputs, "output", pictures=(task.picture,) if task.picture else ())
    if args.output is not None:
        _check_markdown(args, inputs)
    tokenizer = loading.tokenizer_for(args.model, args.adapter, args.trust_remote_code) if task.needs_tokenizer() else None
    task.prepare(tokenizer)
    # the dense layers' range is checked against the config, named by the flag, before the weights
    # load, beside the pattern's own check; the pattern is wrapped after (their causal takes any config)
    def check_config(config: Any) -> None:
        dense_layers_range(args)(config)
        task.check_model(config)

    model, _ = load_model(args, method, tokenizer=False, check_config=check_config)
    if dense is not None:
        method = methods.with_dense_layers(method, dense)
    FirstForwardCheck(model, when=f"--method {args.method}")  # the method asked for is the one that runs
    rows = task.evaluate(model, tokenizer, method)
    label = _label(args, args.method if dense is None else methods.dense_layers_name(args.method, dense))
    _emit(args, model, label, task.table(rows, label), results=rows, summary=task.summary_of(rows))
    picture = getattr(args, task.picture) if task.picture else None
    if picture is not None:
        print(f"wrote {task.draw(rows, picture, label=label, model=_model_name(args), writer=_writer(args))}")
    return 0


def _emit(args, model, label: str, table: str, *, results: list, summary: dict) -> None:
    """The markdown table on stdout and, with --output, the results JSON with the full
    configuration and beside it the table as markdown (title, command, table)."""
    from sparse_ft.evaluation import report
    from sparse_ft.files.outputs import OUTPUT_FIELD

    print(table)
    if args.output:
        payload = {OUTPUT_FIELD: _writer(args), "label": label, "results": results, **({"summary": summary} if summary else {}),
                   "config": _config(args, model)}
        report.write_json(args.output, payload)
        markdown = report.write_markdown(args.output.with_suffix(".md"), f"{_writer(args)}: {_model_name(args)}, {label}",
                                         table, command=getattr(args, "command_line", None), writer=_writer(args))
        print(f"wrote {args.output} and {markdown}")


def run_plot(args) -> int:
    from sparse_ft.evaluation import plots, report

    runs = [report.read_ppl(path) for path in args.results]
    _check_outputs(args, {f"results file {index}": path for index, path in enumerate(args.results, 1)},
                   pictures=("output",))
    models = sorted({model for _, _, model in runs if model})
    title = f"perplexity: {', '.join(models)}" if models else ""
    print(f"wrote {plots.plot_ppl([(label, rows) for label, rows, _ in runs], args.output, title=title, writer=_writer(args))}")
    return 0
