"""Models for evaluation: an HF id or directory, the built-in ``tiny``, an adapter from
train.py (its RoPE configuration restored before the weights load), and 4-/8-bit
quantisation through transformers' ``BitsAndBytesConfig``, in which the layers bitsandbytes
cannot quantise on the device stay in the model's dtype, named on stderr (sparse_ft.modeling.quantization)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from sparse_ft.modeling import dtypes, quantization
from sparse_ft.modeling.devices import check_device, default_device
from sparse_ft.modeling.dtypes import torch_dtype
from sparse_ft.modeling.model_io import (adapter_base, base_config_for, check_model_path, load_adapter_model,
                                         load_tokenizer, read_meta, resolve_model)


def check_quantization(load_in_4bit: bool, load_in_8bit: bool, compute_dtype: str) -> Optional[int]:
    """The bits asked for (4, 8 or None), the flags checked before anything loads."""
    if load_in_4bit and load_in_8bit:
        raise ValueError("--load-in-4bit and --load-in-8bit exclude each other")
    if compute_dtype not in dtypes.NAMES:
        raise ValueError(f"--bnb-compute-dtype {compute_dtype!r} is unknown; allowed: {', '.join(dtypes.NAMES)}")
    return 4 if load_in_4bit else 8 if load_in_8bit else None


def recorded_base(adapter: Optional[str]) -> str:
    """The base an adapter was trained on: what ``--model`` defaults to with ``--adapter``."""
    if adapter is None:
        raise ValueError("--model is required without --adapter (with one, its recorded base is the default)")
    if not Path(adapter).is_dir():
        raise FileNotFoundError(f"--adapter {adapter}: no such directory")
    return adapter_base(adapter, read_meta(adapter, "--adapter"))


def load(model: Optional[str], adapter: Optional[str] = None, dtype: str = "float32", load_in_4bit: bool = False,
         *, load_in_8bit: bool = False, compute_dtype: str = "float32", trust_remote_code: bool = False,
         device: Optional[str] = None, tokenizer: bool = True, allow_other_base: bool = False,
         check_config: Optional[Callable[[Any], None]] = None):
    """Returns ``(model, tokenizer)`` in eval mode; with ``tokenizer=False`` the tokenizer is
    None (token files need none, and a model directory may hold none). ``model`` None is the
    adapter's recorded base; another base than the adapter's is refused unless
    ``allow_other_base``. The tokenizer loads first: a missing one fails in a second, not after
    the weights; ``check_config`` (a method's ``check_model``) sees the config the weights will
    load with, before they do. Every failure is a one-line ValueError or FileNotFoundError
    naming the flag."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if dtype not in dtypes.NAMES:
        raise ValueError(f"--dtype {dtype!r} is unknown; allowed: {', '.join(dtypes.NAMES)}")
    if model is None:
        model = recorded_base(adapter)  # the adapter checked (without one, --model is required)
    path = resolve_model(model)
    check_model_path(path, "--model")
    bits = check_quantization(load_in_4bit, load_in_8bit, compute_dtype)
    tok = tokenizer_for(model, adapter, trust_remote_code) if tokenizer else None
    device = check_device(device or default_device())
    kwargs: dict[str, Any] = {"dtype": torch_dtype(dtype), "trust_remote_code": trust_remote_code, "device_map": device}
    try:
        if adapter is not None:  # the adapter's RoPE goes into the config before the weights load
            path, config = base_config_for(adapter, model, trust_remote_code, allow_other_base=allow_other_base)
        else:
            config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
        if check_config is not None:
            check_config(config)
        if bits is not None:  # layer shapes do not depend on an adapter's RoPE
            kwargs["quantization_config"] = _quantization(config, bits, device, torch_dtype(dtype),
                                                          compute_dtype=torch_dtype(compute_dtype),
                                                          trust_remote_code=trust_remote_code)
        if adapter is not None:
            loaded = load_adapter_model(adapter, path, config=config, **kwargs)
        else:
            loaded = AutoModelForCausalLM.from_pretrained(path, config=config, **kwargs)
    except OSError as err:  # hub / missing-file errors from transformers and peft
        raise ValueError(f"cannot load --model {model}{f' --adapter {adapter}' if adapter else ''}: {_first_line(err)}") from None
    except RuntimeError as err:
        if "size mismatch" not in str(err):
            raise
        detail = next(line.strip() for line in str(err).splitlines() if "size mismatch" in line)
        raise ValueError(f"--adapter {adapter} does not fit --model {model} (trained on another base?): {detail}") from None
    return loaded.eval(), tok


def _quantization(config: Any, bits: int, device: str, dtype: torch.dtype, *, compute_dtype: torch.dtype,
                  trust_remote_code: bool) -> Any:
    """The probe runs where the weights will go: ``auto`` places them on the GPU when there is one."""
    device = default_device() if device == "auto" else device
    plan, refused = quantization.plan(config, bits, device, dtype, compute_dtype=compute_dtype,
                                      trust_remote_code=trust_remote_code)
    if refused:
        print(quantization.describe(refused, bits, device, dtype), file=sys.stderr, flush=True)
    return plan


def tokenizer_for(model: str, adapter: Optional[str] = None, trust_remote_code: bool = False):
    """The adapter's tokenizer where it saved one, else the model's: loaded before the
    weights, so that text data can be read (and found wanting) before they load."""
    path = resolve_model(model)
    check_model_path(path, "--model")
    where = adapter if adapter and (Path(adapter) / "tokenizer_config.json").exists() else path
    try:
        return load_tokenizer(where, trust_remote_code)
    except (OSError, ValueError) as err:  # no tokenizer files: transformers says so at length
        raise ValueError(f"cannot load a tokenizer from {where} (--model {model}): {_first_line(err)}; "
                         "passkey and text --data need one, a .bin token file does not") from None


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
