"""Dense masked attention: the ground truth every fast path is tested against."""

from __future__ import annotations

import math

import torch


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """q (B,H,N,D), k/v (B,Hkv,N,D), mask bool (H,N,N) or (N,N); rows with no visible key give
    0. Computed in at least fp32 whatever the input dtype."""
    dtype = torch.promote_types(q.dtype, torch.float32)
    groups = q.shape[1] // k.shape[1]
    k, v = (x.repeat_interleave(groups, dim=1).to(dtype) for x in (k, v))
    scores = q.to(dtype) @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return (weights @ v).to(q.dtype)
