"""Where the shipped recipes, DeepSpeed configs and tiny assets live: names given on a command
line (``recipe=tiny``, ``deepspeed=zero3_bf16``) are looked up here, and a shipped recipe's
relative paths (``data.source: data/tiny/train.jsonl``) resolve against ``REPO_ROOT``.

In a checkout (editable install or ``PYTHONPATH``) that is the repository's top level. A
built wheel carries the same files in the same layout under ``sparse_ft/_data`` (mapped there
by ``pyproject.toml``), so an installed package needs no checkout."""

from pathlib import Path

_PACKAGE_DATA = Path(__file__).resolve().parent.parent / "_data"
REPO_ROOT = _PACKAGE_DATA if _PACKAGE_DATA.is_dir() else _PACKAGE_DATA.parent.parent
RECIPE_DIRS = [REPO_ROOT / "recipes"]
DS_CONFIG_DIR = REPO_ROOT / "ds_configs"
TINY_BASE_DIR = REPO_ROOT / "assets" / "tiny-base"  # byte tokenizer, C = 256: the unit tests' quick model
# BPE tokenizer, C = 1,024, retrieves by construction (scripts/pretrain_bpe_base.sh 3): the experiment's base
BPE_BASE_DIR = REPO_ROOT / "assets" / "tiny-base-bpe"
