"""FlexAttention backend: one block mask built from the pattern's own rule (``visible``), so
it cross-checks the hand-written kernels and runs new patterns that have none. On CUDA it is
compiled into a fused kernel; on CPU torch has no FlexAttention backward and runs it
unfused (scores materialised), so there it is an inference-only cross-check."""

from __future__ import annotations

import functools
import math
from typing import Any, Callable

import torch

_MAX_MASKS = 8  # per pattern: (N, H, device) combinations kept


@functools.cache
def compiled_flex() -> Callable[..., Any]:
    """One compiled flex_attention per process (compiling is what makes it a fused kernel)."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def block_mask(pattern, n: int, num_heads: int, device: torch.device):
    """The FlexAttention BlockMask of ``pattern``. On CUDA the mask_mod is compiled while the
    mask is built, so no N×N tensor is materialised there either."""
    from torch.nn.attention.flex_attention import create_block_mask

    # Kept on the pattern: every layer of a model asks for the same mask in each step.
    masks = pattern.__dict__.setdefault("_flex_block_masks", {})
    key = (n, num_heads, str(device))
    if key not in masks:
        if len(masks) >= _MAX_MASKS:
            masks.pop(next(iter(masks)))

        def mask_mod(batch, head, q_idx, kv_idx):
            return pattern.visible(head, q_idx, kv_idx, n=n, num_heads=num_heads)

        masks[key] = create_block_mask(
            mask_mod, B=None, H=num_heads, Q_LEN=n, KV_LEN=n, device=device, _compile=device.type == "cuda"
        )
    return masks[key]


def flex_forward(pattern, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    from torch.nn.attention.flex_attention import flex_attention

    if not q.is_cuda and torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v)):
        raise ValueError(
            "backend='flex' has no backward on CPU in torch; use backend='sdpa' for training on CPU"
        )
    b, h, n, d = q.shape
    mask = block_mask(pattern, n, h, q.device)
    kernel = compiled_flex() if q.is_cuda else flex_attention
    return kernel(q, k, v, block_mask=mask, scale=1.0 / math.sqrt(d), enable_gqa=k.shape[1] != h)
