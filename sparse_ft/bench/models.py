"""The model shapes the throughput benchmarks build from a config, with random weights: the
speed of a step depends on the shapes only, so no download is needed and the numbers are
reproducible anywhere."""

from __future__ import annotations

from typing import Any, Optional

import torch

from sparse_ft.modeling.tiny import tiny_llama_config

# ``tiny``: small enough for a CPU. ``1b``: the 1B-scale Llama (TinyLlama's widths with
# 16 layers: 0.85B parameters), where attention's share of a step is what it is in practice.
# ``8b``: Llama-3.1-8B's shapes (sparse_ft/plan/geometry.py), where the MLP's share is larger.
MODELS: dict[str, dict[str, Any]] = {
    "tiny": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
                 num_key_value_heads=2),
    "1b": dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
               num_attention_heads=32, num_key_value_heads=8),
    "8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=8),
}


def describe(name: str) -> str:
    m = MODELS[name]
    return (f"{name}: Llama, {m['num_hidden_layers']} layers x {m['hidden_size']}, {m['num_attention_heads']} heads, "
            f"{m['num_key_value_heads']} KV heads, MLP {m['intermediate_size']}")


def config(name: str, max_length: int, *, layers: Optional[int] = None):
    """``layers`` cuts the model to that many layers (same widths): a step's peak past the
    stored layer inputs is one layer's, so a cut model measures it in a fraction of the time."""
    if name not in MODELS:
        raise ValueError(f"--model {name!r} is unknown; allowed: {', '.join(MODELS)}")
    shapes = dict(MODELS[name], **({} if layers is None else {"num_hidden_layers": layers}))
    return tiny_llama_config(max_position_embeddings=max_length, use_cache=False, **shapes)


def build(name: str, max_length: int, device: torch.device, dtype: torch.dtype, *, seed: int = 0,
          layers: Optional[int] = None):
    """Weights initialised directly on ``device`` in ``dtype``: a 1B model built on the CPU in
    fp32 first would cost more time than the measurement."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config(name, max_length, layers=layers), dtype=dtype)


def vocab_size(name: str) -> int:
    return config(name, 1).vocab_size
