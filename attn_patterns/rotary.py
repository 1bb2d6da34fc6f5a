"""RoPE re-positioning shared by the training-free methods (DCA, LongHeads): transformers
hands attention functions q/k already rotated at their true positions, and RoPE is a
rotation, so moving a vector to another position is one more rotation by the difference.
The frequencies come from the caller (``sparse_ft.modeling.rope.rope_inv_freq`` reads a model's)."""

from __future__ import annotations

import math
from typing import Optional

import torch


def default_inv_freq(dim: int, theta: float = 10000.0) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def rotate(x: torch.Tensor, shift: torch.Tensor, inv_freq: Optional[torch.Tensor]) -> torch.Tensor:
    """Rotate ``x (..., D)`` by ``shift`` positions (int, broadcastable to ``x.shape[:-1]``)
    with RoPE's rotate-half layout; only the first ``2·len(inv_freq)`` dims rotate (partial
    rotary). Angles are formed and reduced modulo 2π in fp64 (a shift of 10^5 positions
    would lose ~1e-2 rad in fp32), the rotation runs in fp32, the result is in x's dtype.
    ``inv_freq=None``: a model without RoPE, nothing to move."""
    if inv_freq is None:
        return x
    half = inv_freq.numel()
    angle = shift.to(torch.float64)[..., None] * inv_freq.to(device=x.device, dtype=torch.float64)
    angle = torch.remainder(angle, 2 * math.pi).float()
    cos, sin = angle.cos(), angle.sin()
    x1, x2 = x[..., :half].float(), x[..., half : 2 * half].float()
    out = x.clone() if 2 * half < x.shape[-1] else torch.empty_like(x)
    out[..., :half] = torch.addcmul(x1 * cos, x2, sin, value=-1)
    out[..., half : 2 * half] = torch.addcmul(x2 * cos, x1, sin)
    return out
