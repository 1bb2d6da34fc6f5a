"""The DeepSpeed JSON a recipe names (``deepspeed: zero3_bf16``): found, read, and the keys
that belong to the recipe rather than to the file. The file owns ZeRO's settings; the recipe
owns optimizer, schedule, batch sizes, clipping and precision. A file contradicting the recipe
is refused when the recipe loads (``sparse_ft.config.schema``); the trainer fills the file's
"auto"s for its world size (``sparse_ft.train.deepspeed``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from sparse_ft.config.paths import DS_CONFIG_DIR
from sparse_ft.modeling.dtypes import DTYPES

# DeepSpeed keys the recipe owns: a config may leave them "auto" or repeat the recipe's value.
RECIPE_OWNED = {
    "train_micro_batch_size_per_gpu": lambda t: t.per_device_batch_size,
    "gradient_accumulation_steps": lambda t: t.gradient_accumulation_steps,
    "gradient_clipping": lambda t: t.max_grad_norm,
    # read where no SP groups exist yet (ZeRO-3's zero.Init): batch arithmetic over world / sp ranks
    "sequence_parallel_size": lambda t: t.sequence_parallel_size,
}


def deepspeed_config_path(name_or_path: str) -> Path:
    """``zero3_fp16`` -> ds_configs/zero3_fp16.json; a path is taken as it is."""
    path = Path(name_or_path)
    if not path.suffix:
        path = DS_CONFIG_DIR / f"{name_or_path}.json"
    elif not path.exists() and (DS_CONFIG_DIR / path.name).exists():
        path = DS_CONFIG_DIR / path.name
    if not path.is_file():
        known = sorted(p.stem for p in DS_CONFIG_DIR.glob("*.json"))
        raise ValueError(f"recipe key deepspeed={name_or_path!r}: no such file; known configs: {', '.join(known)}")
    return path


def read_deepspeed_config(name_or_path: str) -> dict:
    path = deepspeed_config_path(name_or_path)
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"recipe key deepspeed={name_or_path!r}: {path} is not valid JSON: {err}") from None


def is_auto(value: Any) -> bool:
    return isinstance(value, str) and value.startswith("auto")


def precision(config: dict) -> str:
    """The dtype the config trains in, as a recipe's ``model.dtype`` names it: DeepSpeed's
    sections carry the short names (``"bf16": {"enabled": true}``); none enabled is float32."""
    enabled = [name for name, short in DTYPES.items() if config.get(short, {}).get("enabled")]
    return enabled[0] if enabled else "float32"
