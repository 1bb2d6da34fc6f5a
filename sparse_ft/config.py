"""Recipes: readable YAML, typed and validated, overridable with ``dotted.key=value``.

A recipe is data only (PEFT-style): the trainer reads it, nothing in it executes. Errors
name the dotted key, the value and what is allowed, before any model is loaded.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import json
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml

REPO_ROOT = Path(__file__).resolve().parent.parent
RECIPE_DIRS = [REPO_ROOT / "recipes"]
DS_CONFIG_DIR = REPO_ROOT / "ds_configs"


@dataclass
class ModelSection:
    name_or_path: str = "tiny"  # HF id, local directory, or "tiny": the built-in test model
    dtype: str = "bfloat16"
    target_length: int = 8192
    rope_method: str = "linear"
    trust_remote_code: bool = False
    tiny: dict = field(default_factory=dict)  # LlamaConfig overrides for name_or_path=tiny


@dataclass
class AttentionSection:
    pattern: str = "scca_flow"
    params: dict = field(default_factory=dict)  # checked against attn_patterns.get(pattern, **params)
    backend: Optional[str] = None  # null = sdpa; auto = flash-attn where installed (CUDA, fp16/bf16), else sdpa


@dataclass
class LoraSection:
    r: int = 8
    alpha: int = 16
    dropout: float = 0.0  # LongLoRA fine-tune.py
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    # LongLoRA's LoRA+: embeddings and normalisation layers train too (PEFT modules_to_save,
    # matched by name suffix: "norm" covers every RMSNorm).
    extra_trainable: list[str] = field(default_factory=lambda: ["embed_tokens", "norm"])


@dataclass
class DataSection:
    source: str = "hf://datasets/togethercomputer/RedPajama-Data-1T-Sample/*.jsonl"  # see sparse_ft/data/sources.py
    split: str = "train"
    text_column: str = "text"
    min_tokens: int = 0
    seq_len: Optional[int] = None  # default: model.target_length
    cache_dir: str = ".cache/sparse-ft/data"
    streaming: bool = False
    max_documents: Optional[int] = None


@dataclass
class TrainSection:
    output_dir: str = "runs/default"
    max_steps: int = -1  # -1: num_epochs over the data
    num_epochs: int = 1
    lr: float = 2e-5
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    warmup_steps: int = 20
    scheduler: str = "constant"
    per_device_batch_size: int = 1
    gradient_accumulation_steps: int = 8
    gradient_checkpointing: bool = True
    max_grad_norm: float = 1.0
    seed: int = 42
    save_steps: int = 1000
    save_total_limit: int = 2
    log_steps: int = 1
    resume: str = "auto"  # auto | never | a checkpoint directory
    report_to: list[str] = field(default_factory=lambda: ["tensorboard"])


@dataclass
class Recipe:
    model: ModelSection = field(default_factory=ModelSection)
    attention: AttentionSection = field(default_factory=AttentionSection)
    lora: LoraSection = field(default_factory=LoraSection)
    data: DataSection = field(default_factory=DataSection)
    train: TrainSection = field(default_factory=TrainSection)
    deepspeed: Optional[str] = None  # a file in ds_configs/ (name or path), or null
    name: str = ""  # set from the recipe file

    @property
    def seq_len(self) -> int:
        return self.data.seq_len or self.model.target_length

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


CHOICES = {
    "model.dtype": ("float32", "float16", "bfloat16"),
    "model.rope_method": ("linear", "dynamic", "yarn"),
    "attention.backend": (None, "auto", "sdpa", "flash", "flex"),
    "train.scheduler": ("constant", "linear", "cosine"),
}
POSITIVE = {"model.target_length", "lora.r", "lora.alpha", "train.per_device_batch_size",
            "train.gradient_accumulation_steps", "train.save_steps", "train.log_steps", "train.num_epochs"}
REPORTERS = ("tensorboard", "wandb", "none")


def _fail(key: str, value: Any, allowed: str) -> None:
    raise ValueError(f"recipe key {key}={value!r} is invalid: {allowed}")


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp)).replace("typing.", "")


def _coerce(key: str, value: Any, tp: Any) -> Any:
    origin = typing.get_origin(tp)
    if origin is typing.Union:  # Optional[X]
        if value is None:
            return None
        (inner,) = [a for a in typing.get_args(tp) if a is not type(None)]
        return _coerce(key, value, inner)
    if origin is list:
        (inner,) = typing.get_args(tp)
        if isinstance(value, str) and inner is str:
            value = [value]  # train.report_to=none on a command line
        if not isinstance(value, list):
            _fail(key, value, f"expected a list of {_type_name(inner)}")
        return [_coerce(f"{key}[{i}]", item, inner) for i, item in enumerate(value)]
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str):
        try:
            return float(value)  # YAML 1.1 reads "2e-5" as a string
        except ValueError:
            pass
    if not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
        _fail(key, value, f"expected {_type_name(tp)}, got {type(value).__name__}")
    return value


def _build(cls: type, data: Any, prefix: str) -> Any:
    if not isinstance(data, dict):
        _fail(prefix.rstrip("."), data, f"expected a mapping with keys {', '.join(f.name for f in dataclasses.fields(cls))}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for key in data:
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f" (did you mean {prefix}{close[0]}?)" if close else ""
            raise ValueError(f"unknown recipe key {prefix}{key}{hint}; allowed in {prefix.rstrip('.') or 'the recipe'}: {', '.join(names)}")
    values = {}
    for name in names:
        if name not in data:
            continue
        tp = hints[name]
        key = prefix + name
        if dataclasses.is_dataclass(tp):
            values[name] = _build(tp, data[name], key + ".")
        else:
            values[name] = _coerce(key, data[name], tp)
    return cls(**values)


def _validate(recipe: Recipe) -> None:
    flat = _flatten(recipe.to_dict())
    for key, allowed in CHOICES.items():
        if flat[key] not in allowed:
            _fail(key, flat[key], f"allowed: {', '.join(str(a) for a in allowed)}")
    for key in POSITIVE:
        if flat[key] < 1:
            _fail(key, flat[key], "must be >= 1")
    if recipe.train.max_steps == 0 or recipe.train.max_steps < -1:
        _fail("train.max_steps", recipe.train.max_steps, "must be >= 1, or -1 to run train.num_epochs")
    if recipe.train.lr <= 0:
        _fail("train.lr", recipe.train.lr, "must be > 0")
    for key in ("warmup_steps", "weight_decay"):
        if getattr(recipe.train, key) < 0:
            _fail(f"train.{key}", getattr(recipe.train, key), "must be >= 0")
    if recipe.train.max_grad_norm <= 0:
        _fail("train.max_grad_norm", recipe.train.max_grad_norm, "must be > 0 (gradients are clipped to this norm)")
    if len(recipe.train.betas) != 2 or not all(0 <= b < 1 for b in recipe.train.betas):
        _fail("train.betas", recipe.train.betas, "two numbers in [0, 1)")
    if not 0 <= recipe.lora.dropout < 1:
        _fail("lora.dropout", recipe.lora.dropout, "must be in [0, 1)")
    if not recipe.lora.target_modules:
        _fail("lora.target_modules", recipe.lora.target_modules, "at least one module name, e.g. [q_proj, k_proj, v_proj, o_proj]")
    if recipe.data.min_tokens < 0:
        _fail("data.min_tokens", recipe.data.min_tokens, "must be >= 0")
    if recipe.data.max_documents is not None and recipe.data.max_documents < 1:
        _fail("data.max_documents", recipe.data.max_documents, "must be >= 1, or null for all")
    if recipe.data.seq_len is not None and not 2 <= recipe.data.seq_len <= recipe.model.target_length:
        _fail("data.seq_len", recipe.data.seq_len,
              f"must be in [2, model.target_length={recipe.model.target_length}], or null (= model.target_length)")
    for reporter in recipe.train.report_to:
        if reporter not in REPORTERS:
            _fail("train.report_to", recipe.train.report_to, f"entries allowed: {', '.join(REPORTERS)}")
    if recipe.model.tiny and recipe.model.name_or_path != "tiny":
        _fail("model.tiny", recipe.model.tiny, "only applies with model.name_or_path=tiny")
    import attn_patterns

    try:
        attn_patterns.get(recipe.attention.pattern, **recipe.attention.params)
    except (TypeError, ValueError) as err:
        raise ValueError(f"recipe key attention.pattern / attention.params: {err}") from None
    if recipe.deepspeed is not None:
        _check_deepspeed(recipe, _read_deepspeed(recipe.deepspeed))


def _flatten(data: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in data.items():
        if isinstance(value, dict) and key not in ("params", "tiny"):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def find_recipe(name_or_path: str) -> Path:
    """``recipes/**/NAME.yaml``, or a path to a YAML file."""
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") or path.exists():
        if not path.is_file():
            raise FileNotFoundError(f"recipe file {name_or_path} does not exist")
        return path
    found = sorted(p for d in RECIPE_DIRS for p in d.rglob(f"{name_or_path}.yaml"))
    if not found:
        known = recipe_names()
        close = difflib.get_close_matches(name_or_path, known, n=3)
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise ValueError(f"recipe={name_or_path!r} not found under recipes/{hint}; known: {', '.join(known)}")
    if len(found) > 1:
        raise ValueError(f"recipe={name_or_path!r} is ambiguous: {', '.join(map(str, found))}; pass a path")
    return found[0]


def recipe_names() -> list[str]:
    return sorted({p.stem for d in RECIPE_DIRS for p in d.rglob("*.yaml")})


def _merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _layer(base: dict, over: dict) -> dict:
    """``over`` deep-merged onto ``base``. One pattern's parameters mean nothing to another, so
    a layer that changes ``attention.pattern`` starts from that pattern's defaults: it keeps
    only the ``attention.params`` it gives itself."""
    base_att, over_att = base.get("attention"), over.get("attention")
    if isinstance(base_att, dict) and isinstance(over_att, dict) and over_att.get("pattern", base_att.get("pattern")) != base_att.get("pattern"):
        base = {**base, "attention": {k: v for k, v in base_att.items() if k != "params"}}
    return _merge(base, over)


def _read(path: Path, seen: tuple = ()) -> dict:
    if path.resolve() in seen:
        raise ValueError(f"recipe inherit cycle: {' -> '.join(map(str, seen + (path.resolve(),)))}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ValueError(f"recipe {path} is not valid YAML: {err}") from None
    if not isinstance(data, dict):
        raise ValueError(f"recipe {path} must be a YAML mapping of sections (model, attention, lora, data, train, deepspeed)")
    parent = data.pop("inherit", None)
    if parent:
        data = _layer(_read(find_recipe(parent), seen + (path.resolve(),)), data)
    return data


def parse_overrides(overrides: list[str]) -> dict:
    """``["train.lr=1e-4", "deepspeed=null"]`` -> nested dict; values are YAML scalars/lists."""
    out: dict = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"override {item!r} must look like dotted.key=value")
        try:
            value = yaml.safe_load(raw) if raw else ""
        except yaml.YAMLError:
            value = raw  # e.g. an unbalanced bracket: keep the text, validation names the key
        node = out
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ValueError(f"override {item!r} conflicts with an earlier override of {part}")
        node[parts[-1]] = value
    return out


def load_recipe(name_or_path: str, overrides: list[str] = ()) -> Recipe:
    """The recipe ``name_or_path`` (name under recipes/ or a YAML path) with its ``inherit``
    chain and ``dotted.key=value`` overrides applied, typed and validated."""
    path = find_recipe(name_or_path)
    data = _layer(_read(path), parse_overrides(list(overrides)))
    recipe = _build(Recipe, data, "")
    recipe.name = recipe.name or path.stem
    _validate(recipe)
    if recipe.attention.backend == "auto":
        recipe.attention.backend = _auto_backend(recipe.model.dtype)
    return recipe


def _auto_backend(dtype: str) -> str:
    """flash-attn where it can run (installed, CUDA, half precision), SDPA elsewhere. Resolved
    when the recipe loads on the machine that trains, so the saved recipe names what ran."""
    from attn_patterns.kernels import flash_available

    return "flash" if dtype != "float32" and flash_available() else "sdpa"


def format_recipe(recipe: Recipe) -> str:
    return yaml.safe_dump(recipe.to_dict(), sort_keys=False)


def save_resolved(recipe: Recipe, output_dir: str | os.PathLike) -> Path:
    """The exact configuration a run used, next to its outputs; ``recipe=<that file>`` reruns it."""
    path = Path(output_dir) / "recipe.resolved.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(format_recipe(recipe))
    os.replace(tmp, path)
    return path


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


def _read_deepspeed(name_or_path: str) -> dict:
    path = deepspeed_config_path(name_or_path)
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"recipe key deepspeed={name_or_path!r}: {path} is not valid JSON: {err}") from None


def _is_auto(value: Any) -> bool:
    return isinstance(value, str) and value.startswith("auto")


def _ds_precision(config: dict) -> str:
    if config.get("fp16", {}).get("enabled"):
        return "float16"
    return "bfloat16" if config.get("bf16", {}).get("enabled") else "float32"


# DeepSpeed keys the recipe owns: a config may leave them "auto" or repeat the recipe's value.
_DS_OWNED = {
    "train_micro_batch_size_per_gpu": lambda t: t.per_device_batch_size,
    "gradient_accumulation_steps": lambda t: t.gradient_accumulation_steps,
    "gradient_clipping": lambda t: t.max_grad_norm,
}


def _check_deepspeed(recipe: Recipe, config: dict) -> None:
    """Refuse a DeepSpeed config that would train differently from the recipe. (LongLoRA's
    ZeRO-3 config carried its own optimizer and schedule, which the HF Trainer silently used
    instead of the command line's.)"""
    where = f"deepspeed config {recipe.deepspeed}"
    for key in ("optimizer", "scheduler"):
        if key in config and not _is_auto(config[key]):
            raise ValueError(
                f"{where} sets {key!r}: the {key} is the recipe's (AdamW with train.lr, train.weight_decay, train.betas; "
                f"train.scheduler with train.warmup_steps); remove it or write \"auto\""
            )
    for key, owned in _DS_OWNED.items():
        if key in config and not _is_auto(config[key]) and config[key] != owned(recipe.train):
            raise ValueError(f"{where} sets {key}={config[key]!r} but the recipe says {owned(recipe.train)!r}; write \"auto\" there")
    precision = _ds_precision(config)
    if precision != recipe.model.dtype:
        _fail("model.dtype", recipe.model.dtype,
              f"{where} trains in {precision}; use a matching config or model.dtype={precision}")


def resolve_deepspeed_config(recipe: Recipe, world_size: int, on_cuda: Optional[bool] = None) -> dict:
    """The recipe's DeepSpeed config with every "auto" filled from the recipe, so the optimizer
    (AdamW with the recipe's lr), batch sizes and clipping are the recipe's. The schedule is
    built by the trainer from ``train.scheduler``, never by the config. ``on_cuda`` (default:
    whether CUDA is available) picks DeepSpeed's fused Adam or torch's AdamW."""
    if recipe.deepspeed is None:
        raise ValueError("recipe key deepspeed=None: this recipe trains without DeepSpeed")
    if on_cuda is None:
        import torch

        on_cuda = torch.cuda.is_available()
    config = _read_deepspeed(recipe.deepspeed)
    _check_deepspeed(recipe, config)
    t = recipe.train
    global_batch = t.per_device_batch_size * t.gradient_accumulation_steps * world_size
    if "train_batch_size" in config and not _is_auto(config["train_batch_size"]) and config["train_batch_size"] != global_batch:
        raise ValueError(
            f"deepspeed config {recipe.deepspeed} sets train_batch_size={config['train_batch_size']} but per_device_batch_size "
            f"{t.per_device_batch_size} × gradient_accumulation_steps {t.gradient_accumulation_steps} × {world_size} processes "
            f"= {global_batch}; write \"auto\" there"
        )
    config.pop("scheduler", None)
    for key, owned in _DS_OWNED.items():
        config[key] = owned(t)
    config["train_batch_size"] = global_batch
    offload = "offload_optimizer" in config.get("zero_optimization", {})
    config["optimizer"] = {
        "type": "AdamW",
        "params": {"lr": t.lr, "weight_decay": t.weight_decay, "betas": list(t.betas), "eps": 1e-8,
                   # FusedAdam needs CUDA and offload needs DeepSpeedCPUAdam; torch's AdamW runs anywhere else
                   "torch_adam": not on_cuda and not offload},
    }
    config.setdefault("steps_per_print", 10**9)
    return config
