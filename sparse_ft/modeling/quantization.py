"""bitsandbytes 4-/8-bit loading that works on every model shape.

bitsandbytes' kernels do not take every layer width on every device: 0.50's CPU path repacks
NF4 weights in blocks of 32 output rows for AVX512-BF16 inference and asserts on any other
width, at the first forward, after the whole model has loaded. So before a model loads, each
distinct linear shape it has is quantised and run once on the target device, and the layers of
a shape that fails stay in the model's dtype: a slightly larger model instead of a traceback.
Probing instead of checking versions follows a bitsandbytes that lifts or adds such a limit
with no edit here. The layers kept go into transformers' own skip list, beside its defaults
(the output head, tied weights), so the saved config says what was left unquantised.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any, Optional

import torch
from torch import nn


def bnb_config(bits: int, compute_dtype: torch.dtype, skip: Optional[list[str]] = None) -> Any:
    """NF4 with double quantisation (the SCCA paper's 4-bit evaluation), or LLM.int8."""
    from transformers import BitsAndBytesConfig

    if bits == 8:
        return BitsAndBytesConfig(load_in_8bit=True, llm_int8_skip_modules=skip)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=compute_dtype, llm_int8_skip_modules=skip)


def float_storage_refused() -> Optional[str]:
    """Why the installed transformers and bitsandbytes cannot keep 4-bit weights in a float
    storage dtype (``bnb_4bit_quant_storage``), or None where they can. ZeRO-3 partitions
    parameters of one float dtype: stored as ``model.dtype``, the packed 4-bit weights are
    partitioned and gathered like any other weight, their quantisation state kept aside."""
    import importlib.util
    import inspect

    if importlib.util.find_spec("bitsandbytes") is None:
        return "bitsandbytes is not installed (pip install bitsandbytes)"
    import bitsandbytes
    import transformers
    from transformers import BitsAndBytesConfig

    if "bnb_4bit_quant_storage" not in inspect.signature(BitsAndBytesConfig).parameters:
        return f"transformers {transformers.__version__} has no bnb_4bit_quant_storage (needs >= 4.39)"
    if "quant_storage" not in inspect.signature(bitsandbytes.nn.Params4bit.__new__).parameters:
        return f"bitsandbytes {bitsandbytes.__version__} has no 4-bit quant_storage (needs >= 0.43)"
    return None


def plan(config: Any, bits: int, device: str, dtype: torch.dtype, *, compute_dtype: torch.dtype,
         trust_remote_code: bool = False) -> tuple[Any, dict[str, str]]:
    """The ``BitsAndBytesConfig`` for ``config``'s model on ``device``, and the linear layers
    the installed bitsandbytes cannot quantise there (name -> bitsandbytes' error)."""
    _quiet_bitsandbytes()
    layers, defaults = _linear_layers(config, trust_remote_code)
    failed: dict[tuple[int, int, bool], str] = {}
    for shape in sorted(set(layers.values())):
        error = _probe(bits, *shape, device=device, dtype=dtype, compute_dtype=compute_dtype)
        if error is not None:
            failed[shape] = error
    refused = {name: failed[shape] for name, shape in layers.items() if shape in failed}
    return bnb_config(bits, compute_dtype, sorted(set(defaults) | set(refused))), refused


def describe(refused: dict[str, str], bits: int, device: str, dtype: torch.dtype, *, asked_by: Optional[str] = None) -> str:
    """One line naming the layers left unquantised, layer indices folded: ``layers.*.mlp.up_proj (x4)``;
    ``asked_by``: what asked for the quantisation (default: the eval flag)."""
    import bitsandbytes

    counts = Counter(re.sub(r"\.\d+\.", ".*.", name) for name in refused)
    names = ", ".join(f"{name} (x{n})" if n > 1 else name for name, n in sorted(counts.items()))
    reasons = "; ".join(sorted(set(refused.values())))
    return (f"warning: {asked_by or f'--load-in-{bits}bit'}: bitsandbytes {bitsandbytes.__version__} cannot quantise "
            f"{len(refused)} linear layer(s) on {device} ({reasons}); they stay in {str(dtype).removeprefix('torch.')}: {names}")


def unquantised_layers(model: nn.Module) -> Optional[list[str]]:
    """The layers a bitsandbytes-loaded model keeps in its dtype (None when not quantised)."""
    config = getattr(getattr(model, "config", None), "quantization_config", None)
    if config is None:
        return None
    skip = config.get("llm_int8_skip_modules") if isinstance(config, dict) else getattr(config, "llm_int8_skip_modules", None)
    return sorted(skip or [])


def _linear_layers(config: Any, trust_remote_code: bool) -> tuple[dict[str, tuple[int, int, bool]], list[str]]:
    """Every ``nn.Linear`` the quantiser would convert, as name -> (in, out, bias), and its
    default skips, read off the model built on the meta device (no memory, no weights)."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    try:  # transformers 5.x, then 4.x
        from transformers.quantizers.base import get_keys_to_not_convert
    except ImportError:
        from transformers.integrations.bitsandbytes import get_keys_to_not_convert
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    defaults = list(get_keys_to_not_convert(model))
    skipped = re.compile(rf"(?:{'|'.join(map(re.escape, defaults))})(?:\.|$)") if defaults else None
    layers = {name: (m.in_features, m.out_features, m.bias is not None) for name, m in model.named_modules()
              if isinstance(m, nn.Linear) and not (skipped and skipped.match(name))}
    return layers, defaults


def _probe(bits: int, in_features: int, out_features: int, bias: bool, *, device: str, dtype: torch.dtype,
           compute_dtype: torch.dtype) -> Optional[str]:
    """None when bitsandbytes quantises a layer of this shape on ``device`` and runs an
    inference forward through it (where its CPU repacking happens), else its error's first line."""
    import bitsandbytes as bnb

    with torch.device("cpu"):
        if bits == 8:
            layer = bnb.nn.Linear8bitLt(in_features, out_features, bias, has_fp16_weights=False)
        else:
            layer = bnb.nn.Linear4bit(in_features, out_features, bias, compute_dtype=compute_dtype,
                                      compress_statistics=True, quant_type="nf4")
    try:
        layer = layer.to(device).eval()
        with torch.no_grad():
            layer(torch.zeros(2, in_features, dtype=dtype, device=device))
    except Exception as err:  # noqa: BLE001 - any refusal of bitsandbytes means: keep this shape unquantised
        text = str(err).strip()
        return text.splitlines()[0] if text else type(err).__name__
    return None


def _quiet_bitsandbytes() -> None:
    """Before bitsandbytes first loads its backends: its lines that ask nothing of a user
    (``sparse_ft.console``'s list) stay out of a library call too, unless the verbosity is -v."""
    from sparse_ft import console

    if console.verbosity() < console.VERBOSE:
        console.quiet_library_warnings()
