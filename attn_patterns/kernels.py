"""The one primitive every sparse pattern reduces to: attention inside blocks.

Queries come in ``C`` blocks of ``Lq`` rows, keys in ``C`` matching blocks of ``Lk`` rows, and
query row ``u`` of a block sees key row ``t`` of the same block when ``t <= u + offset`` (or
every row when ``offset`` is None). Chunked, shifted, rolled and dilated heads are all this
after slicing, so each backend implements it once. Blocks are folded into SDPA's batch
dimensions: SDPA keeps its fast kernels on 4-D input and falls back to the math kernel on 5-D.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

BACKENDS = ("sdpa", "flash", "flex")


def flash_available() -> bool:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


def resolve_backend(backend: Optional[str], q: torch.Tensor) -> str:
    """Auto choice: flash-attn for fp16/bf16 CUDA tensors when installed, else SDPA (which
    picks its own flash / memory-efficient / CPU kernel). FlexAttention only on request."""
    if backend is None:
        half = q.dtype in (torch.float16, torch.bfloat16)
        return "flash" if q.is_cuda and half and flash_available() else "sdpa"
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is unknown; allowed: {', '.join(BACKENDS)} or None (automatic)")
    if backend == "flash" and not (q.is_cuda and flash_available()):
        raise ValueError(
            "backend='flash' needs the flash-attn package and CUDA tensors "
            "(pip install 'sparse-ft[flash]' on a CUDA machine); use backend='sdpa'"
        )
    return backend


def _block_mask(lq: int, lk: int, offset: int, device: torch.device) -> torch.Tensor:
    u = torch.arange(lq, device=device)[:, None]
    t = torch.arange(lk, device=device)[None, :]
    return t <= u + offset


def block_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offset: Optional[int],
    backend: str = "sdpa",
) -> torch.Tensor:
    """q ``(B, H, C, Lq, D)``, k/v ``(B, H, C, Lk, D)`` -> ``(B, H, C, Lq, D)``.

    Every query row must see at least one key (callers guarantee it); padded rows are the
    caller's to discard."""
    b, h, c, lq, d = q.shape
    lk = k.shape[3]
    if backend == "flash":
        return _flash_blocks(q, k, v, offset)
    fold = lambda x: x.reshape(b * h, c, x.shape[3], d)  # noqa: E731 - a view when contiguous
    scale = 1.0 / math.sqrt(d)
    if offset is None:
        out = F.scaled_dot_product_attention(fold(q), fold(k), fold(v), scale=scale)
    elif offset == 0 and lq == lk:
        out = F.scaled_dot_product_attention(fold(q), fold(k), fold(v), is_causal=True, scale=scale)
    else:
        mask = _block_mask(lq, lk, offset, q.device)
        out = F.scaled_dot_product_attention(fold(q), fold(k), fold(v), attn_mask=mask, scale=scale)
    return out.view(b, h, c, lq, d)


def _flash_blocks(q, k, v, offset):
    from flash_attn import flash_attn_func

    b, h, c, lq, d = q.shape
    lk = k.shape[3]
    # flash-attn wants (batch, seq, heads, dim); its window is aligned bottom-right, so a
    # row u sees keys up to u + (Lk - Lq) + right: solve for our ``t <= u + offset``.
    to_flash = lambda x: x.permute(0, 2, 3, 1, 4).reshape(b * c, x.shape[3], h, d)  # noqa: E731
    right = -1 if offset is None else offset + lq - lk
    out = flash_attn_func(to_flash(q), to_flash(k), to_flash(v), causal=False, window_size=(-1, right))
    return out.view(b, c, lq, h, d).permute(0, 3, 1, 2, 4)


def chunk(x: torch.Tensor, size: int) -> torch.Tensor:
    """``(B, H, N, D)`` -> ``(B, H, ceil(N/size), size, D)``, zero-padding the tail (padded
    keys sit after every real query, so causality already hides them)."""
    n = x.shape[2]
    pad = -n % size
    if pad:
        x = F.pad(x, (0, 0, 0, pad))
    return x.view(x.shape[0], x.shape[1], -1, size, x.shape[3])


def unchunk(x: torch.Tensor, n: int) -> torch.Tensor:
    return x.reshape(x.shape[0], x.shape[1], -1, x.shape[4])[:, :, :n]
