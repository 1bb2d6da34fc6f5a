"""The one primitive every sparse pattern reduces to: attention inside blocks.

Queries come in ``C`` blocks of ``Lq`` rows, keys in ``C`` matching blocks of ``Lk`` rows, and
query row ``u`` of a block sees key row ``t`` of the same block when ``t <= u + offset`` (or
every row when ``offset`` is None). Chunked, shifted, rolled and dilated heads are all this
after slicing, so each backend implements it once.

Blocks are folded into SDPA's batch dimension as ``(B*C, H, L, D)``: SDPA keeps its fast
kernels on 4-D input (5-D input falls back to the math kernel, which materialises scores),
heads stay in dim 1 so grouped-query K/V need no copies, and for the ``(B, N, H, D)`` layout
transformers hands over the fold is a view.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

BACKENDS = ("sdpa", "flash", "flex")
_TORCH = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
_SDPA_GQA = _TORCH >= (2, 5)


def flash_available() -> bool:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


def resolve_backend(backend: Optional[str], q: torch.Tensor) -> str:
    """``None`` means ``sdpa``: it runs everywhere, has a backward everywhere and picks its own
    kernel (flash on A100/H100, memory-efficient on V100, the fused CPU kernel on CPU).
    ``flash`` and ``flex`` only when asked for, and only where they can run."""
    if backend is None:
        return "sdpa"
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is unknown; allowed: {', '.join(BACKENDS)} or None (= sdpa)")
    if backend == "flash":
        if not (q.is_cuda and flash_available()):
            raise ValueError(
                "backend='flash' needs the flash-attn package and CUDA tensors "
                "(pip install 'sparse-ft[flash]' on a CUDA machine); use backend='sdpa'"
            )
        if q.dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"backend='flash' needs fp16 or bf16 tensors, got dtype={q.dtype}; use backend='sdpa'")
    return backend


def _block_mask(lq: int, lk: int, offset: int, device: torch.device) -> torch.Tensor:
    u = torch.arange(lq, device=device)[:, None]
    t = torch.arange(lk, device=device)[None, :]
    return t <= u + offset


def _gqa_native(q: torch.Tensor, kv_heads: int, masked: bool) -> bool:
    """Whether SDPA takes fewer K/V heads at full speed. On CUDA only its flash kernel does
    (half precision, no explicit mask; others fall back to the math kernel). On CPU the fused
    kernel does, but its backward then seems to share work only across batch × KV heads:
    measured on torch 2.13 with 2 threads and one KV head, it took 3-10× the CPU time of
    repeated K/V (with 1 thread it was slightly faster). So only with a unit per thread."""
    if not _SDPA_GQA:
        return False
    if not q.is_cuda:
        return q.shape[0] * kv_heads >= torch.get_num_threads()
    d = q.shape[-1]
    return not masked and q.dtype in (torch.float16, torch.bfloat16) and d % 8 == 0 and d <= 256


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor], causal: bool) -> torch.Tensor:
    """4-D SDPA, scale 1/sqrt(D), k/v with ``H // groups`` heads."""
    groups = q.shape[1] // k.shape[1]
    gqa = groups > 1 and _gqa_native(q, k.shape[1], mask is not None)
    if groups > 1 and not gqa:  # only this call's K/V, and only where the kernel needs it
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    extra = {"enable_gqa": True} if gqa else {}
    scale = 1.0 / math.sqrt(q.shape[-1])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale, **extra)


def block_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offset: Optional[int],
    backend: str = "sdpa",
) -> torch.Tensor:
    """q ``(B, H, C, Lq, D)``, k/v ``(B, Hkv, C, Lk, D)`` with ``H % Hkv == 0`` ->
    ``(B, H, C, Lq, D)``.

    Every query row must see at least one key (callers guarantee it, so no row is NaN);
    padded rows are the caller's to discard."""
    b, h, c, lq, d = q.shape
    lk = k.shape[3]
    if backend == "flash":
        return _flash_blocks(q, k, v, offset)
    fold = lambda x: x.transpose(1, 2).reshape(b * c, x.shape[1], x.shape[3], d)  # noqa: E731
    if offset is None:
        out = sdpa(fold(q), fold(k), fold(v), None, False)
    elif offset == 0 and lq == lk:
        out = sdpa(fold(q), fold(k), fold(v), None, True)
    else:
        out = sdpa(fold(q), fold(k), fold(v), _block_mask(lq, lk, offset, q.device), False)
    return out.view(b, c, h, lq, d).transpose(1, 2)


def _flash_blocks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offset: Optional[int]) -> torch.Tensor:
    """flash-attn's dense kernel on ``(B*C, L, H, D)``; it takes fewer K/V heads natively."""
    from flash_attn import flash_attn_func

    b, h, c, lq, d = q.shape
    lk = k.shape[3]
    # flash-attn's window is aligned bottom-right: row u sees keys up to u + (Lk - Lq) + right.
    # Solve for our ``t <= u + offset``; -1 means no limit.
    to_flash = lambda x: x.permute(0, 2, 3, 1, 4).reshape(b * c, x.shape[3], x.shape[1], d)  # noqa: E731
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
    return x.unflatten(2, (-1, size))


def unchunk(x: torch.Tensor, n: int) -> torch.Tensor:
    return x.flatten(2, 3)[:, :, :n]
