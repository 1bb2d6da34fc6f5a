"""Tokenise and pack a recipe's training data ahead of a run (the trainer reuses the cache):

    python scripts/prepare_train.py recipe=scca_flow_8k [data.source=... data.min_tokens=...]
"""

import sys

from sparse_ft.config import load_recipe
from sparse_ft.data.packing import build_train_dataset, load_meta
from sparse_ft.modeling.model_io import load_tokenizer, materialize_tiny
from sparse_ft.train.model_setup import base_model_path


def main(argv: list[str]) -> int:
    names = [a.split("=", 1)[1] for a in argv if a.startswith("recipe=")]
    if not names:
        print("usage: python scripts/prepare_train.py recipe=NAME [dotted.key=value ...]", file=sys.stderr)
        return 2
    recipe = load_recipe(names[0], [a for a in argv if not a.startswith("recipe=")])
    if recipe.model.name_or_path == "tiny":
        from pathlib import Path

        materialize_tiny(Path(base_model_path(recipe)), recipe.train.seed, **recipe.model.tiny)
    tokenizer = load_tokenizer(base_model_path(recipe), recipe.model.trust_remote_code)
    dataset = build_train_dataset(recipe.data, tokenizer, recipe.seq_len, recipe.model.trust_remote_code)
    print(f"{len(dataset)} samples of {recipe.seq_len} tokens at {dataset.path}: {load_meta(dataset)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
