"""Patterns inside a model (S², SCCA, SDA, LongMixed, causal, ... and any registered later)
through one adapter, and ``full``: the model's own attention.

A padded row, and each document of a packed row, is computed as if it were alone and
unpadded: its real tokens go through the pattern at their own length
(:mod:`sparse_ft.methods.sequences`), so the pattern's chunks never depend on the padding or
on the other documents.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

from attn_patterns import Pattern
from attn_patterns.kernels import BACKENDS
from sparse_ft.modeling.attention import restore_own_attention
from sparse_ft.modeling.families import geometry
from sparse_ft.methods.base import Method, Supports, register
from sparse_ft.methods.sequences import find_spans, packed_call, per_span


class PatternMethod(Method):
    """Any pattern, trainable, on whole sequences only: a pattern is defined over a whole
    sequence, so generation re-runs the sequence."""

    supports = Supports(training=True, ppl=True, kv_cache=False, backends=(None, *BACKENDS))

    def __init__(self, pattern: Pattern) -> None:
        self.pattern = pattern

    @property
    def name(self) -> str:  # type: ignore[override]
        return self.pattern.name

    def __repr__(self) -> str:
        return repr(self.pattern)

    @property
    def backend(self) -> Optional[str]:
        return self.pattern.backend

    def check_model(self, config: Any) -> None:
        self.pattern.check_heads(geometry(config).heads)

    def check_length(self, seq_len: int) -> None:
        self.pattern.check_length(seq_len)

    def __call__(self, module, query, key, value, attention_mask, *, scaling: Optional[float] = None,
                 dropout: float = 0.0, head_offset: int = 0, num_heads: Optional[int] = None,
                 **kwargs: Any) -> tuple[torch.Tensor, None]:
        """``head_offset`` / ``num_heads``: query holds heads ``[head_offset, ...)`` of
        ``num_heads`` (a rank's heads under sequence parallelism)."""
        pattern = self.pattern if num_heads is None else self.pattern.heads(head_offset, num_heads)
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
        spans = find_spans(real, kwargs, batch=query.shape[0], q_len=query.shape[2], kv_len=key.shape[2],
                           owner=f"pattern {pattern!r}")
        d = query.shape[-1]
        if scaling is not None and not math.isclose(scaling, 1.0 / math.sqrt(d), rel_tol=1e-6):
            query = query * (scaling * math.sqrt(d))  # patterns use 1/sqrt(D)
        kernel = None if spans is None else pattern.packed_kernel(query)
        if kernel is not None:
            out = packed_call(kernel, query, key, value, spans=spans)
        else:
            out = per_span(lambda q, k, v, _: pattern(q, k, v), query, key, value, spans=spans)
        return out.transpose(1, 2).contiguous(), None


@register
class ModelAttention(Method):
    """``full``: the model's own attention implementation (sdpa, eager, flash...); switching
    to it restores the model exactly, logits bit-identical to never having switched. It
    takes no parameters and no backend: the model picks its kernel itself. Causal attention
    on the toolkit's kernels, with a backend, is the pattern ``causal``."""

    name = "full"
    supports = Supports(training=True, ppl=True, kv_cache=True)
    replaces_attention = False

    def apply(self, model: torch.nn.Module, length: int) -> None:
        """Evaluation measures the model as loaded (an adapter's RoPE included), through its own
        attention: a method installed earlier (a pattern scored before) is dropped."""
        restore_own_attention(model)


# --- padding --------------------------------------------------------------------------------
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
