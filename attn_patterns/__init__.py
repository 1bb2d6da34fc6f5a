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

__all__ = ["ALGORITHMS", "PATTERNS", "Algorithm", "Pattern", "algorithm_names", "build", "get", "get_algorithm", "names",
           "register"]


def _load() -> None:
    """The public names, and every pattern and algorithm registered. Loaded on first use
    (PEP 562) rather than on import: ``attn_patterns.registry`` alone imports no torch, so a
    layer that only keeps a registry (the evaluation tasks, whose command line answers
    ``--help`` without torch) can own one."""
    from attn_patterns.algorithm import ALGORITHMS, Algorithm
    from attn_patterns.base import PATTERNS, Pattern, register

    # the modules whose patterns and algorithms register themselves on import
    from attn_patterns import patterns as _patterns  # noqa: F401
    from attn_patterns import dca as _dca  # noqa: F401
    from attn_patterns import longheads as _longheads  # noqa: F401

    globals().update(ALGORITHMS=ALGORITHMS, Algorithm=Algorithm, PATTERNS=PATTERNS, Pattern=Pattern, register=register,
                     get=PATTERNS.get, names=PATTERNS.names, build=PATTERNS.build, get_algorithm=ALGORITHMS.get,
                     algorithm_names=ALGORITHMS.names)


def __getattr__(name: str):
    if name in __all__:
        _load()
        return globals()[name]
    raise AttributeError(f"module 'attn_patterns' has no attribute {name!r}")
