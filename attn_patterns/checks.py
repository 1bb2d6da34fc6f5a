"""Input checks shared by patterns, algorithms and the methods around them, so that a wrong
value fails with the same message wherever it is given (a recipe, ``--method-arg``, a call)."""

from __future__ import annotations

from typing import Any

import torch


def check_int(name: str, value: Any, owner: str, least: int = 1) -> int:
    """Every integer parameter of every pattern and method is checked here, so a recipe
    value of the wrong type (``true``, ``2.5``) fails with the same message everywhere."""
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise ValueError(f"{owner}: {name}={value!r} must be an integer >= {least}")
    return value


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """q (B, H, N, D) and k/v (B, Hkv, N, D) with H a multiple of Hkv: the one layout every
    whole-sequence call takes, refused here before any kernel sees a wrong shape."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"q, k, v must be 4-D (batch, heads, seq, dim); got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    b, h, n, d = q.shape
    if k.shape != v.shape or k.shape[0] != b or k.shape[2] != n or k.shape[3] != d:
        raise ValueError(
            f"k and v must be (batch={b}, kv_heads, seq={n}, dim={d}) like q; got k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if n < 1:
        raise ValueError("seq_len=0: patterns need at least one token")
    if h % k.shape[1]:
        raise ValueError(f"num_heads={h} must be a multiple of kv_heads={k.shape[1]} (grouped-query attention)")
