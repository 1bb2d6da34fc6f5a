"""FlexAttention backend: one block mask built from the pattern's own rule. On CUDA it is
compiled into a fused kernel; on CPU torch has no FlexAttention backward and runs it
unfused (scores materialised), so there it is an inference-only cross-check."""

from __future__ import annotations

import functools
import math

import torch


@functools.cache
def _compiled():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def flex_forward(pattern, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if not q.is_cuda and torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v)):
        raise ValueError(
            "backend='flex' has no backward on CPU in torch; use backend='sdpa' for training on CPU"
        )
    b, h, n, d = q.shape

    def mask_mod(batch, head, q_idx, kv_idx):
        return pattern.visible(head, q_idx, kv_idx, n, h)

    block_mask = create_block_mask(mask_mod, B=None, H=h, Q_LEN=n, KV_LEN=n, device=q.device)
    kernel = _compiled() if q.is_cuda else flex_attention
    out = kernel(q, k, v, block_mask=block_mask, scale=1.0 / math.sqrt(d), enable_gqa=k.shape[1] != h)
    return out
