"""``sparse-ft`` command line: one sub-command per module, each adding its own parser.

Each module in ``COMMANDS`` defines ``add_parser(subparsers)`` that registers its
sub-command and sets ``func`` (called with the parsed namespace, returns an exit code).
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = [
    "sparse_ft.bench.cli",
    "sparse_ft.merge",
    "sparse_ft.evaluation.cli",
    "sparse_ft.pretrain",
    "sparse_ft.experiment",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sparse-ft", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for module in COMMANDS:
        importlib.import_module(module).add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as err:
        print(f"sparse-ft {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
