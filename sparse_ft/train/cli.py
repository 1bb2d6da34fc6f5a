"""``sparse-ft train`` and ``train.py``: fine-tune as a recipe says.

    sparse-ft train recipe=NAME [dotted.key=value ...]
    deepspeed [--num_gpus N] [--hostfile H] train.py recipe=NAME [dotted.key=value ...]
    deepspeed [--num_gpus N] --no_local_rank --module sparse_ft train recipe=NAME ...   (installed, no checkout)
    torchrun --nproc_per_node N train.py recipe=NAME ...

Every process parses the same arguments; the DeepSpeed launcher's ``--local_rank`` becomes
``LOCAL_RANK``, where ``torch.distributed`` reads it. An installed package runs the root
command (``python -m sparse_ft``), which takes no launcher flag before its sub-command: there
``--no_local_rank`` leaves the rank to ``LOCAL_RANK``, which the launcher sets as well.
"""

from __future__ import annotations

import argparse
import os
import sys

from sparse_ft.config import format_recipe, load_recipe, recipe_names

HELP = "fine-tune with LoRA+ through a sparse attention pattern, as a recipe says"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("assignments", nargs="*", metavar="recipe=NAME | KEY=VALUE",
                        help="the recipe (a name under recipes/ or a YAML path) and dotted.key=value overrides, "
                             "values read as YAML (train.lr=1e-4, deepspeed=null); see docs/recipes.md")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None,
                        help="set by the deepspeed launcher and exported as LOCAL_RANK (default: the environment's)")
    parser.add_argument("--print-recipe", action="store_true", help="print the resolved recipe and exit without training")
    parser.epilog = "recipes: " + ", ".join(recipe_names())
    parser.set_defaults(func=run)


def recipe_arguments(args: argparse.Namespace) -> tuple[str, list[str]]:
    """``recipe=NAME`` and the overrides, in order; the launcher's rank exported."""
    if args.local_rank is not None:
        os.environ.setdefault("LOCAL_RANK", str(args.local_rank))
    names = [a.split("=", 1)[1] for a in args.assignments if a.startswith("recipe=")]
    if len(names) != 1 or not names[0]:
        raise ValueError(f"recipe=NAME must be given once, got {len(names)}; recipes: {', '.join(recipe_names())}")
    return names[0], [a for a in args.assignments if not a.startswith("recipe=")]


def parse_argv(argv: list[str]) -> tuple[str, list[str]]:
    """``train.py``'s arguments as the launchers pass them (``--local_rank`` anywhere)."""
    parser = argparse.ArgumentParser(prog="train.py")
    configure(parser)
    return recipe_arguments(parser.parse_intermixed_args(argv))


def run(args: argparse.Namespace) -> int:
    name, overrides = recipe_arguments(args)
    recipe = load_recipe(name, overrides)
    if args.print_recipe:
        print(format_recipe(recipe), end="")
        return 0
    from sparse_ft.train.checkpoint import CheckpointWriteError
    from sparse_ft.train.trainer import Trainer

    from sparse_ft.train.distributed import end_distributed

    trainer = Trainer(recipe)
    try:
        trainer.run()
    except CheckpointWriteError as err:  # the run stopped; its earlier checkpoints are intact
        print(f"{args.prog}: error: {err}", file=sys.stderr)
        return 1
    except (ValueError, OSError) as err:
        if trainer.training:  # raised by the loop itself, not by an input: its traceback is what to look at
            raise RuntimeError(f"training stopped: {err}") from err
        raise
    end_distributed()  # the run is over: a launched rank leaves here (an error leaves the group to the exit that follows)
    return 0
