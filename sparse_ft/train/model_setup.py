"""The model a recipe trains: base weights, position interpolation composed with the model's
own RoPE scaling, LoRA+ adapters, and the training attention pattern."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, Optional

import torch

from sparse_ft import rope
from sparse_ft.attention import use_attention
from sparse_ft.config import Recipe

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_KEEP_ALIVE: list = []  # transformers reads the ZeRO-3 config through a weak global reference


def materialize_tiny(directory: Path, seed: int, **overrides: Any) -> Path:
    """The built-in tiny model, written once as an ordinary local checkpoint so that adapters
    name a base that exists and every later step loads it like any other model."""
    from sparse_ft.tiny import tiny_llama, tiny_tokenizer

    if (directory / "config.json").exists():
        return directory
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = directory.with_name(directory.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tiny_llama(seed=seed, **overrides).save_pretrained(tmp)
    tiny_tokenizer().save_pretrained(tmp)
    os.replace(tmp, directory)
    return directory


def base_model_path(recipe: Recipe) -> str:
    if recipe.model.name_or_path == "tiny":
        return str(Path(recipe.train.output_dir) / "base-model")
    return recipe.model.name_or_path


def load_tokenizer(path: str, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def extended_config(path: str, target_length: int, method: str, trust_remote_code: bool = False):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    rope.extend_to(config, target_length, method)
    config.use_cache = False
    return config


def build_model(recipe: Recipe, path: str, ds_config: Optional[dict] = None):
    """Base model with position interpolation, LoRA+ and the training pattern."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    config = extended_config(path, recipe.model.target_length, recipe.model.rope_method, recipe.model.trust_remote_code)
    if ds_config is not None and ds_config.get("zero_optimization", {}).get("stage") == 3:
        from transformers.integrations import HfDeepSpeedConfig

        _KEEP_ALIVE.append(HfDeepSpeedConfig(ds_config))  # weights load partitioned (zero.Init)
    model = AutoModelForCausalLM.from_pretrained(
        path, config=config, dtype=DTYPES[recipe.model.dtype], trust_remote_code=recipe.model.trust_remote_code
    )
    params: dict[str, Any] = dict(recipe.attention.params)
    if recipe.attention.backend is not None:
        params["backend"] = recipe.attention.backend
    use_attention(model, recipe.attention.pattern, **params)
    if recipe.train.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    lora = LoraConfig(
        r=recipe.lora.r,
        lora_alpha=recipe.lora.alpha,
        lora_dropout=recipe.lora.dropout,
        target_modules=list(recipe.lora.target_modules),
        modules_to_save=list(recipe.lora.extra_trainable) or None,
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, lora)
