"""Model I/O shared by training, evaluation, merging and pretraining: dtype names, tokenizers,
the built-in tiny model as an ordinary checkpoint, and adapters loaded with the RoPE
configuration they were trained with. Nothing here trains, so evaluation and ``merge`` can
load what ``train.py`` wrote without importing the trainer.

An adapter directory is a standard PEFT adapter plus ``sparse_ft.json`` (``META_FILE``): the
RoPE configuration it was trained with and the shape of its base, written by
``sparse_ft.train.adapter.save_adapter`` and read back here.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Optional

import torch

from sparse_ft.modeling import rope
from sparse_ft.modeling.dtypes import NAMES, torch_dtype
from sparse_ft.files.outputs import atomic_directory
from sparse_ft.modeling.tiny import is_built_in

DTYPES = {name: torch_dtype(name) for name in NAMES}  # recipe / CLI name -> torch dtype
META_FILE = "sparse_ft.json"
# the base's dimensions an adapter records: loading it onto another base fails by name, not by shape
SHAPE_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")


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


def read_meta(adapter_dir: str | os.PathLike) -> dict:
    """The adapter's ``sparse_ft.json`` (empty for a PEFT adapter trained elsewhere)."""
    path = Path(adapter_dir)
    if not (path / "adapter_config.json").is_file():
        raise FileNotFoundError(f"adapter {adapter_dir}: no adapter_config.json (not a PEFT adapter directory)")
    meta_path = path / META_FILE
    return json.loads(meta_path.read_text()) if meta_path.is_file() else {}


def adapter_base(adapter_dir: str | os.PathLike, meta: dict) -> str:
    """The base the adapter records: an absolute path or an HF id. An older adapter may record
    a path relative to where it was trained; that is looked for from the adapter's own parent
    directories, so ``merge`` and ``eval`` find it from anywhere rather than asking the hub."""
    recorded = meta.get("base_model") or json.loads((Path(adapter_dir) / "adapter_config.json").read_text())["base_model_name_or_path"]
    if Path(recorded).is_absolute() or Path(recorded).exists():
        return recorded
    found = [root / recorded for root in Path(adapter_dir).resolve().parents if (root / recorded / "config.json").is_file()]
    return str(found[0]) if found else recorded


def base_config_for(adapter_dir: str | os.PathLike, base: Optional[str] = None, trust_remote_code: bool = False):
    """The base model's config with the adapter's RoPE configuration put back, checked
    against the base the adapter was trained on."""
    from transformers import AutoConfig

    meta = read_meta(adapter_dir)
    base = base or adapter_base(adapter_dir, meta)
    config = AutoConfig.from_pretrained(base, trust_remote_code=trust_remote_code)
    for key, want in meta.get("base_shape", {}).items():
        have = getattr(config, key, None)
        if want is not None and have != want:
            raise ValueError(
                f"adapter {adapter_dir} was trained on a base with {key}={want}, but {base} has {key}={have}: "
                "it belongs to another base model"
            )
    if "rope_parameters" in meta:
        rope.restore(config, meta["rope_parameters"], meta["max_position_embeddings"])
    return base, config


def load_adapter_model(adapter_dir: str | os.PathLike, base: Optional[str] = None, dtype: Any = torch.float32,
                       trust_remote_code: bool = False, **load_kwargs: Any):
    """Base + adapter, positions as trained. ``load_kwargs`` go to ``from_pretrained``
    (e.g. ``quantization_config``)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base, config = base_config_for(adapter_dir, base, trust_remote_code)
    model = AutoModelForCausalLM.from_pretrained(base, config=config, dtype=dtype, trust_remote_code=trust_remote_code, **load_kwargs)
    return PeftModel.from_pretrained(model, str(adapter_dir))
