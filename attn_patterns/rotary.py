"""RoPE re-positioning shared by the training-free methods (DCA, LongHeads): transformers
hands attention functions q/k already rotated at their true positions, and RoPE is a
rotation, so moving a vector to another position is one more rotation by the difference."""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

_LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


def rope_inv_freq(config: Any, method: str = "re-positioning") -> torch.Tensor:
    """The inverse frequencies a transformers model rotates with, computed from its config
    exactly as its rotary module does (4.x ``rope_scaling`` or 5.x ``rope_parameters``).
    Length-dependent scalings (dynamic NTK, LongRoPE) are refused: cached keys could not be
    re-positioned exactly."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type in _LENGTH_DEPENDENT_ROPE:
        raise ValueError(
            f"{method}: rope_type={rope_type!r} changes RoPE frequencies with the input length, so keys cannot be "
            "re-positioned exactly; load the model without it (or use linear / yarn / llama3 scaling)"
        )
    if rope_type != "default":
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        if rope_type not in ROPE_INIT_FUNCTIONS:
            raise ValueError(f"{method}: rope_type={rope_type!r} is unknown to transformers; allowed: default, {', '.join(ROPE_INIT_FUNCTIONS)}")
        return ROPE_INIT_FUNCTIONS[rope_type](config, None)[0].float()
    theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    dim = int(head_dim * params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)))
    return default_inv_freq(dim, theta)


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
