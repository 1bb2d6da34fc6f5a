"""The model families sparse-ft is checked on, and the one place that reads a model's attention
geometry from its config.

Running a model needs nothing from here: every method goes into any transformers causal LM
whose attention layers call ``AttentionInterface`` and whose positions are RoPE, and
``sparse_ft.modeling.attention`` checks exactly that when a method is installed. A family is listed so
that the tests run every pattern and algorithm inside a tiny model of it: against the dense
reference, with padding, and with future tokens changed. That is where a family's quirks
show, such as Mistral's sliding window, Qwen2's ``use_sliding_window`` switch, or a separate
``head_dim``. docs/architecture.md says how to add one.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

# The shape every tiny test model shares: 8 heads over 2 K/V heads, so every pattern and
# grouped-query attention apply; the vocabulary holds the byte tokenizer's ids (sparse_ft.modeling.tiny).
TINY_SHAPE: dict[str, Any] = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=256)


@dataclasses.dataclass(frozen=True)
class Family:
    """``name`` is transformers' ``model_type``; the classes are named, not imported, so that
    listing a family costs nothing. ``settings`` is what its tiny model needs beyond the
    shared shape (8 heads over 2 KV heads, so every pattern applies), such as switching off a
    sliding window the patterns would refuse."""

    name: str
    config_class: str
    model_class: str
    settings: dict[str, Any] = dataclasses.field(default_factory=dict)

    def tiny_config(self, **overrides: Any) -> Any:
        import transformers

        return getattr(transformers, self.config_class)(**{**TINY_SHAPE, **self.settings, **overrides})

    def tiny_model(self, seed: int = 0, **overrides: Any) -> Any:
        """A randomly initialised tiny model in eval mode, identical for identical arguments."""
        import torch
        import transformers

        torch.manual_seed(seed)
        return getattr(transformers, self.model_class)(self.tiny_config(**overrides)).eval()


FAMILIES: dict[str, Family] = {}


def add_family(family: Family) -> Family:
    """List ``family``; a name already listed is refused, not replaced."""
    if family.name in FAMILIES:
        raise ValueError(f"model family {family.name!r} is already listed ({FAMILIES[family.name]}); refusing to replace it")
    FAMILIES[family.name] = family
    return family


def remove_family(name: str) -> None:
    """Take a family out again (a test that adds one)."""
    FAMILIES.pop(name, None)


for _family in (
    Family("llama", "LlamaConfig", "LlamaForCausalLM"),
    Family("mistral", "MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
    Family("qwen2", "Qwen2Config", "Qwen2ForCausalLM", {"use_sliding_window": False}),
):
    add_family(_family)


class Geometry(NamedTuple):
    heads: int
    kv_heads: int
    head_dim: int


def geometry(config: Any) -> Geometry:
    """Query heads, key/value heads and head width as the attention layers use them: a config
    without ``num_key_value_heads`` has one K/V head per query head, one without ``head_dim``
    splits ``hidden_size`` evenly (Gemma and Qwen3 set it apart from the hidden size)."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return Geometry(heads, kv_heads, head_dim)
