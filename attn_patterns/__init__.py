"""Sparse attention patterns for long-context fine-tuning, in pure torch.

    >>> import attn_patterns
    >>> pattern = attn_patterns.get("scca_flow", chunks=4)
    >>> out = pattern(q, k, v)          # q (B, H, N, D), k/v (B, Hkv, N, D)
    >>> pattern.mask(16, 8)             # bool (H, N, N), for tests and pictures

Every pattern equals dense softmax attention restricted to its visible keys, intersected
with causality; the fast path never builds N×N tensors. This package imports neither
transformers nor ``sparse_ft``: the model glue is ``sparse_ft.methods``.
"""

from attn_patterns.base import PATTERNS, Pattern, register

# the modules whose patterns register themselves on import
from attn_patterns import patterns as _patterns  # noqa: E402,F401
from attn_patterns import dca as _dca  # noqa: E402,F401
from attn_patterns import longheads as _longheads  # noqa: E402,F401

get, names, build = PATTERNS.get, PATTERNS.names, PATTERNS.build

__all__ = ["PATTERNS", "Pattern", "build", "get", "names", "register"]
