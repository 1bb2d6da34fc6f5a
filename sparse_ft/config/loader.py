"""Recipes from YAML: found by name under ``recipes/`` (or given as a path), layered through
their ``inherit`` chain and the command line's ``dotted.key=value`` overrides, typed against
the schema and validated; and written back, resolved, beside a run's outputs.

Paths a recipe reads (``PATH_KEYS``) mean the same from any working directory: a relative one
in a recipe file resolves against that file's directory (a shipped recipe's against
``REPO_ROOT``, so ``data/tiny/train.jsonl`` is the repository's or the package's), one typed
on the command line against the current directory. The loaded recipe holds them absolute, so
its saved copy reruns from anywhere. What a run writes (``train.output_dir``,
``data.cache_dir``) stays relative to the current directory."""

from __future__ import annotations

import copy
import dataclasses
import difflib
import glob
import os
import typing
from pathlib import Path
from typing import Any

import yaml

from sparse_ft.files.keyvalue import parse_assignments
from sparse_ft.config.paths import RECIPE_DIRS, REPO_ROOT
from sparse_ft.config.bad_input import BadInput, fail
from sparse_ft.config.schema import Recipe, validate
from sparse_ft.files.strict import yaml_value
from sparse_ft.modeling.tiny import BUILT_IN, display_name
from sparse_ft.files.outputs import atomic_file

RESOLVED_RECIPE = "recipe.resolved.yaml"  # beside a run's outputs (save_resolved)
# keys that may name a local path, with the suffixes that make a value a file even before it exists
PATH_KEYS = {
    ("model", "name_or_path"): (),
    ("data", "source"): (".jsonl", ".json", ".parquet", ".txt"),  # what sparse_ft.data.sources reads
    ("deepspeed",): (".json",),
    ("validation", "data"): (".jsonl", ".json", ".parquet", ".txt", ".bin"),  # what eval ppl --data reads
}


def find_recipe(name_or_path: str) -> Path:
    """``recipes/**/NAME.yaml``, or a path to a YAML file."""
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") or path.exists():
        if path.is_dir():
            raise ValueError(f"recipe file {name_or_path} is a directory; name a .yaml file")
        if not path.is_file():
            raise FileNotFoundError(f"recipe file {name_or_path} does not exist")
        return path
    found = [] if path.is_absolute() else sorted(p for d in RECIPE_DIRS for p in d.rglob(f"{name_or_path}.yaml"))
    if not found and (len(path.parts) > 1 or path.is_absolute()):  # a path, not a name under recipes/
        with_suffix = [str(p) for p in (path.with_name(path.name + ".yaml"), path.with_name(path.name + ".yml")) if p.is_file()]
        hint = f" (did you mean {with_suffix[0]}?)" if with_suffix else ""
        raise FileNotFoundError(f"recipe={name_or_path}: no such recipe file; a path names the file with its .yaml suffix{hint}")
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
    if (isinstance(base_att, dict) and isinstance(over_att, dict)
            and over_att.get("pattern", base_att.get("pattern")) != base_att.get("pattern")):
        base = {**base, "attention": {k: v for k, v in base_att.items() if k != "params"}}
    return _merge(base, over)


def _anchor(value: Any, base: Path, suffixes: tuple[str, ...]) -> Any:
    """``value`` made absolute against ``base`` when it names a local path: ``~``, ``./`` or
    ``../``, a file name ending in one of ``suffixes``, or something that exists there.
    Anything else (an HF id, ``hf://`` files, a DeepSpeed config's name, ``tiny``) is a name
    and stays as it is."""
    if not isinstance(value, str) or not value or value == BUILT_IN or "://" in value:
        return value
    path = Path(value).expanduser()
    if path.is_absolute():
        return str(path)
    if (value.startswith(("./", "../")) or path.suffix in suffixes or (base / path).exists()
            or glob.glob(str(base / path))):
        return os.path.normpath(base / path)
    return value


