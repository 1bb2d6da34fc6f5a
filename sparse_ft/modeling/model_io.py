"""Model I/O shared by training, evaluation, merging and pretraining: dtype names, tokenizers,
the built-in tiny model as an ordinary checkpoint, and adapters loaded with the RoPE
configuration they were trained with. Nothing here trains, so evaluation and ``merge`` can
load what ``train.py`` wrote without importing the trainer.

An adapter directory is a standard PEFT adapter plus ``sparse_ft.json`` (``META_FILE``): the
RoPE configuration it was trained with, the shape of its base and the fingerprint of its base's
weights, written by ``sparse_ft.train.adapter.save_adapter`` and read back here. An adapter is
loaded onto other weights than its base's only when the caller says so (``allow_other_base``):
a base of the same shape would load without a word and give another model's numbers.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

import torch

from sparse_ft.modeling import rope
from sparse_ft.files.json_files import json_object
from sparse_ft.files.outputs import atomic_directory
from sparse_ft.modeling.tiny import is_built_in
from sparse_ft.modeling.weight_files import fingerprint, model_files, refuse_pickle, tensor_names

META_FILE = "sparse_ft.json"
# the base's dimensions an adapter records: loading it onto another base fails by name, not by shape
SHAPE_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# the types of what sparse_ft.json holds and the loaders read: a hand-edited file fails by key
META_TYPES = {"base_model": str, "base_model_given": str, "base_fingerprint": str, "rope_parameters": dict,
              "max_position_embeddings": int, "base_shape": dict}


def load_tokenizer(path: str, trust_remote_code: bool = False):
    """The tokenizer at ``path``, with a pad token (the EOS where it has none) for batching."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def materialize_tiny(directory: Path, seed: int, **overrides: Any) -> Path:
    """The built-in tiny model, written once as an ordinary local checkpoint so that adapters
    name a base that exists and every later step loads it like any other model."""
    from sparse_ft.modeling.tiny import tiny_llama, tiny_tokenizer

    if (directory / "config.json").exists():
        return directory
    with atomic_directory(directory) as tmp:
        tiny_llama(seed=seed, **overrides).save_pretrained(tmp)
        tiny_tokenizer().save_pretrained(tmp)
    return directory


_TINY: dict[str, Path] = {}


def resolve_model(model: str) -> str:
    """``tiny`` becomes the built-in tiny Llama (seed 0) written to a per-process temporary
    directory, so it loads (and quantises) like any checkpoint and never goes stale."""
    if not is_built_in(model):
        return model
    if "dir" not in _TINY:
        root = Path(tempfile.mkdtemp(prefix="sparse-ft-tiny-"))
        atexit.register(shutil.rmtree, root, ignore_errors=True)
        _TINY["dir"] = materialize_tiny(root / "model", seed=0)
    return str(_TINY["dir"])


def is_repo_id(name: str) -> bool:
    """Whether ``name`` is shaped like a Hub model id (``meta-llama/Llama-2-7b-hf``)."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def check_model_path(name: str, flag: str) -> None:
    """A model named by ``flag`` is a local directory with ``config.json`` and whole safetensors
    weights (none pickled), or shaped like a Hub id; ``ValueError`` / ``FileNotFoundError`` in
    one line if not."""
    path = Path(name).expanduser()
    if (path / "adapter_config.json").is_file():
        raise ValueError(f"{flag} {name} is an adapter directory (adapter_config.json), not a model: pass it as --adapter")
    if not path.exists():
        if not is_repo_id(name) or name.startswith((".", "/", "~")):
            raise FileNotFoundError(f"{flag} {name}: no such directory (a Hub model is named like meta-llama/Llama-2-7b-hf)")
        return
    if not path.is_dir():
        raise ValueError(f"{flag} {name} is a file; a model is a directory with config.json (or a Hub id)")
    if not (path / "config.json").is_file():
        raise ValueError(f"{flag} {name}: a local model is a directory with config.json; this has none")
    model_files(path, f"{flag} {name}")


def read_meta(adapter_dir: str | os.PathLike, flag: str = "adapter") -> dict:
    """The adapter's ``sparse_ft.json`` (empty for a PEFT adapter trained elsewhere), once the
    directory is checked to hold a PEFT adapter that can be loaded: its config a JSON object
    naming a ``peft_type``, its weights whole safetensors (pickled ones refused), the
    metadata's values of the types the loaders read. Each failure is one line naming ``flag``."""
    path = Path(adapter_dir)
    what = f"{flag} {adapter_dir}"
    if not (path / "adapter_config.json").is_file():
        raise FileNotFoundError(f"{what}: no adapter_config.json (not a PEFT adapter directory)")
    if not isinstance(json_object(path / "adapter_config.json", what).get("peft_type"), str):
        raise ValueError(f"{what}: adapter_config.json names no peft_type (not a PEFT adapter's config)")
    refuse_pickle(path, what)
    if not (path / ADAPTER_WEIGHTS).is_file():
        raise FileNotFoundError(f"{what}: no {ADAPTER_WEIGHTS} (the adapter's weights)")
    tensor_names(path / ADAPTER_WEIGHTS, what)
    meta = json_object(path / META_FILE, what) if (path / META_FILE).is_file() else {}
    for key, kind in META_TYPES.items():
        if meta.get(key) is not None and not isinstance(meta[key], kind):
            raise ValueError(f"{what}: {META_FILE} key {key}={meta[key]!r} is not a {kind.__name__}")
    if "rope_parameters" in meta and "max_position_embeddings" not in meta:
        raise ValueError(f"{what}: {META_FILE} has rope_parameters but no max_position_embeddings")
    return meta


