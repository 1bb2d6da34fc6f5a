"""The dtypes a model loads, trains and is measured in, named once. Recipes (``model.dtype``),
``sparse-ft eval``, ``merge`` and ``pretrain`` use torch's names (``bfloat16``); the benchmarks'
``--dtype`` and DeepSpeed's config sections the short ones (``bf16``). Every list of either
is read from this table, so a dtype added here is accepted everywhere at once. It imports no
torch: the command-line parsers list the names without loading it."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# torch's name -> the short name, in the order help texts and errors list them
DTYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}
NAMES = tuple(DTYPES)
SHORT_NAMES = {short: name for name, short in DTYPES.items()}


def torch_dtype(name: str) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16``."""
    import torch

    return getattr(torch, name)