def _anchor_paths(data: dict, base: Path) -> dict:
    """``data`` (one recipe layer) with the local paths of ``PATH_KEYS`` resolved against
    ``base``."""
    out = copy.deepcopy(data)
    for (*sections, key), suffixes in PATH_KEYS.items():
        node = out
        for section in sections:
            node = node.get(section) if isinstance(node, dict) else None
        if isinstance(node, dict) and key in node:
            node[key] = _anchor(node[key], base, suffixes)
    return out


def _base_dir(path: Path) -> Path:
    """What a recipe file's relative paths mean: its own directory, or for a shipped recipe the
    root that holds ``recipes/``, ``data/`` and ``assets/``."""
    path = path.resolve()
    return REPO_ROOT if any(d.resolve() in path.parents for d in RECIPE_DIRS) else path.parent


def _read(path: Path, seen: tuple = ()) -> dict:
    if path.resolve() in seen:
        raise ValueError(f"recipe inherit cycle: {' -> '.join(map(str, seen + (path.resolve(),)))}")
    try:
        data = yaml_value(path.read_text(encoding="utf-8"), f"recipe {path}") or {}
    except UnicodeDecodeError as err:
        raise ValueError(f"recipe {path} is not UTF-8 text (byte {err.start})") from None
    except OSError as err:
        raise ValueError(f"recipe {path} cannot be read ({err.strerror or err})") from None
    except yaml.YAMLError as err:
        raise ValueError(f"recipe {path} is not valid YAML: {_yaml_problem(err)}") from None
    if not isinstance(data, dict):
        raise ValueError(f"recipe {path} must be a YAML mapping of sections (model, attention, lora, data, train, validation, deepspeed)")
    parent = data.pop("inherit", None)
    if parent is not None and (not isinstance(parent, str) or not parent):
        raise ValueError(f"recipe {path}: inherit={parent!r} must name one recipe (a name under recipes/ or a .yaml path)")
    data = _anchor_paths(data, _base_dir(path))
    if parent:
        if Path(parent).suffix in (".yaml", ".yml"):  # a path, beside this recipe; else a name
            parent = str(path.resolve().parent / Path(parent).expanduser())
        data = _layer(_read(find_recipe(parent), seen + (path.resolve(),)), data)
    return data


def _yaml_problem(err: "yaml.YAMLError") -> str:
    """PyYAML's multi-line message as one line: the problem and where (line, column)."""
    mark = getattr(err, "problem_mark", None)
    problem = getattr(err, "problem", None) or " ".join(str(err).split())
    return f"{problem} at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else problem


def parse_overrides(overrides: list[str]) -> dict:
    """``["train.lr=1e-4", "deepspeed=null"]`` -> nested dict; values are YAML scalars/lists."""
    out: dict = {}
    for item, (key, value) in zip(overrides, parse_assignments(overrides, "override", "dotted.key=value")):
        node = out
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ValueError(f"override {item!r} conflicts with an earlier override of {part}")
        node[parts[-1]] = value
    return out


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp)).replace("typing.", "")


def _coerce(key: str, value: Any, tp: Any) -> Any:
    origin = typing.get_origin(tp)
    if origin is typing.Union:  # Optional[X], or one of several types (attention.dense_layers: a list or a string)
        if value is None and type(None) in typing.get_args(tp):
            return None
        options = [a for a in typing.get_args(tp) if a is not type(None)]
        for option in options[:-1]:
            try:
                return _coerce(key, value, option)
            except BadInput:
                pass
        try:
            return _coerce(key, value, options[-1])
        except BadInput:
            if len(options) == 1:
                raise
            fail(key, value, f"expected {' or '.join(map(_type_name, options))}, got {type(value).__name__}")
    if origin is list:
        (inner,) = typing.get_args(tp)
        if isinstance(value, str) and inner is str:
            value = [value]  # train.report_to=none on a command line
        if not isinstance(value, list):
            fail(key, value, f"expected a list of {_type_name(inner)}")
        return [_coerce(f"{key}[{i}]", item, inner) for i, item in enumerate(value)]
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str):
        try:
            return float(value)  # YAML 1.1 reads "2e-5" as a string
        except ValueError:
            pass
    if not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
        fail(key, value, f"expected {_type_name(tp)}, got {type(value).__name__}")
    return value


