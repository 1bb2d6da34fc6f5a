"""The DeepSpeed JSON a recipe names (``deepspeed: zero3_bf16``): found, read, and the keys
that belong to the recipe rather than to the file. The file owns ZeRO's settings; the recipe
owns optimizer, schedule, batch sizes, clipping and precision. A file contradicting the recipe
is refused when the recipe loads (``sparse_ft.config.schema``); the trainer fills the file's
"auto"s for its world size (``sparse_ft.train.deepspeed``)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Optional

from sparse_ft.config.paths import DS_CONFIG_DIR
from sparse_ft.files.strict import json_value
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
    """The config, checked to have the shape the recipe's checks and the trainer read (an
    object; its ``zero_optimization``, ``bf16`` and ``fp16`` objects; counts that are counts),
    so that a wrong one fails in one line naming the file and key, not in a traceback."""
    path = deepspeed_config_path(name_or_path)
    where = f"recipe key deepspeed={name_or_path!r}" + ("" if str(path) == name_or_path else f" ({path})")
    try:
        config = json_value(path.read_text(encoding="utf-8"), where)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{where} is not valid JSON: {err}") from None
    _check_shape(config, where)
    return config


# sections the checks read as objects, and keys that hold a count or "auto"
SECTIONS = ("zero_optimization", *(short for short in DTYPES.values() if short != "fp32"))
COUNTS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "sequence_parallel_size")


def _check_shape(config: Any, where: str) -> None:
    if not isinstance(config, dict):
        raise ValueError(f"{where} holds a JSON {type(config).__name__}, not an object of DeepSpeed settings")
    for key in SECTIONS:
        if key in config and not isinstance(config[key], dict):
            raise ValueError(f"{where}: {key}={config[key]!r} must be an object (e.g. {key}: {{...}})")
    for short in SECTIONS[1:]:
        enabled = config.get(short, {}).get("enabled", False)
        if not isinstance(enabled, bool):
            raise ValueError(f"{where}: {short}.enabled={enabled!r} must be true or false")
    stage = config.get("zero_optimization", {}).get("stage", 0)
    if stage not in (0, 1, 2, 3) or isinstance(stage, bool):
        raise ValueError(f"{where}: zero_optimization.stage={stage!r} must be 0, 1, 2 or 3")
    for key in COUNTS:
        value = config.get(key, "auto")
        if not is_auto(value) and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(f"{where}: {key}={value!r} must be a positive integer or \"auto\"")
    clip = config.get("gradient_clipping", "auto")
    if not is_auto(clip) and (not isinstance(clip, (int, float)) or isinstance(clip, bool)):
        raise ValueError(f"{where}: gradient_clipping={clip!r} must be a number or \"auto\"")


def check_with_deepspeed(config: dict, name: str) -> None:
    """The config's ZeRO and precision sections through DeepSpeed's own validation (pydantic),
    before anything loads: a misspelt or wrong-typed setting would otherwise fail in
    ``deepspeed.initialize``, after the weights. Imports deepspeed (seconds), so the trainer's
    preflight calls it, not the recipe loader."""
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from pydantic import ValidationError

    for key, model in (("zero_optimization", DeepSpeedZeroConfig), ("bf16", DeepSpeedBF16Config), ("fp16", DeepSpeedFP16Config)):
        try:
            model(**config.get(key, {}))
        except ValidationError as err:
            first = err.errors()[0]
            field = ".".join(str(part) for part in (key, *first["loc"]))
            raise ValueError(f"deepspeed config {name}: {field}={first.get('input')!r} is invalid: {first['msg']}") from None


def check_cuda_arch_list(value: Optional[str], prebuilt: dict[str, bool]) -> None:
    """DeepSpeed (0.19) builds its optimizer ops (FusedAdam, CPU Adam) on first use and sorts
    ``TORCH_CUDA_ARCH_LIST`` as numbers, so an arch-specific entry such as ``9.0a`` (set by
    NVIDIA's Hopper images) ended a run on an H200 with "invalid literal for int() with base
    10: '0a'" once the weights had loaded. Refused here instead, unless those ops are prebuilt
    (``prebuilt``: DeepSpeed's ``installed_ops``)."""
    if not value or (prebuilt.get("fused_adam") and prebuilt.get("cpu_adam")):
        return
    entries = [e for e in re.split(r"[;\s]+", value) if e]
    bad = [e for e in entries if not re.fullmatch(r"\d+\.\d+(\+PTX)?", e)]
    if bad:
        fixed = ";".join(dict.fromkeys(re.sub(r"^(\d+\.\d+)[a-z]*", r"\1", e) for e in entries))
        raise ValueError(f"environment variable TORCH_CUDA_ARCH_LIST={value!r} is refused under DeepSpeed: its entry "
                         f"{bad[0]!r} breaks DeepSpeed's op build, which takes N.N or N.N+PTX entries only; "
                         f"run with TORCH_CUDA_ARCH_LIST={fixed!r}")


def is_auto(value: Any) -> bool:
    return isinstance(value, str) and value.startswith("auto")


def precision(config: dict) -> str:
    """The dtype the config trains in, as a recipe's ``model.dtype`` names it: DeepSpeed's
    sections carry the short names (``"bf16": {"enabled": true}``); none enabled is float32."""
    enabled = [name for name, short in DTYPES.items() if config.get(short, {}).get("enabled")]
    return enabled[0] if enabled else "float32"
