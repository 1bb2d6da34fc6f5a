"""Where a checkout keeps its recipes and DeepSpeed configs: names given on a command line
(``recipe=tiny``, ``deepspeed=zero3_bf16``) are looked up here."""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent.parent
RECIPE_DIRS = [REPO_ROOT / "recipes"]
DS_CONFIG_DIR = REPO_ROOT / "ds_configs"
