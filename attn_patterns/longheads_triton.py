"""LongHeads' attention over the chosen chunks in one Triton kernel (``backend="triton"``):
what :func:`~attn_patterns.longheads.attend_chosen` computes for a step of rows, with no
gathers, no copies of K/V, no per-chunk Python and no log-sum-exp merges. Forward only:
LongHeads is training-free.

One program per (batch·head, block of query rows) walks the union of its rows' chunks (their
k-1 chosen earlier ones and their own) in ascending order, found in the kernel: from the rows'
chunk ids, held in registers, the next chunk is the least id above the current one. Each row
is masked to its own chunks (and, in its own chunk, causally) and all of them go through one
online softmax in fp32, so the pieces need no merge. K/V head ``h // groups`` is read in place
(grouped-query attention with no repeat).

Re-positioning without moving keys: a row at position p (chunk m) puts its chunk in slot r
(ascending, R = k-1 earlier slots) at ``r·l``, itself at ``R·l + p mod l``. RoPE logits only
see the distance, so with q and k left at their true positions the query is rotated by
``-j·l`` with ``j = (m - c) - (R - r)`` for the keys of chunk c: the distance it has in the
sequence minus the one it has after re-positioning, in chunks. ``j`` is 0 for the own chunk
and for the previous one in the last slot (``keep_previous``), which keep their true
distances, and otherwise within 0..m. The rotation runs in the kernel from a table of cos/sin
per ``j`` (angles reduced in fp64 once per call, as :func:`~attn_patterns.rotary.rotate`
does; an fp32 angle of 10^5 positions would be off by ~1e-2 rad), on the two rotate-half
halves of q loaded apart (``q1·cos - q2·sin``, ``q2·cos + q1·sin``), each scored against
its half of the keys: no gathered load of q, which on sm90 cost registers and spills.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch
import triton
import triton.language as tl

from attn_patterns.triton_attention import (INTERPRETED, LOG2E, MIN_BLOCK, online_softmax_start, online_softmax_step,
                                             program_offsets)

Chosen = Callable[[torch.Tensor, torch.Tensor, int, torch.Tensor], torch.Tensor]

_NONE = tl.constexpr(1 << 30)  # "no further chunk": above every chunk id


@triton.jit
def _chosen_kernel(Q, K, V, O, CHOSEN, COS, SIN,
                   sq_b, sq_h, sq_n, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n, so_b, so_h, so_n, sc_b, sc_h, sc_n,
                   H, GROUPS, ROWS, FIRST, CHUNK, R, qk_scale,
                   D: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_REST: tl.constexpr,
                   BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, SLOTS: tl.constexpr,
                   PRECISION: tl.constexpr):
    """q·k in parts of the head dim: the two rotate-half halves (``HALF`` dims each, blocks of
    ``BLOCK_HALF``; none without RoPE) and the dims RoPE leaves alone (``D - 2·HALF``, blocks of
    ``BLOCK_REST``; none with full rotary), so the rotation needs no gathered load of q."""
    qb, b, h, offs_q, offs_k, offs_d = program_offsets(H, BLOCK_Q, BLOCK_K, BLOCK_D)
    offs_s = tl.arange(0, SLOTS)
    real = qb * BLOCK_Q + offs_q < ROWS
    pos = FIRST + qb * BLOCK_Q + offs_q  # the rows' positions among the keys
    own = tl.where(real, pos // CHUNK, _NONE)  # each row's own chunk
    first = (qb * BLOCK_Q).to(tl.int64)  # pointers: a scalar int64 base, int32 offsets from it
    ids = tl.load(CHOSEN + b * sc_b + h * sc_h + first * sc_n + (offs_q * sc_n)[:, None] + offs_s[None, :],
                  mask=real[:, None] & (offs_s < R)[None, :], other=_NONE).to(tl.int32)
    last = FIRST + tl.minimum(ROWS, (qb + 1) * BLOCK_Q) - 1  # the block's last position
    q_rows = Q + b * sq_b + h * sq_h + first * sq_n + (offs_q * sq_n)[:, None]
    kvh = h // GROUPS
    k_head = K + b * sk_b + kvh * sk_h
    v_head = V + b * sv_b + kvh * sv_h
    acc, m_i, l_i = online_softmax_start(BLOCK_Q, BLOCK_D)
    c = tl.minimum(tl.min(tl.min(ids, 1), 0), tl.min(own, 0))
    while c < _NONE:
        slot = tl.sum((ids < c).to(tl.int32), 1)  # the chunk's slot in each row's list (R: the own chunk)
        hit = (tl.max((ids == c).to(tl.int32), 1) > 0) | (own == c)
        if BLOCK_HALF > 0:  # the query rotated by -j·l: q1·cos - q2·sin, q2·cos + q1·sin
            offs_h = tl.arange(0, BLOCK_HALF)
            half_mask = real[:, None] & (offs_h < HALF)[None, :]
            q1 = tl.load(q_rows + offs_h[None, :], mask=half_mask, other=0.0).to(tl.float32)
            q2 = tl.load(q_rows + HALF + offs_h[None, :], mask=half_mask, other=0.0).to(tl.float32)
            turn = tl.where(hit, (own - c) - (R - slot), 0)[:, None] * BLOCK_HALF + offs_h[None, :]
            cos = tl.load(COS + turn)
            sin = tl.load(SIN + turn)
            q1, q2 = (q1 * cos - q2 * sin).to(K.dtype.element_ty), (q2 * cos + q1 * sin).to(K.dtype.element_ty)
        if BLOCK_REST > 0:
            offs_r = tl.arange(0, BLOCK_REST)
            q3 = tl.load(q_rows + 2 * HALF + offs_r[None, :], mask=real[:, None] & (offs_r < D - 2 * HALF)[None, :],
                         other=0.0)
        base = c * CHUNK
        stop = tl.minimum(CHUNK, last + 1 - base)  # the own chunk: keys up to the block's last row
        for start in range(0, stop, BLOCK_K):
            t = base + start + offs_k  # key positions
            keys = start + offs_k < stop
            k_rows = k_head + (base + start).to(tl.int64) * sk_n + (offs_k * sk_n)[None, :]
            s = tl.zeros([BLOCK_Q, BLOCK_K], dtype=tl.float32)
            if BLOCK_HALF > 0:
                k_mask = keys[None, :] & (offs_h < HALF)[:, None]
                s += tl.dot(q1, tl.load(k_rows + offs_h[:, None], mask=k_mask, other=0.0), input_precision=PRECISION)
                s += tl.dot(q2, tl.load(k_rows + HALF + offs_h[:, None], mask=k_mask, other=0.0),
                            input_precision=PRECISION)
            if BLOCK_REST > 0:
                k3 = tl.load(k_rows + 2 * HALF + offs_r[:, None], mask=keys[None, :] & (offs_r < D - 2 * HALF)[:, None],
                             other=0.0)
                s += tl.dot(q3, k3, input_precision=PRECISION)
            v = tl.load(v_head + (base + start).to(tl.int64) * sv_n + (offs_k * sv_n)[:, None] + offs_d[None, :],
                        mask=keys[:, None] & (offs_d < D)[None, :], other=0.0)
            seen = hit[:, None] & keys[None, :] & (t[None, :] <= pos[:, None])
            s = tl.where(seen, s * qk_scale, float("-inf"))
            acc, m_i, l_i = online_softmax_step(acc, m_i, l_i, s, v, PRECISION)
        c = tl.minimum(tl.min(tl.min(tl.where(ids > c, ids, _NONE), 1), 0), tl.min(tl.where(own > c, own, _NONE), 0))
    out = acc / tl.where(real, l_i, 1.0)[:, None]  # every real row sees at least its own key
    tl.store(O + b * so_b + h * so_h + first * so_n + (offs_q * so_n)[:, None] + offs_d[None, :],
             out.to(O.dtype.element_ty), mask=real[:, None] & (offs_d < D)[None, :])


def _turns(inv_freq: torch.Tensor, *, chunk_size: int, count: int, width: int,
           device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (count, width) in fp32 of the angles that rotate a query by ``-j·chunk_size``
    positions, j = 0..count-1 (columns past ``len(inv_freq)`` pad the kernel's block). Angles
    reduced modulo 2π in fp64."""
    half = inv_freq.numel()
    angle = -torch.arange(count, device=device, dtype=torch.float64)[:, None] * chunk_size * inv_freq.to(device, torch.float64)
    angle = torch.remainder(angle, 2 * math.pi).float()
    cos, sin = torch.ones(count, width, device=device), torch.zeros(count, width, device=device)
    cos[:, :half], sin[:, :half] = angle.cos(), angle.sin()
    return cos, sin


