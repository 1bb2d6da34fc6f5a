"""What a checkpoint was trained with, recorded in it so that a resume continues the same run:
the values of the recipe's ``RESUME_KEYS`` and the number of processes. A resume that would
change any of them (another LoRA rank dies in a shape error, another lr or pattern would
continue silently as a different run) is refused by name, unless the recipe lists the key in
``train.resume_allow_changes``."""

from __future__ import annotations

import json
from functools import reduce
from pathlib import Path

from sparse_ft.config import Recipe
from sparse_ft.config.schema import RESUME_KEYS

WORLD = "world_size"  # not a recipe key: the data order depends on it, so no recipe may allow it
# Keys added after checkpoints were already being written: a checkpoint without one ran at this value.
ADDED = {"train.sequence_parallel_size": 1, "train.weight_decay_on": "all", "train.min_lr_ratio": 0.0}


def fingerprint(recipe: Recipe, world_size: int) -> dict:
    """The values as JSON stores them, so that a saved fingerprint compares equal."""
    values = {key: reduce(getattr, key.split("."), recipe) for key in RESUME_KEYS}
    return json.loads(json.dumps({**values, WORLD: world_size}))


def check_resume(saved: dict, current: dict, allowed: list[str], checkpoint: Path) -> None:
    """Raise ``ValueError`` naming every changed key the recipe does not allow (old and new
    value); print the allowed ones."""
    saved = {**ADDED, **saved}
    changed = {key: (saved.get(key), value) for key, value in current.items() if saved.get(key) != value}
    refused = {key: change for key, change in changed.items() if key not in allowed}
    accepted = {key: change for key, change in changed.items() if key in allowed}

    def describe(changes: dict) -> str:
        return "; ".join(f"{key}: {old!r} then, {new!r} now" for key, (old, new) in changes.items())

    if refused:
        keys = [key for key in refused if key != WORLD]
        allow = f", list them in train.resume_allow_changes=[{','.join(keys)}] to continue anyway" if keys else ""
        raise ValueError(f"train.resume: {checkpoint} was written with other settings ({describe(refused)}); "
                         f"restore them{allow}, or start afresh in a new train.output_dir")
    if accepted:
        print(f"train.resume_allow_changes: resuming {checkpoint} with {describe(accepted)}", flush=True)