def adapter_base(adapter_dir: str | os.PathLike, meta: dict) -> str:
    """The base the adapter records: an absolute path or an HF id. An older adapter may record
    a path relative to where it was trained; that is looked for from the adapter's own parent
    directories, so ``merge`` and ``eval`` find it from anywhere rather than asking the hub."""
    recorded = meta.get("base_model") or json.loads((Path(adapter_dir) / "adapter_config.json").read_text()).get("base_model_name_or_path")
    if not isinstance(recorded, str) or not recorded:
        raise ValueError(f"adapter {adapter_dir} records no base model (sparse_ft.json base_model, adapter_config.json "
                         "base_model_name_or_path): name it with --model / --base")
    if Path(recorded).is_absolute() or Path(recorded).exists():
        return recorded
    found = [root / recorded for root in Path(adapter_dir).resolve().parents if (root / recorded / "config.json").is_file()]
    return str(found[0]) if found else recorded


def check_base(adapter_dir: str | os.PathLike, meta: dict, base: str, *, allow_other: bool = False) -> None:
    """The weights of ``base`` are the ones the adapter was trained on, judged by the
    fingerprint of the weights it recorded (not by shapes: a base of the same shape loads
    without a word). Another base is refused unless ``allow_other``; an adapter written before
    fingerprints were recorded, or a base whose files cannot be read here, gets one warning."""
    recorded = meta.get("base_fingerprint")
    if recorded is None:
        _warn(f"adapter {adapter_dir} records no fingerprint of its base's weights (written by an older sparse-ft): "
              f"cannot check that {base} is the base it was trained on")
        return
    found = fingerprint(resolve_model(base))
    if found is None or found.split(":")[0] != recorded.split(":")[0]:
        _warn(f"cannot compare the weights of {base} with the base adapter {adapter_dir} was trained on "
              f"({'its safetensors files are not here' if found is None else 'fingerprints of another version'})")
        return
    if found == recorded:
        return
    trained_on = meta.get("base_model") or "its base"
    problem = (f"adapter {adapter_dir} was trained on other weights than those of {base} (on {trained_on}: weights "
               f"fingerprint {_short(recorded)}; {base}: {_short(found)})")
    if not allow_other:
        raise ValueError(f"{problem}: an adapter fits only the weights it was trained on; use that base (the default "
                         "when none is named), or pass --allow-other-base to use this one anyway")
    _warn(f"{problem}; used anyway, as --allow-other-base asks")


def _short(fingerprint_value: str) -> str:
    return fingerprint_value.split(":")[-1][:12]


def _warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)


def base_config_for(adapter_dir: str | os.PathLike, base: Optional[str] = None, trust_remote_code: bool = False, *,
                    allow_other_base: bool = False):
    """The base model (``tiny`` resolved) and its config with the adapter's RoPE configuration
    put back, checked against the base the adapter was trained on: its shape, then its weights."""
    from transformers import AutoConfig

    meta = read_meta(adapter_dir)
    named = base or adapter_base(adapter_dir, meta)
    base = resolve_model(named)
    try:
        config = AutoConfig.from_pretrained(base, trust_remote_code=trust_remote_code)
    except OSError as err:  # a Hub id that cannot be reached, a directory without a config
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise ValueError(f"the base model {base} of adapter {adapter_dir}: its config cannot be read ({first})") from None
    for key, want in meta.get("base_shape", {}).items():
        have = getattr(config, key, None)
        if want is not None and have != want:
            raise ValueError(
                f"adapter {adapter_dir} was trained on a base with {key}={want}, but {base} has {key}={have}: "
                "it belongs to another base model"
            )
    check_base(adapter_dir, meta, named, allow_other=allow_other_base)
    if "rope_parameters" in meta:
        rope.restore(config, meta["rope_parameters"], meta["max_position_embeddings"])
    return base, config


def adapter_base_config(config_class: Any, meta: dict):
    """What ``config.json`` beside an adapter holds: its base's config (read with
    ``config_class``, the class the run loaded, so a model's own code needs no new consent) with
    the adapter's RoPE configuration put back, in the keys transformers takes
    (``rope.portable``). ``AutoConfig.from_pretrained(adapter_dir)`` then gives the positions
    :func:`load_adapter_model` loads with, to a user without sparse-ft."""
    config = config_class.from_pretrained(meta["base_model"])
    rope.restore(config, rope.portable(meta["rope_parameters"]), meta["max_position_embeddings"])
    return config


def load_adapter_model(adapter_dir: str | os.PathLike, base: Optional[str] = None, dtype: Any = torch.float32,
                       trust_remote_code: bool = False, *, allow_other_base: bool = False, config: Any = None,
                       **load_kwargs: Any):
    """Base + adapter, positions as trained. ``config``: the one :func:`base_config_for` gave
    for ``base``, when the caller has checked it already. ``load_kwargs`` go to
    ``from_pretrained`` (e.g. ``quantization_config``)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    if config is None:
        base, config = base_config_for(adapter_dir, base, trust_remote_code, allow_other_base=allow_other_base)
    model = AutoModelForCausalLM.from_pretrained(base, config=config, dtype=dtype, trust_remote_code=trust_remote_code, **load_kwargs)
    return PeftModel.from_pretrained(model, str(adapter_dir))
