"""Plug attention patterns into any transformers causal LM through its AttentionInterface.

No model class is patched: one attention function named ``sparse_ft`` is registered with
transformers, the model is switched to it with its own ``set_attn_implementation``, and each
attention layer carries the pattern it uses (so two models in one process can differ). The
mask interface hands the function the 2-D padding mask instead of an N×N one.

Methods that need more than q, k, v (positions, the KV cache: Dual Chunk Attention,
LongHeads) implement ``attend_hf(module, query, key, value, attention_mask, **kwargs)`` on
their pattern object; the function hands the call over unchanged.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

import attn_patterns
from attn_patterns import Pattern

IMPLEMENTATION = "sparse_ft"
_PATTERN_ATTR = "_sparse_ft_pattern"
_ORIGINAL_ATTR = "_sparse_ft_original_attn"


def _check_right_padding(mask: torch.Tensor, pattern: Pattern) -> None:
    """Right padding needs nothing: padding keys sit after every real query, so causality hides
    them. Left or inner padding would let chunk boundaries fall on padding: refuse it."""
    if mask.dtype != torch.bool:
        mask = mask > 0
    if bool((mask[:, 1:] & ~mask[:, :-1]).any()):
        raise ValueError(
            f"pattern {pattern!r} supports right padding only (a real token follows a padding token "
            "in attention_mask); set tokenizer.padding_side='right'"
        )


def sparse_ft_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    scaling: Optional[float] = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: q (B,H,Nq,D), k/v (B,Hkv,Nk,D) -> (B,Nq,H,D)."""
    pattern = getattr(module, _PATTERN_ATTR, None)
    if pattern is None:
        raise ValueError(
            f"{type(module).__name__} runs attn_implementation={IMPLEMENTATION!r} but has no pattern; "
            "switch models with sparse_ft.use_attention(model, name)"
        )
    if hasattr(pattern, "attend_hf"):
        return pattern.attend_hf(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    if dropout:
        raise ValueError(f"attention dropout={dropout} is not supported by pattern {pattern!r}; set attention_dropout=0")
    if query.shape[2] != key.shape[2]:
        raise ValueError(
            f"pattern {pattern!r} is a training pattern: it defines attention over a whole sequence, "
            "not for decoding with a KV cache; generate with sparse_ft.use_attention(model, 'full')"
        )
    window = kwargs.get("sliding_window")
    if window is not None and window < key.shape[2]:
        raise ValueError(f"sliding_window={window} is shorter than the sequence ({key.shape[2]}); sparse patterns assume global causal attention")
    if attention_mask is not None:
        _check_right_padding(attention_mask, pattern)
    d = query.shape[-1]
    if scaling is not None and not math.isclose(scaling, 1.0 / math.sqrt(d), rel_tol=1e-6):
        query = query * (scaling * math.sqrt(d))  # patterns use 1/sqrt(D)
    out = pattern(query, key, value)
    return out.transpose(1, 2).contiguous(), None


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(IMPLEMENTATION, sparse_ft_attention)
    try:
        from transformers import AttentionMaskInterface
        from transformers.masking_utils import flash_attention_mask
    except ImportError:  # older transformers: it builds its own mask, which we validate the same way
        return
    AttentionMaskInterface.register(IMPLEMENTATION, flash_attention_mask)


def _pretrained(model: torch.nn.Module):
    """The transformers PreTrainedModel inside a possible PEFT / DeepSpeed wrapper."""
    from transformers import PreTrainedModel

    for module in model.modules():
        if isinstance(module, PreTrainedModel):
            return module
    raise ValueError(f"{type(model).__name__} contains no transformers PreTrainedModel")


def attention_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Self-attention modules: the ones transformers calls the attention interface from."""
    layers = [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "head_dim") and hasattr(m, "config")]
    if not layers:
        raise ValueError(f"{type(model).__name__} has no attention layers that use transformers' AttentionInterface")
    return layers


def use_attention(model: torch.nn.Module, name: "str | Pattern", **params: Any) -> torch.nn.Module:
    """Switch every attention layer of ``model`` to pattern ``name`` (``"full"``: back to the
    model's own implementation). Returns the model."""
    base = _pretrained(model)
    if not any(hasattr(m, "inv_freq") for m in base.modules()):
        raise ValueError(f"{type(base).__name__} has no rotary embedding: sparse-ft patterns are for RoPE models")
    layers = attention_layers(base)
    current = base.config._attn_implementation
    if name == "full" and not params:
        original = getattr(base, _ORIGINAL_ATTR, None)
        for layer in layers:
            if hasattr(layer, _PATTERN_ATTR):
                delattr(layer, _PATTERN_ATTR)
        if original is not None:
            _set_implementation(base, original)
            delattr(base, _ORIGINAL_ATTR)
        return model
    pattern = name if isinstance(name, Pattern) else attn_patterns.get(name, **params)
    pattern.check_heads(base.config.num_attention_heads)  # fail now, not mid-forward
    _register()
    if current != IMPLEMENTATION:
        setattr(base, _ORIGINAL_ATTR, current)
        _set_implementation(base, IMPLEMENTATION)
    for layer in layers:
        setattr(layer, _PATTERN_ATTR, pattern)
    return model


def _set_implementation(model, implementation: str) -> None:
    setter = getattr(model, "set_attn_implementation", None)
    if setter is not None:
        setter(implementation)
    else:  # transformers 4.4x
        model.config._attn_implementation = implementation


def current_pattern(model: torch.nn.Module) -> Optional[Pattern]:
    """The pattern the model's layers use, or None for the model's own attention."""
    return getattr(attention_layers(_pretrained(model))[0], _PATTERN_ATTR, None)
