"""Tiny Llama-architecture models built from a config, with a byte-level tokenizer that
needs no download: for tests, the ``tiny`` recipe and CPU demos. Eight heads with two
key/value heads so every pattern and grouped-query attention apply."""

from __future__ import annotations

import difflib
from typing import Any, Optional

from sparse_ft.modeling.families import TINY_SHAPE

# The name that means the built-in tiny model wherever a model is named (a recipe's
# model.name_or_path, --model): a name, never a path.
BUILT_IN = "tiny"


def is_built_in(name: str) -> bool:
    return name == BUILT_IN


# How tables, titles and run summaries name the built-in model: it is built from a config
# with random weights (``eval ppl --model tiny`` scores PPL ~385), unlike ``assets/tiny-base``,
# the pretrained tiny model the experiment extends, so a result of it must say so.
RANDOM_LABEL = f"{BUILT_IN} (random weights)"


def display_name(name: str) -> str:
    """``name`` as results show it: the built-in model as :data:`RANDOM_LABEL`, any other whole."""
    return RANDOM_LABEL if is_built_in(name) else name


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


def parameter_count(config: Any) -> int:
    """A Llama config's parameters by arithmetic (embeddings, the output head unless tied,
    attention and MLP projections, norms), so that a size is judged without building anything."""
    from sparse_ft.modeling.families import geometry

    g = geometry(config)
    h, q, kv = config.hidden_size, g.heads * g.head_dim, g.kv_heads * g.head_dim
    layer = h * q + 2 * h * kv + q * h + 3 * h * config.intermediate_size + 2 * h
    tied = bool(getattr(config, "tie_word_embeddings", False))
    return config.vocab_size * h * (1 if tied else 2) + config.num_hidden_layers * layer + h


def machine_memory() -> int:
    """This machine's physical memory in bytes."""
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def tiny_size_rule(config: Any) -> Optional[str]:
    """Why a tiny model of ``config`` cannot be built here, None if it can: it is created in
    float32 on the CPU (4 bytes a parameter) before anything else, so its parameters must fit
    the machine's memory. Arithmetic on the config: ``hidden_size: 1000000`` is refused before
    a run claims its directory, not by the allocator after."""
    need, have = 4 * parameter_count(config), machine_memory()
    if need <= have:
        return None
    return (f"its {parameter_count(config):,} parameters take {need / 2**30:,.1f} GiB in float32, more than this "
            f"machine's {have / 2**30:,.1f} GiB of memory")


def tiny_llama(seed: int = 0, **overrides: Any):
    """A randomly initialised tiny Llama, identical for identical ``seed`` and overrides."""
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_llama_config(**overrides))
    return model.eval()
