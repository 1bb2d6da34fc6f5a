"""Tiny Llama-architecture models built from a config, with a byte-level tokenizer that
needs no download: for tests, the ``tiny`` recipe and CPU demos. Eight heads with two
key/value heads so every pattern and grouped-query attention apply."""

from __future__ import annotations

from typing import Any

# ByT5's byte vocabulary: 3 specials (pad 0, eos 1, unk 2) + 256 bytes + 125 extra ids.
TINY_VOCAB = 384


def tiny_tokenizer():
    """Byte-level tokenizer shipped inside transformers: works offline, any text."""
    from transformers import ByT5Tokenizer

    return ByT5Tokenizer()


def tiny_llama_config(**overrides: Any):
    from transformers import LlamaConfig

    params: dict[str, Any] = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=1,
        pad_token_id=0,
    )
    params.update(overrides)
    return LlamaConfig(**params)


def tiny_llama(seed: int = 0, **overrides: Any):
    """A randomly initialised tiny Llama, identical for identical ``seed`` and overrides."""
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_llama_config(**overrides))
    return model.eval()