def _tiles(q: torch.Tensor) -> tuple[int, int, int, int]:
    """(query rows, keys, warps, stages) per program: 16×16 under the interpreter (it runs a
    tile in Python). On a GPU, read from ptxas for sm90 (registers and spills, not timed): 64
    rows by 32 keys up to 128 bytes a row (D = 64 in half precision: 48 bytes spilled), 32 by
    32 above (D = 128: about 200; 64 rows spilled 640). Fewer rows per block also keep the
    union of their chunks small."""
    if INTERPRETED or not q.is_cuda:
        return MIN_BLOCK, MIN_BLOCK, 4, 1
    return cuda_tiles(q)


def cuda_tiles(q: torch.Tensor) -> tuple[int, int, int, int]:
    """The GPU's tiles for q's head dim and dtype, whatever q's device (tests/attn_patterns/triton_ptx.py)."""
    width = triton.next_power_of_2(q.shape[-1]) * q.element_size()
    return (64 if width <= 128 else 32), 32, 4, 2


def chosen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, chunk_size: int,
                     inv_freq: Optional[torch.Tensor], scale: float) -> Chosen:
    """``attend(rows, chosen, first, out)``: LongHeads' output for query rows (B,H,n,D) at
    positions ``first``.. (all beyond the window, rotated at their true positions) over their
    ``chosen`` chunks (B,H,n,k-1, from :func:`~attn_patterns.longheads.choose_chunks`) and
    their own chunk, written into ``out`` (B,H,n,D; a view of the call's output, rows at any
    stride) and returned: what :func:`~attn_patterns.longheads.attend_chosen` computes. k/v
    (B,Hkv,Nk,D) are the call's, at true positions. Made once per call (the rotation table);
    refuses inputs that need gradients (the kernel has no backward). Device, dtype and head
    dim are checked by the caller's backend resolution."""
    if torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v)):
        raise ValueError("longheads: backend='triton' runs the forward only (LongHeads is training-free), got inputs "
                         "that require grad; run under torch.no_grad() or use backend='sdpa' or 'math'")
    b, hkv, nk, d = k.shape
    heads = q.shape[1]
    half = 0 if inv_freq is None else inv_freq.numel()
    block_half, block_rest = (max(MIN_BLOCK, triton.next_power_of_2(x)) if x else 0 for x in (half, d - 2 * half))
    cos, sin = (_turns(inv_freq, chunk_size=chunk_size, count=(nk - 1) // chunk_size + 1, width=block_half, device=q.device)
                if half else (q.new_empty(0, dtype=torch.float32),) * 2)
    block_q, block_k, warps, stages = _tiles(q)
    keys, values = (x if x.stride(-1) == 1 else x.contiguous() for x in (k, v))

    def attend(rows: torch.Tensor, chosen: torch.Tensor, first: int, out: torch.Tensor) -> torch.Tensor:
        rows = rows if rows.stride(-1) == 1 else rows.contiguous()
        chosen = chosen if chosen.stride(-1) == 1 else chosen.contiguous()
        n, slots = rows.shape[2], chosen.shape[-1]
        _chosen_kernel[(triton.cdiv(n, block_q), b * heads)](
            rows, keys, values, out, chosen, cos, sin, *rows.stride()[:3], *keys.stride()[:3], *values.stride()[:3],
            *out.stride()[:3], *chosen.stride()[:3], heads, heads // hkv, n, first, chunk_size, slots, LOG2E * scale,
            D=d, HALF=half, BLOCK_HALF=block_half, BLOCK_REST=block_rest, BLOCK_Q=block_q, BLOCK_K=block_k,
            BLOCK_D=max(MIN_BLOCK, triton.next_power_of_2(d)), SLOTS=triton.next_power_of_2(slots),
            PRECISION="ieee" if rows.dtype == torch.float32 else "tf32", num_warps=warps, num_stages=stages)
        return out

    return attend
