"""Sparse attention patterns for long-context fine-tuning, and the training-free attention
algorithms DCA and LongHeads, in pure torch.

    >>> import attn_patterns
    >>> pattern = attn_patterns.get("scca_flow", chunks=4)
    >>> out = pattern(q, k, v)          # q (B, H, N, D), k/v (B, Hkv, N, D)
    >>> pattern.mask(16, 8)             # bool (H, N, N), for tests and pictures
    >>> dca = attn_patterns.get_algorithm("dca", pretraining_length=4096)
    >>> out = dca(q, k, v, inv_freq=inv_freq)   # q/k before RoPE: the algorithm places them

Every pattern equals dense softmax attention restricted to its visible keys, intersected
with causality; the fast path never builds N×N tensors. An algorithm moves positions or picks
keys from the data, so it is no pattern (``attn_patterns.algorithm``). This package imports
neither transformers nor ``sparse_ft``: the model glue is ``sparse_ft.methods``.
"""

from attn_patterns.algorithm import ALGORITHMS, Algorithm
from attn_patterns.base import PATTERNS, Pattern, register

# the modules whose patterns and algorithms register themselves on import
from attn_patterns import patterns as _patterns  # noqa: E402,F401
from attn_patterns import dca as _dca  # noqa: E402,F401
from attn_patterns import longheads as _longheads  # noqa: E402,F401

get, names, build = PATTERNS.get, PATTERNS.names, PATTERNS.build
get_algorithm, algorithm_names = ALGORITHMS.get, ALGORITHMS.names

__all__ = ["ALGORITHMS", "PATTERNS", "Algorithm", "Pattern", "algorithm_names", "build", "get", "get_algorithm", "names",
           "register"]
