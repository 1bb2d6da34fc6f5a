"""Plug attention patterns into any transformers causal LM through its AttentionInterface.

No model class is patched: one attention function named ``sparse_ft`` is registered with
transformers, the model is switched to it with its own ``set_attn_implementation``, and each
attention layer carries the pattern it uses (so two models in one process can differ). The
mask interface hands the function the 2-D padding mask instead of an N×N one.

A padded row is computed as if it were alone and unpadded: its real tokens go through the
pattern at their own length, so the pattern's chunks never depend on the padding.

Methods that need more than q, k, v (positions, the KV cache: Dual Chunk Attention,
LongHeads) implement ``attend_hf(module, query, key, value, attention_mask, **kwargs)`` on
their pattern object; the function hands the call over unchanged (docs/attention.md).
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.nn.functional as F

import attn_patterns
from attn_patterns import Pattern

IMPLEMENTATION = "sparse_ft"
_PATTERN_ATTR = "_sparse_ft_pattern"
_ORIGINAL_ATTR = "_sparse_ft_original_attn"


# --- the attention function transformers calls --------------------------------------------
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
    hook = getattr(pattern, "attend_hf", None)
    if hook is not None:
        return hook(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    if dropout:
        raise ValueError(f"attention dropout={dropout} is not supported by pattern {pattern!r}; set attention_dropout=0")
    if query.shape[2] != key.shape[2]:
        raise ValueError(
            f"pattern {pattern!r} is a training pattern: it is defined over a whole sequence, not for "
            f"{query.shape[2]} new queries against a KV cache of {key.shape[2]} keys; generate or evaluate "
            "with sparse_ft.use_attention(model, 'full')"
        )
    window = kwargs.get("sliding_window")
    if window is not None and window < key.shape[2]:
        raise ValueError(
            f"sliding_window={window} is shorter than the sequence ({key.shape[2]} tokens): pattern {pattern!r} "
            "replaces global causal attention; set model.config.sliding_window=None (and use_sliding_window=False)"
        )
    real = key_padding(attention_mask, query.shape[2], key.shape[2])
    _check_positions(kwargs.get("position_ids"), real, pattern)
    d = query.shape[-1]
    if scaling is not None and not math.isclose(scaling, 1.0 / math.sqrt(d), rel_tol=1e-6):
        query = query * (scaling * math.sqrt(d))  # patterns use 1/sqrt(D)
    out = pattern(query, key, value) if real is None else _per_row(pattern, query, key, value, real)
    return out.transpose(1, 2).contiguous(), None


def key_padding(attention_mask: Optional[torch.Tensor], q_len: int, kv_len: int) -> Optional[torch.Tensor]:
    """The mask transformers handed over as bool ``(B, kv_len)``, True on real tokens, or None
    when nothing is padded. Accepts the 2-D mask (our mask interface, transformers >= 4.53) and
    the 4-D causal+padding mask older versions build (or a user passes), which must be exactly
    that: a 4-D mask with anything else (packed documents, custom masks) is refused."""
    if attention_mask is None:
        return None
    if attention_mask.dim() == 2:
        real = attention_mask[:, -kv_len:].bool()
    elif attention_mask.dim() == 4 and attention_mask.shape[1] == 1 and q_len == kv_len:
        visible = attention_mask[:, 0, :, :kv_len]  # 4.5x appends a spare column for the cache
        if visible.dtype != torch.bool:  # additive: 0 visible, dtype min (or -inf) hidden
            visible = visible > torch.finfo(visible.dtype).min / 2
        real = visible.diagonal(dim1=1, dim2=2)  # a real token sees itself; padding is hidden from all
        causal = torch.ones(q_len, kv_len, dtype=torch.bool, device=real.device).tril()
        expected = causal & real[:, None, :]
        if bool(((visible != expected) & real[:, :, None]).any()):
            raise ValueError(
                "attention_mask: this 4-D mask is not causal attention over a padded batch (packed documents "
                "or a custom mask?); sparse patterns accept padding only: pass the 2-D attention_mask"
            )
    else:
        raise ValueError(
            f"attention_mask of shape {tuple(attention_mask.shape)} is not supported with sparse patterns; "
            "pass the 2-D (batch, seq) padding mask"
        )
    return None if bool(real.all()) else real


def _check_positions(position_ids: Optional[torch.Tensor], real: Optional[torch.Tensor], pattern: Pattern) -> None:
    """Positions restarting inside a row mean packed documents (flash-attention style
    packing); a pattern would attend across them, so refuse rather than leak."""
    if position_ids is None or position_ids.shape[-1] < 2:
        return
    jumps = position_ids[..., 1:] - position_ids[..., :-1] != 1
    if real is not None:
        jumps = jumps & real[:, 1:] & real[:, :-1]
    if bool(jumps.any()):
        raise ValueError(
            f"position_ids restart or jump inside a sequence (packed documents?): pattern {pattern!r} would attend "
            "across them; pack without resetting positions, or pad each document to its own row"
        )


def _per_row(pattern: Pattern, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """Each row's run of real tokens through the pattern at its own length (rows sharing a
    run are batched together); padding queries get 0. Left and right padding both work."""
    n = real.shape[1]
    edges = F.pad(real.int(), (1, 1)).diff(dim=1).ne(0).sum(dim=1)
    if bool((edges > 2).any()):
        row = int((edges > 2).nonzero()[0])
        raise ValueError(
            f"attention_mask row {row} has padding between real tokens; pattern {pattern!r} needs each row's "
            "real tokens contiguous (left or right padding)"
        )
    starts, lengths = real.int().argmax(dim=1).tolist(), real.sum(dim=1).tolist()
    runs: dict[tuple[int, int], list[int]] = {}
    for row, run in enumerate(zip(starts, lengths)):
        runs.setdefault(run, []).append(row)
    outs, order = [], []
    for (start, length), rows in runs.items():
        idx = torch.tensor(rows, device=q.device)
        if length == 0:
            outs.append(q.new_zeros(len(rows), *q.shape[1:]))
        else:
            part = slice(start, start + length)
            out = pattern(q[idx, :, part], k[idx, :, part], v[idx, :, part])
            outs.append(F.pad(out, (0, 0, start, n - start - length)))
        order += rows
    out = torch.cat(outs) if len(outs) > 1 else outs[0]
    inverse = torch.empty(len(order), dtype=torch.long)
    inverse[torch.tensor(order)] = torch.arange(len(order))
    return out[inverse.to(q.device)]


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(IMPLEMENTATION, sparse_ft_attention)
    try:
        from transformers import AttentionMaskInterface
        from transformers.masking_utils import flash_attention_mask
    except ImportError:  # transformers < 4.53 builds its own 4-D mask; key_padding reads it
        return
    AttentionMaskInterface.register(IMPLEMENTATION, flash_attention_mask)


# --- switching a model ----------------------------------------------------------------------
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
        raise ValueError(
            f"{type(model).__name__} has no attention layers calling transformers' AttentionInterface "
            "(modules with layer_idx, head_dim and config); sparse-ft supports Llama-style decoder models"
        )
    return layers


def _check_supported(base: torch.nn.Module, layers: list[torch.nn.Module]) -> None:
    if not any(hasattr(m, "inv_freq") for m in base.modules()):
        raise ValueError(
            f"{type(base).__name__} has no rotary embedding (no module with inv_freq): sparse-ft patterns are for "
            "RoPE models such as Llama, Mistral and Qwen2"
        )
    if not getattr(base.config, "is_causal", True) or not all(getattr(m, "is_causal", True) for m in layers):
        raise ValueError(f"{type(base).__name__} has non-causal attention layers; patterns are for causal decoders")


def use_attention(model: torch.nn.Module, name: "str | Pattern", **params: Any) -> torch.nn.Module:
    """Switch every attention layer of ``model`` to pattern ``name`` with ``params``, or to a
    ready Pattern object. ``"full"`` switches back to the model's own implementation (sdpa,
    eager, ...), whose logits are then bit-identical to before. Returns the model."""
    base = _pretrained(model)
    layers = attention_layers(base)
    _check_supported(base, layers)
    if isinstance(name, str) and name == "full" and not params:
        for layer in layers:
            if hasattr(layer, _PATTERN_ATTR):
                delattr(layer, _PATTERN_ATTR)
        original = getattr(base, _ORIGINAL_ATTR, None)
        if original is not None:
            _set_implementation(base, original)
            delattr(base, _ORIGINAL_ATTR)
        return model
    pattern = name if isinstance(name, Pattern) else attn_patterns.get(name, **params)
    pattern.check_heads(base.config.num_attention_heads)  # fail now, not mid-forward
    _register()
    current = base.config._attn_implementation
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
    else:  # older transformers: the layers read config._attn_implementation at every call
        model.config._attn_implementation = implementation


def current_pattern(model: torch.nn.Module) -> Optional[Pattern]:
    """The pattern the model's layers use, or None for the model's own attention."""
    return getattr(attention_layers(_pretrained(model))[0], _PATTERN_ATTR, None)
