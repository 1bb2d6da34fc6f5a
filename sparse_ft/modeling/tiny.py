"""Tiny Llama-architecture models built from a config, with a byte-level tokenizer that
needs no download: for tests, the ``tiny`` recipe and CPU demos. Eight heads with two
key/value heads so every pattern and grouped-query attention apply."""

from __future__ import annotations

import difflib
from typing import Any

from sparse_ft.modeling.families import TINY_SHAPE

# The name that means the built-in tiny model wherever a model is named (a recipe's
# model.name_or_path, --model): a name, never a path.
BUILT_IN = "tiny"


def is_built_in(name: str) -> bool:
    return name == BUILT_IN


# ByT5's byte vocabulary: 3 specials (pad 0, eos 1, unk 2) + 256 bytes + 125 extra ids.
TINY_VOCAB = 384


def tiny_tokenizer():
    """Byte-level tokenizer shipped inside transformers: works offline, any text."""
    from transformers import ByT5Tokenizer

    return ByT5Tokenizer()


# The tiny model's LlamaConfig values; ``model.tiny`` / ``tiny_llama(**overrides)`` change them.
TINY_CONFIG: dict[str, Any] = dict(
    **TINY_SHAPE,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    bos_token_id=None,
    eos_token_id=1,
    pad_token_id=0,
)


def _config_keys() -> list[str]:
    """The override names LlamaConfig takes: its constructor's parameters (transformers 5 lists
    PretrainedConfig's there too) and the tiny defaults' own. LlamaConfig would store any
    other name as an attribute that nothing reads, so a misspelt override would change nothing."""
    import inspect

    from transformers import LlamaConfig

    params = inspect.signature(LlamaConfig.__init__).parameters.values()
    named = {p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)} - {"self"}
    return sorted(named | set(TINY_CONFIG))


def tiny_llama_config(**overrides: Any):
    """The tiny LlamaConfig with ``overrides``; unknown names and a vocabulary smaller than the
    byte tokenizer's (token ids past the embedding) are refused."""
    from transformers import LlamaConfig

    allowed = _config_keys()
    unknown = sorted(set(overrides) - set(allowed))
    if unknown:
        close = difflib.get_close_matches(unknown[0], allowed, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise ValueError(f"unknown LlamaConfig parameter(s) {', '.join(unknown)}{hint}; allowed: {', '.join(allowed)}")
    params = {**TINY_CONFIG, **overrides}
    if not isinstance(params["vocab_size"], int) or params["vocab_size"] < TINY_VOCAB:
        raise ValueError(f"vocab_size={params['vocab_size']!r} must be >= {TINY_VOCAB}, the byte tokenizer's ids")
    return LlamaConfig(**params)


def tiny_llama(seed: int = 0, **overrides: Any):
    """A randomly initialised tiny Llama, identical for identical ``seed`` and overrides."""
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_llama_config(**overrides))
    return model.eval()
