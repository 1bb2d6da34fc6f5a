"""Recipes: readable YAML, typed and validated, overridable with ``dotted.key=value``.

A recipe is data only (PEFT-style): the trainer reads it, nothing in it executes. Errors
name the dotted key, the value and what is allowed, before any model is loaded.

``schema``: the sections and their checks; ``loader``: finding, inheriting, overriding, loading
and saving recipes; ``deepspeed_file``: the DeepSpeed JSON a recipe names; ``bad_input``: how a
bad value is refused; ``paths``: where recipes and DeepSpeed configs live. The ``key=value``
parser and the strict YAML/JSON reader live in ``sparse_ft.files``, shared with the commands.
"""

from sparse_ft.config.deepspeed_file import deepspeed_config_path
from sparse_ft.files.keyvalue import parse_assignments
from sparse_ft.config.loader import (find_recipe, format_recipe, load_recipe, parse_overrides, recipe_names, save_resolved,
                                     summarize_recipe)
from sparse_ft.config.paths import DS_CONFIG_DIR, RECIPE_DIRS, REPO_ROOT
from sparse_ft.config.schema import AttentionSection, DataSection, LoraSection, ModelSection, Recipe, TrainSection

__all__ = [
    "DS_CONFIG_DIR", "RECIPE_DIRS", "REPO_ROOT", "AttentionSection", "DataSection", "LoraSection", "ModelSection", "Recipe",
    "TrainSection", "deepspeed_config_path", "find_recipe", "format_recipe", "load_recipe", "parse_assignments",
    "parse_overrides", "recipe_names", "save_resolved", "summarize_recipe",
]
