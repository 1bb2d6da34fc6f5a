"""Fine-tune a RoPE model to a longer context through a sparse attention pattern.

    deepspeed [--num_gpus N] [--hostfile H] train.py recipe=NAME [dotted.key=value ...]
    python train.py recipe=NAME [dotted.key=value ...]
    torchrun --nproc_per_node N train.py recipe=NAME ...
"""

import os
import sys


def parse_argv(argv: list[str]) -> tuple[str, list[str]]:
    """``recipe=NAME`` plus overrides; the launchers' ``--local_rank`` is tolerated."""
    recipe, overrides, skip = None, [], False
    for i, arg in enumerate(argv):
        if skip:
            skip = False
            continue
        if arg.startswith("--local_rank") or arg.startswith("--local-rank"):
            if "=" in arg:
                os.environ.setdefault("LOCAL_RANK", arg.split("=", 1)[1])
            else:
                skip = True
                if i + 1 < len(argv):
                    os.environ.setdefault("LOCAL_RANK", argv[i + 1])
            continue
        if arg.startswith("recipe="):
            recipe = arg.split("=", 1)[1]
        else:
            overrides.append(arg)
    if not recipe:
        raise SystemExit("usage: train.py recipe=NAME [dotted.key=value ...]  (recipes live in recipes/)")
    return recipe, overrides


def fail(err: Exception, code: int) -> int:
    print(f"train.py: error: {err}", file=sys.stderr)
    return code


def main() -> int:
    """0 when trained; 2 when the recipe, its data or the output directory stop the run before
    it trains (a one-line error, no traceback); 1 when a checkpoint cannot be written."""
    recipe_name, overrides = parse_argv(sys.argv[1:])
    from sparse_ft.config import load_recipe
    from sparse_ft.train.checkpoint import CheckpointWriteError
    from sparse_ft.train.trainer import Trainer

    try:
        recipe = load_recipe(recipe_name, overrides)
    except (ValueError, FileNotFoundError) as err:
        return fail(err, 2)
    trainer = Trainer(recipe)
    try:
        trainer.run()
    except CheckpointWriteError as err:
        return fail(err, 1)
    except (ValueError, FileNotFoundError) as err:  # preflight's BadInput included
        if trainer.training:  # raised by the loop itself: its traceback is what to look at
            raise
        return fail(err, 2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
