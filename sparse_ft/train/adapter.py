"""The trained result: one standard PEFT adapter directory (LoRA + the trainable embeddings and
norms), plus ``sparse_ft.json`` carrying the RoPE configuration it was trained with, so every
later load uses the same positions.

Under ZeRO-3 each rank holds a slice of every parameter; saving without gathering writes
empty tensors (a known failure of other trainers). The trainable parameters are gathered
first, and nothing else: the frozen base never leaves its partitions.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Optional

import torch

from sparse_ft import rope

META_FILE = "sparse_ft.json"
SHAPE_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")


def save_adapter(engine, directory: Path, recipe, base_path: str, tokenizer=None) -> Optional[Path]:
    """Collective under DeepSpeed; rank 0 writes. Atomic: a temporary directory renamed."""
    model = engine.module
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    with engine.gathered([p for _, p in named]):
        # peft picks the adapter's tensors out of this (model-named) state dict
        state = {n: p.detach().cpu().clone() for n, p in named} if engine.rank == 0 else None
    if engine.rank != 0:
        return None
    empty = [k for k, v in state.items() if v.numel() == 0]
    if empty:
        raise RuntimeError(f"refusing to save an adapter with empty tensors: {empty[:3]}")
    tmp = directory.with_name(directory.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(str(tmp), state_dict=state, safe_serialization=True)
    config = model.get_base_model().config
    meta = {
        "base_model": base_path,
        "rope_parameters": rope.rope_parameters(config),
        "max_position_embeddings": config.max_position_embeddings,
        "original_context": rope.original_context(config),
        "target_length": recipe.model.target_length,
        "rope_method": recipe.model.rope_method,
        "train_attention": {"pattern": recipe.attention.pattern, **recipe.attention.params},
        "base_shape": {k: getattr(config, k, None) for k in SHAPE_KEYS},
        "recipe": recipe.name,
    }
    (tmp / META_FILE).write_text(json.dumps(meta, indent=1))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(tmp))
    shutil.rmtree(directory, ignore_errors=True)
    os.replace(tmp, directory)
    return directory


def read_meta(adapter_dir: str | os.PathLike) -> dict:
    path = Path(adapter_dir)
    if not (path / "adapter_config.json").is_file():
        raise FileNotFoundError(f"adapter {adapter_dir}: no adapter_config.json (not a PEFT adapter directory)")
    meta_path = path / META_FILE
    return json.loads(meta_path.read_text()) if meta_path.is_file() else {}


def base_config_for(adapter_dir: str | os.PathLike, base: Optional[str] = None, trust_remote_code: bool = False):
    """The base model's config with the adapter's RoPE configuration put back, checked
    against the base the adapter was trained on."""
    from transformers import AutoConfig

    meta = read_meta(adapter_dir)
    if base is None:
        base = meta.get("base_model") or json.loads((Path(adapter_dir) / "adapter_config.json").read_text())["base_model_name_or_path"]
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
