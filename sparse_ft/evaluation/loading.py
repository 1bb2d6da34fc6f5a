"""Models for evaluation: an HF id or directory, the built-in ``tiny``, an adapter from
train.py (its RoPE configuration restored before the weights load), and 4-/8-bit
quantisation through transformers' ``BitsAndBytesConfig``, in which the layers bitsandbytes
cannot quantise on the device stay in the model's dtype, named on stderr (sparse_ft.modeling.quantization)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from sparse_ft.modeling import quantization
from sparse_ft.modeling.model_io import DTYPES, load_adapter_model, load_tokenizer, resolve_model


def check_quantization(load_in_4bit: bool, load_in_8bit: bool, compute_dtype: str) -> Optional[int]:
    """The bits asked for (4, 8 or None), the flags checked before anything loads."""
    if load_in_4bit and load_in_8bit:
        raise ValueError("--load-in-4bit and --load-in-8bit exclude each other")
    if compute_dtype not in DTYPES:
        raise ValueError(f"--bnb-compute-dtype {compute_dtype!r} is unknown; allowed: {', '.join(DTYPES)}")
    return 4 if load_in_4bit else 8 if load_in_8bit else None


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def load(model: str, adapter: Optional[str] = None, dtype: str = "float32", load_in_4bit: bool = False,
         *, load_in_8bit: bool = False, compute_dtype: str = "float32", trust_remote_code: bool = False,
         device: Optional[str] = None, tokenizer: bool = True,
         before_weights: Optional[Callable[[Any], None]] = None):
    """Returns ``(model, tokenizer)`` in eval mode; with ``tokenizer=False`` the tokenizer is
    None (token files need none, and a model directory may hold none). The tokenizer loads
    first: a missing one fails in a second, not after the weights, and so does
    ``before_weights(tokenizer)`` (a task building its prompts). Every failure is a one-line
    ValueError or FileNotFoundError naming the flag."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r} is unknown; allowed: {', '.join(DTYPES)}")
    path = resolve_model(model)
    if not Path(path).exists() and (path.startswith((".", "/", "~")) or path.count("/") > 1):
        raise FileNotFoundError(f"--model {model}: no such directory")
    if adapter is not None and not Path(adapter).is_dir():
        raise FileNotFoundError(f"--adapter {adapter}: no such directory")
    bits = check_quantization(load_in_4bit, load_in_8bit, compute_dtype)
    tok = _tokenizer(model, adapter, path, trust_remote_code) if tokenizer else None
    device = _check_device(device or default_device())
    if before_weights is not None:
        before_weights(tok)
    kwargs: dict[str, Any] = {"dtype": DTYPES[dtype], "trust_remote_code": trust_remote_code, "device_map": device}
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
        if bits is not None:  # layer shapes do not depend on an adapter's RoPE: the base's config serves
            kwargs["quantization_config"] = _quantization(config, bits, device, DTYPES[dtype],
                                                          compute_dtype=DTYPES[compute_dtype],
                                                          trust_remote_code=trust_remote_code)
        if adapter is not None:
            # the adapter's RoPE goes into the config before the weights load; a foreign base fails by shape
            loaded = load_adapter_model(adapter, path, **kwargs)
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


def _check_device(device: str) -> str:
    """A device that does not exist here fails in one line, before the weights load (and before
    the 4-bit probe, where it would read as every layer refused)."""
    if device == "auto":
        return device
    try:
        parsed = torch.device(device)
    except RuntimeError as err:
        raise ValueError(f"--device {device!r} is not a device ({_first_line(err)}); e.g. cpu, cuda, cuda:0, auto") from None
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device!r}: torch sees no CUDA device here; use cpu (or omit --device)")
    return device


def _tokenizer(model: str, adapter: Optional[str], path: str, trust_remote_code: bool):
    """The adapter's tokenizer where it saved one, else the model's."""
    where = adapter if adapter and (Path(adapter) / "tokenizer_config.json").exists() else path
    try:
        return load_tokenizer(where, trust_remote_code)
    except (OSError, ValueError) as err:  # no tokenizer files: transformers says so at length
        raise ValueError(f"cannot load a tokenizer from {where} (--model {model}): {_first_line(err)}; "
                         "passkey and text --data need one, a .bin token file does not") from None


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
