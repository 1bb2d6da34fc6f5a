"""Models for evaluation: an HF id or directory, the built-in ``tiny``, an adapter from
train.py (its RoPE configuration restored first), and 4-/8-bit quantisation."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
TINY_DIR = Path(".cache/sparse-ft/tiny-model")


def quantization(load_in_4bit: bool, load_in_8bit: bool, compute_dtype: str) -> Optional[Any]:
    """bitsandbytes NF4 with double quantisation (the SCCA paper's 4-bit evaluation), or 8-bit."""
    if load_in_4bit and load_in_8bit:
        raise ValueError("--load-in-4bit and --load-in-8bit exclude each other")
    if not (load_in_4bit or load_in_8bit):
        return None
    from transformers import BitsAndBytesConfig

    if load_in_8bit:
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=DTYPES[compute_dtype])


def resolve_model(model: str) -> str:
    if model != "tiny":
        return model
    from sparse_ft.train.model_setup import materialize_tiny

    return str(materialize_tiny(TINY_DIR, seed=0))


def load(model: str, adapter: Optional[str] = None, dtype: str = "float32", load_in_4bit: bool = False,
         load_in_8bit: bool = False, compute_dtype: str = "float32", trust_remote_code: bool = False, device: Optional[str] = None):
    """Returns ``(model, tokenizer)`` in eval mode."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from sparse_ft.train.adapter import base_config_for, load_adapter_model
    from sparse_ft.train.model_setup import load_tokenizer

    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r} is unknown; allowed: {', '.join(DTYPES)}")
    path = resolve_model(model)
    if not Path(path).exists() and (path.startswith((".", "/")) or path.count("/") > 1):
        raise FileNotFoundError(f"--model {model}: no such directory")
    kwargs: dict[str, Any] = {"dtype": DTYPES[dtype], "trust_remote_code": trust_remote_code}
    quant = quantization(load_in_4bit, load_in_8bit, compute_dtype)
    if quant is not None:
        kwargs["quantization_config"] = quant
    if device is not None and quant is None:
        kwargs["device_map"] = device
    if adapter is not None:
        base_config_for(adapter, path, trust_remote_code)  # fails early on a foreign base
        loaded = load_adapter_model(adapter, path, **kwargs)
    else:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
        loaded = AutoModelForCausalLM.from_pretrained(path, config=config, **kwargs)
    tokenizer_dir = adapter if adapter and (Path(adapter) / "tokenizer_config.json").exists() else path
    return loaded.eval(), load_tokenizer(tokenizer_dir, trust_remote_code)
