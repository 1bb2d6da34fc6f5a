"""``sparse-ft`` command line: one sub-command per module.

Each module in ``COMMANDS`` has ``HELP`` (one line) and ``configure(parser)``, which adds its
flags and sets ``func`` (called with the parsed namespace, returns an exit code). Those modules
import no torch or transformers at the top, only inside ``func``: building every parser costs
nothing, so ``--help`` answers at once.
"""

from __future__ import annotations

import argparse
import importlib
import shlex
import signal
import sys
from typing import Optional

from sparse_ft import __version__, console
from sparse_ft.train.stopping import RunStopped

COMMANDS = {
    "train": "sparse_ft.train.cli",
    "eval": "sparse_ft.evaluation.cli",
    "generate": "sparse_ft.evaluation.generate",
    "merge": "sparse_ft.merge",
    "pretrain": "sparse_ft.experiment.pretrain",
    "experiment": "sparse_ft.experiment.run",
    "bench": "sparse_ft.bench.cli",
    "plan": "sparse_ft.plan.cli",
}


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every flag's help ends with its default, unless it has none worth printing (a switch, an
    unset value) or the help already says what it is."""

    def _get_help_string(self, action: argparse.Action) -> Optional[str]:
        if action.default is None or action.default is False or action.default == [] or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """The parser of the program and of every sub-command under it (argparse builds those with
    the parent's class)."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)


def add_verbosity(parser: argparse.ArgumentParser, default: object = console.NORMAL) -> None:
    """``-q`` / ``-v`` (``sparse_ft.console``); a sub-command's copy has no default, so that
    ``sparse-ft -q train`` and ``sparse-ft train -q`` mean the same."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument("-q", "--quiet", dest="verbosity", action="store_const", const=console.QUIET, default=default,
                       help="results, warnings and errors only: no run summary, no progress bars")
    group.add_argument("-v", "--verbose", dest="verbosity", action="store_const", const=console.VERBOSE, default=default,
                       help="also the full resolved recipe of a run, and every library warning (none filtered)")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="sparse-ft", description="Extend the context of RoPE language models: "
                    "sparse-attention LoRA fine-tuning, training-free methods, one evaluation path.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    add_verbosity(parser)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module_name in COMMANDS.items():
        module = importlib.import_module(module_name)
        command = sub.add_parser(name, help=module.HELP, description=module.HELP)
        command.set_defaults(prog=command.prog)
        add_verbosity(command, argparse.SUPPRESS)
        module.configure(command)
    return parser


def run(args: argparse.Namespace) -> int:
    """The command's exit code; a ValueError or a file that cannot be read or written (an
    OSError names it) is one line on stderr and exit 2; a training run that stopped on purpose
    (a stop signal, a divergence) is its one line and its own code (``sparse_ft.train.stopping``),
    Ctrl-C anywhere else one line and 130."""
    console.set_verbosity(args.verbosity)
    console.library_logs_to_stderr()
    try:
        return int(args.func(args) or 0)
    except (ValueError, OSError) as err:
        print(f"{args.prog}: error: {err}", file=sys.stderr)
        return 2
    except RunStopped as stop:
        if stop.announce:
            print(f"{args.prog}: {stop}", file=sys.stderr, flush=True)
        return stop.exit_code
    except KeyboardInterrupt:  # Ctrl-C where no run catches it (a training run does): nothing was in progress to save
        print(f"{args.prog}: interrupted by SIGINT", file=sys.stderr)
        return 128 + signal.SIGINT


def parse(parser: argparse.ArgumentParser, argv: Optional[list[str]]) -> argparse.Namespace:
    """argparse ends a list of positionals at the first flag; ``key=value`` arguments after one
    join a command's ``assignments`` (launchers put ``--local_rank`` first, people put flags
    anywhere)."""
    args, extra = parser.parse_known_args(argv)
    if extra:
        if not isinstance(getattr(args, "assignments", None), list) or any(x.startswith("-") for x in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.assignments += extra
    return args


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse(build_parser(), argv)
    args.command_line = shlex.join(["sparse-ft", *argv])  # what a benchmark's results record as their command
    return run(args)


def script(name: str, prog: str, argv: Optional[list[str]] = None) -> int:
    """One command as a program of its own (``train.py`` is ``sparse-ft train``)."""
    module = importlib.import_module(COMMANDS[name])
    parser = Parser(prog=prog, description=module.HELP)
    parser.set_defaults(prog=prog)
    add_verbosity(parser)
    module.configure(parser)
    return run(parse(parser, argv))


if __name__ == "__main__":
    raise SystemExit(main())
