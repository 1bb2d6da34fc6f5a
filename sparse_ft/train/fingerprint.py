"""What a checkpoint was trained with, recorded in it so that a resume continues the same run:
the values of the recipe's ``RESUME_KEYS``, the number of processes, and the training set (its
size and content). A resume that would change any of them (another lr or pattern would
continue silently as a different run, other data under the same recipe too) is refused by
name, unless the recipe lists the key in ``train.resume_allow_changes``. The keys that decide
the trained tensors' shapes cannot be allowed: no checkpoint continues under other shapes. Nor
can ``model.tiny``: the built-in base is written once into the run's directory, so a resume
would train on the old base whatever the recipe now says."""

from __future__ import annotations

import json
from functools import reduce
from pathlib import Path

from sparse_ft.config import Recipe
from sparse_ft.config.schema import RESUME_KEYS, WORLD_SIZE

# Keys added after checkpoints were already being written: a checkpoint without one ran at this value.
ADDED = {"train.sequence_parallel_size": 1, "train.weight_decay_on": "all", "train.min_lr_ratio": 0.0,
         "data.packing": "blocks", "model.quantization": "none", "data.format": "text", "data.chat_template": None,
         "model.native_length": None, "attention.dense_layers": [], "train.dense_final_fraction": 0.0}
# The keys that name and shape the trainable tensors (model.* may too: checkpoint.load_checkpoint compares shapes).
SHAPES = ("lora.r", "lora.target_modules", "lora.extra_trainable")
FIXED = (*SHAPES, "model.tiny")  # never allowed to change on resume


def fingerprint(recipe: Recipe, world_size: int) -> dict:
    """The values as JSON stores them, so that a saved fingerprint compares equal."""
    values = {key: reduce(getattr, key.split("."), recipe) for key in RESUME_KEYS}
    return json.loads(json.dumps({**values, WORLD_SIZE: world_size}))


def _describe(changes: dict) -> str:
    return "; ".join(f"{key}: {old!r} then, {new!r} now" for key, (old, new) in changes.items())


def check_resume(saved: dict, current: dict, allowed: list[str], checkpoint: Path) -> None:
    """Raise ``ValueError`` naming every changed key the recipe does not allow, or cannot
    (old and new value); print the allowed ones."""
    saved = {**ADDED, **saved}
    changed = {key: (saved.get(key), value) for key, value in current.items() if saved.get(key) != value}
    refused = {key: change for key, change in changed.items() if key not in allowed or key in FIXED}
    accepted = {key: change for key, change in changed.items() if key not in refused}
    if refused:
        shaped = [key for key in refused if key in SHAPES]
        allowable = [key for key in refused if key not in FIXED]
        allow = f", list them in train.resume_allow_changes=[{','.join(allowable)}] to continue anyway" if allowable else ""
        fixed = (f"; {', '.join(shaped)} shape(s) the trained tensors, which no resume can change (not even "
                 "train.resume_allow_changes)") if shaped else ""
        if "model.tiny" in refused:
            fixed += ("; model.tiny built the base this run wrote into its directory (base-model/) and trains on, "
                      "which no resume can change")
        raise ValueError(f"train.resume: {checkpoint} was written with other settings ({_describe(refused)}){fixed}; "
                         f"restore them{allow}, or start afresh in a new train.output_dir")
    if accepted:
        print(f"train.resume_allow_changes: resuming {checkpoint} with {_describe(accepted)}", flush=True)


def check_resume_data(saved: dict, current: dict, allowed: list[str], checkpoint: Path) -> None:
    """Raise ``ValueError`` when the training set differs from the one ``checkpoint`` was
    written on, by its number of samples or its content (the token cache's sha256, recorded
    when the cache was built; a checkpoint from before that was recorded is compared by size):
    the data order would continue over other samples. A ``data.*`` or ``model.*`` key the
    recipe allows to change allows this too."""
    if any(key.startswith(("data.", "model.")) for key in allowed):
        return
    changes = {key: (saved[key], current[key]) for key in ("samples", "sha256") if key in saved and saved[key] != current[key]}
    if "sha256" in changes:
        changes["sha256"] = tuple(f"{digest[:16]}..." for digest in changes["sha256"])
    if changes:
        raise ValueError(
            f"train.resume: {checkpoint} was written on other training data ({_describe(changes)}): data.source changed "
            "since, and the data order would continue over other samples; restore the data, list data.source in "
            "train.resume_allow_changes to continue on the new data, or start afresh in a new train.output_dir"
        )
