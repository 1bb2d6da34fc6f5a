"""Input checks shared by patterns, algorithms and the methods around them, so that a wrong
value fails with the same message wherever it is given (a recipe, ``--method-arg``, a call)."""

from __future__ import annotations

from typing import Any, Optional

import torch


# The longest sequence anything here is asked to take, in tokens: RoPE rotates by positions
# computed in float32 (transformers: ``position_ids.float() @ inv_freq``), whose 24-bit
# significand holds every integer only up to 2**24; past it neighbouring positions become one
# number. Every length (recipes, plan, eval) and every length-like parameter is bounded by it.
MAX_LENGTH = 1 << 24
LENGTH_WHY = "RoPE positions are float32, exact only up to 2**24"
# The most attention heads a pattern parameter that counts head groups may ask for (scca_flow:
# one group per chunk, so its chunks divide the heads): released models have at most 128 query
# heads per layer; 8x that leaves room and keeps a pattern built from it small.
MAX_HEADS = 1024
HEADS_WHY = "one head group each, and models have at most 128 heads"


def length_rule(value: int) -> Optional[str]:
    """Why a sequence length of ``value`` tokens cannot be asked for, None if it can."""
    return None if value <= MAX_LENGTH else f"at most {MAX_LENGTH:,} tokens ({LENGTH_WHY})"


def check_int(name: str, value: Any, owner: str, least: int = 1, *, most: int = MAX_LENGTH, why: str = LENGTH_WHY) -> int:
    """Every integer parameter of every pattern and method is checked here, so a recipe
    value of the wrong type (``true``, ``2.5``) fails with the same message everywhere. Each
    counts tokens or parts of a sequence, so ``most`` defaults to :data:`MAX_LENGTH`: checked
    before anything is built from it (``scca_flow`` builds one part per chunk)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise ValueError(f"{owner}: {name}={value!r} must be an integer >= {least}")
    if value > most:
        raise ValueError(f"{owner}: {name}={short(value)} must be an integer <= {most:,} ({why})")
    return value


def short(value: Any) -> str:
    """A value as a message shows it: a 400-digit integer by its first digits and its length."""
    text = str(value)
    if len(text) <= 40:
        return text
    return f"{text[:6]}... ({len(text)} {'digits' if isinstance(value, int) else 'characters'})"


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