def _build(cls: type, data: Any, prefix: str) -> Any:
    if not isinstance(data, dict):
        fail(prefix.rstrip("."), data, f"expected a mapping with keys {', '.join(f.name for f in dataclasses.fields(cls))}")
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


def load_recipe(name_or_path: str, overrides: list[str] = ()) -> Recipe:
    """The recipe ``name_or_path`` (name under recipes/ or a YAML path) with its ``inherit``
    chain and ``dotted.key=value`` overrides applied, typed and validated; local paths
    absolute (the overrides' against the current directory)."""
    path = find_recipe(name_or_path)
    data = _layer(_read(path), _anchor_paths(parse_overrides(list(overrides)), Path.cwd()))
    recipe = _build(Recipe, data, "")
    recipe.name = recipe.name or path.stem
    validate(recipe)
    return recipe


def format_recipe(recipe: Recipe) -> str:
    return yaml.safe_dump(recipe.to_dict(), sort_keys=False)


def summarize_recipe(recipe: Recipe, steps: int, samples: int, *, adapters: bool = True) -> str:
    """A run's recipe in five lines, what a run prints (the whole of it is in
    ``recipe.resolved.yaml``): the model and its length, the pattern, LoRA (or, ``adapters``
    False, every weight: pretraining, whose recipe keeps the lora section's defaults unused), the
    data and the steps, where it writes."""
    m, a, lora, d, t = recipe.model, recipe.attention, recipe.lora, recipe.data, recipe.train
    params = f" {yaml.safe_dump(a.params, default_flow_style=True).strip()}" if a.params else ""
    trained = f" + {', '.join(lora.extra_trainable)} in full" if lora.extra_trainable else ""
    return "\n".join([
        f"recipe {recipe.name}: {display_name(m.name_or_path)} ({m.dtype}) extended to {m.target_length} tokens, "
        f"RoPE {m.rope_method}",
        f"  attention {a.pattern}{params}, backend {a.backend or 'sdpa'}{_dense(recipe, steps)}; "
        + (f"LoRA r={lora.r} alpha={lora.alpha} on {', '.join(lora.target_modules)}{trained}" if adapters
           else "every weight trained, no adapters"),
        f"  data {d.source}: {samples} samples of {recipe.seq_len} tokens "
        f"({d.packing if d.format == 'text' else d.format + ' rows whole, padding_free, loss on the answers'})",
        f"  {steps} steps of {t.per_device_batch_size} x {t.gradient_accumulation_steps} samples per process, "
        f"lr {t.lr:g} {t.scheduler}, DeepSpeed {recipe.deepspeed or 'off'}",
        f"  output {t.output_dir} (the whole recipe: {RESOLVED_RECIPE}; -v prints it)",
    ])


def _dense(recipe: Recipe, steps: int) -> str:
    """Where the run attends fully, for its summary: ``attention.dense_layers`` and the dense
    tail's steps (``train.dense_final_fraction``)."""
    from sparse_ft.methods import dense_tail_start

    layers, fraction = recipe.attention.dense_layers, recipe.train.dense_final_fraction
    said = f", full attention in layers {layers if isinstance(layers, str) else list(layers)}" if layers else ""
    if fraction:
        start = dense_tail_start(fraction, steps)
        said += f", full attention in every layer from step {start + 1} of {steps} (train.dense_final_fraction={fraction:g})"
    return said


def save_resolved(recipe: Recipe, output_dir: str | os.PathLike) -> Path:
    """The exact configuration a run used, next to its outputs; ``recipe=<that file>`` reruns it."""
    path = Path(output_dir) / RESOLVED_RECIPE
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(path) as f:
        f.write(format_recipe(recipe))
    return path
