"""``backend="triton"``: one block-sparse FlashAttention-2 kernel, forward and backward, for
every pattern with a ``keys`` progression.

The kernel runs from a :class:`~attn_patterns.blocks.BlockLayout`: each (batch, head, query
block) program walks its runs of full key blocks (no mask) and then its partial ones (masked
with the rows' ``lo``/``hi``/``step``), with an online softmax in fp32 (base 2: scores are scaled
by ``log2(e)/sqrt(D)``). A dilated head is dense causal attention on its strided view: rows
and keys live at ``start + stride·m``, loaded by pointer arithmetic, and the positions it
does not own get 0. K/V heads are read as ``h // groups`` (grouped-query attention with no
repeat). The backward recomputes the scores from the saved LSE: dQ per query block over the
forward lists, dK/dV per key block over the transposed lists, both without atomics.

dK/dV run per *unit*: the query heads of one K/V head that share a (stride, start), so the
key block's positions are the same for all of them and their contributions add up in
registers. Where a K/V head's units touch disjoint positions (one unit, or dilated heads of
one stride and different starts: sda, longmixed) each stores into dK/dV directly; where they
overlap (a mix cutting a K/V group between a dilated and a dense head) each writes an fp32
slice of a per-unit buffer, summed per K/V head afterwards.

Query variants (DCA's intra / successive / inter rotations of q, in one pass): q comes as
``(V, B, H, N, D)``, V copies of the queries, and each run of the layout names the copy its
blocks are scored with (``*_run_variants``, :class:`~attn_patterns.blocks.ChunkVariants`).
The forward and dK/dV load q per run at one more stride; dQ accumulates in registers while
the runs keep one variant and adds into that copy's gradient when it changes, so each
program still owns its rows (no atomics) and a copy's gradient is rounded once where its
runs are consecutive (DCA's are). Patterns pass one copy (``VARIANTS`` = 1: none of this is
compiled in). Autograd carries the copies' gradients back through whatever made them.

Under ``TRITON_INTERPRET=1`` (set before this module is imported) Triton's interpreter runs
these kernels on CPU tensors: that is how the suite tests them without a GPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from attn_patterns.blocks import BlockLayout, block_layout
from attn_patterns.kernels import triton_unsupported

LOG2E = 1.4426950408889634
INTERPRETED = triton.knobs.runtime.interpret  # fixed when the kernels below are decorated


def _interpreter_index_fix() -> None:
    """Triton 3.6's interpreter turns a loaded scalar (a 1-element array) into a Python int
    with ``int(array)``, which NumPy 2.4 refuses, so a loop bounded by a loaded count fails;
    upstream's fix (triton-lang/triton#9172, not in 3.6.0) squeezes the array first. Applied
    here, to the interpreter only, until the lock carries a Triton with it."""
    from triton.runtime import interpreter

    patch = interpreter._patch_lang_tensor
    if getattr(patch, "squeezes_index", False):
        return

    def patched(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    patched.squeezes_index = True
    interpreter._patch_lang_tensor = patched


if INTERPRETED:
    _interpreter_index_fix()


@dataclass(frozen=True)
class Tiles:
    """One kernel's tile and launch: ``block_q`` query rows × ``block_k`` keys per step."""

    block_q: int
    block_k: int
    warps: int
    stages: int


MIN_BLOCK = 16  # the smallest tile side tl.dot takes


def tiles(q: torch.Tensor, period: Optional[int] = None) -> tuple[Tiles, Tiles, Tiles]:
    """(forward, dQ, dK/dV) tiles. dQ runs over the forward's lists, so it shares its blocks.
    On a GPU: chosen by compiling for sm90 and reading ptxas's registers, so that none spills
    at D=64 and 128 in half precision (FlashAttention-2's 128×64 forward does, with the
    kernel's masks and lists), and so that fp32 and D=256 fit the shared memory. Under the
    interpreter 16×16, since it runs a tile in Python. With ``period`` (chunks whose blocks
    must not straddle two: query variants), each side is cut to the largest power of two
    dividing it, which must be at least ``MIN_BLOCK``."""
    chosen = _tiles(q)
    if period is None:
        return chosen
    side = period & -period  # the largest power of two dividing period
    if side < MIN_BLOCK:
        raise ValueError(f"block-sparse kernel: a period of {period} positions takes no tile (its sides are powers of "
                         f"two >= {MIN_BLOCK} dividing the period)")
    fwd, dq, dkv = (t if side >= max(t.block_q, t.block_k) else
                    Tiles(min(t.block_q, side), min(t.block_k, side), min(t.warps, 4), t.stages) for t in chosen)
    return fwd, dq, dkv


def _tiles(q: torch.Tensor) -> tuple[Tiles, Tiles, Tiles]:
    if not q.is_cuda or INTERPRETED:
        return Tiles(16, 16, 4, 1), Tiles(16, 16, 4, 1), Tiles(16, 16, 4, 1)
    return cuda_tiles(q)


def cuda_tiles(q: torch.Tensor) -> tuple[Tiles, Tiles, Tiles]:
    """The GPU's tiles for q's head dim and dtype (whatever q's device: tests/attn_patterns/triton_ptx.py
    compiles the GPU's launches on a machine without one)."""
    width = max(16, triton.next_power_of_2(q.shape[-1])) * q.element_size()  # bytes per row
    if width <= 128:
        return Tiles(128, 32, 4, 3), Tiles(128, 32, 4, 2), Tiles(32, 64, 4, 2)
    if width <= 256:
        return Tiles(128, 32, 8, 3), Tiles(128, 32, 8, 2), Tiles(32, 32, 8, 2)
    if width <= 512:
        return Tiles(64, 32, 8, 2), Tiles(64, 32, 8, 2), Tiles(32, 32, 8, 2)
    return Tiles(32, 32, 8, 1), Tiles(32, 32, 8, 1), Tiles(16, 32, 8, 1)


# --- kernels ----------------------------------------------------------------------------------
# Pointers: a block's first row is a scalar (int64) pointer, its rows int32 offsets from it, so
# no per-element 64-bit arithmetic. Row m of a head sits at position start + dil·m.


@triton.jit
def _rows(block, offs_q, offs_d, row_stride, mask):
    return tl.load(block + (offs_q * row_stride)[:, None] + offs_d[None, :], mask=mask, other=0.0)


@triton.jit
def _run_rows(block, offs_q, offs_d, row_stride, count):
    """A run's copy of q, reloaded inside the loops: rows past ``count`` (>= 1: variants take
    uncompressed heads) repeat the last real one instead of a mask, which would be a 2-D
    tensor held in registers across the loops while the accumulator is live (it made the
    forward spill more). Those rows' scores are masked (partial blocks), dropped at the
    store, or weighted 0 by their +inf LSE (dQ)."""
    return tl.load(block + (tl.minimum(offs_q, count - 1) * row_stride)[:, None] + offs_d[None, :])


@triton.jit
def _add_rows(block, value, offs_q, offs_d, row_stride, count):
    """``rows += value`` for the first ``count`` rows, which only this program writes (a
    copy's dQ, zero-initialised)."""
    ptrs = block + (offs_q * row_stride)[:, None] + offs_d[None, :]
    mask = (offs_q < count)[:, None]
    old = tl.load(ptrs, mask=mask, other=0.0)
    tl.store(ptrs, (old.to(tl.float32) + value).to(block.dtype.element_ty), mask=mask)


@triton.jit
def _fwd_block(acc, m_i, l_i, q, k_head, v_head, kb, start, dil, rows, lo, hi, step, shi, sk_n, sv_n, qk_scale,
               offs_k, offs_d, BLOCK_K: tl.constexpr, MASKED: tl.constexpr,
               STEPPED: tl.constexpr, SINKS: tl.constexpr, PRECISION: tl.constexpr):
    """One key block of the online softmax. Full blocks lie inside every real row's keys (so
    inside the sequence): no mask; partial ones mask keys past the end and outside the rows'
    progressions and sinks (``shi``: each row's last sink, -1 for none)."""
    first = (start + dil * kb * BLOCK_K).to(tl.int64)
    kt_ptrs = k_head + first * sk_n + (offs_k * (dil * sk_n))[None, :] + offs_d[:, None]
    v_ptrs = v_head + first * sv_n + (offs_k * (dil * sv_n))[:, None] + offs_d[None, :]
    t = kb * BLOCK_K + offs_k
    if MASKED:
        kt = tl.load(kt_ptrs, mask=(t < rows)[None, :], other=0.0)
        v = tl.load(v_ptrs, mask=(t < rows)[:, None], other=0.0)
    else:
        kt = tl.load(kt_ptrs)
        v = tl.load(v_ptrs)
    s = tl.dot(q, kt, input_precision=PRECISION) * qk_scale
    if MASKED:
        vis = (t[None, :] >= lo[:, None]) & (t[None, :] <= hi[:, None])
        if STEPPED:
            vis = vis & ((t[None, :] - lo[:, None]) % step[:, None] == 0)
        if SINKS:
            vis = vis | (t[None, :] <= shi[:, None])
        s = tl.where(vis, s, float("-inf"))
    return online_softmax_step(acc, m_i, l_i, s, v, PRECISION)


@triton.jit
def program_offsets(H, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr):
    """A query-block-major program's (query block, batch, head) from its ids (grid: query
    blocks × batch·heads) and its tiles' row, key and head-dim offsets."""
    qb = tl.program_id(0)
    bh = tl.program_id(1)
    return (qb, (bh // H).to(tl.int64), bh % H, tl.arange(0, BLOCK_Q), tl.arange(0, BLOCK_K),
            tl.arange(0, BLOCK_D))


@triton.jit
def online_softmax_step(acc, m_i, l_i, s, v, PRECISION: tl.constexpr):
    """The online softmax over one more key block: scores ``s`` (base-2 logits, -inf where a
    row does not see a key) and its values ``v``; returns the new (acc, max, sum)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen nothing yet
    p = tl.exp2(s - m_use[:, None])
    alpha = tl.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return acc, m_new, l_i


@triton.jit
def online_softmax_start(BLOCK_Q: tl.constexpr, BLOCK_D: tl.constexpr):
    """An online softmax's state before its first key block: the fp32 output accumulator,
    each row's running maximum (-inf) and its running sum of exponentials."""
    return (tl.zeros([BLOCK_Q, BLOCK_D], dtype=tl.float32), tl.full([BLOCK_Q], float("-inf"), dtype=tl.float32),
            tl.zeros([BLOCK_Q], dtype=tl.float32))


@triton.jit
def _list(part: tl.constexpr, FULL_N, FULL_R, FULL_V, WIDTH_F, PART_N, PART_R, PART_V, WIDTH_P):
    """One of a block's two run lists, picked at compile time: its counts, runs, query
    variants and width (part 0: the FULL runs, unmasked; part 1: the PART runs, masked)."""
    if part == 0:
        count, runs, variants, width = FULL_N, FULL_R, FULL_V, WIDTH_F
    else:
        count, runs, variants, width = PART_N, PART_R, PART_V, WIDTH_P
    return count, runs, variants, width


@triton.jit
def _query_block(STRIDE, START, ROWS, LO, HI, STEP, SINK, R, h, qb, offs_q, BLOCK_Q: tl.constexpr):
    """Query block ``qb`` of head ``h``, as the forward and dQ kernels both read it: the head's
    rows, dilation and start, the block's first position, which of its rows are real, each
    row's visible key range (``lo``, ``hi``, ``step``) from the layout and its last sink
    token ``shi`` (-1: none; a head with sinks is uncompressed, so row m is position m)."""
    rows = tl.load(ROWS + h)
    dil = tl.load(STRIDE + h)
    start = tl.load(START + h)
    m = qb * BLOCK_Q + offs_q
    real = m < rows
    first = (start + dil * qb * BLOCK_Q).to(tl.int64)  # the block's first position
    lo = tl.load(LO + h * R + m, mask=real, other=0)
    hi = tl.load(HI + h * R + m, mask=real, other=-1)
    step = tl.load(STEP + h * R + m, mask=real, other=1)
    shi = tl.where(real, tl.minimum(tl.load(SINK + h), m + 1) - 1, -1)
    return rows, dil, start, first, real, lo, hi, step, shi


@triton.jit
def _fwd_kernel(Q, K, V, O, LSE,
                sq_v, sq_b, sq_h, sq_n, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n, so_b, so_h, so_n,
                STRIDE, START, ROWS, LO, HI, STEP, SINK, R,
                FULL_N, FULL_R, FULL_V, PART_N, PART_R, PART_V, NQB, WIDTH_F, WIDTH_P,
                H, N, GROUPS, qk_scale,
                BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
                STEPPED: tl.constexpr, SINKS: tl.constexpr, VARIANTS: tl.constexpr, PRECISION: tl.constexpr):
    qb, b, h, offs_q, offs_k, offs_d = program_offsets(H, BLOCK_Q, BLOCK_K, BLOCK_D)
    rows, dil, start, first, real, lo, hi, step, shi = _query_block(STRIDE, START, ROWS, LO, HI, STEP, SINK, R, h, qb,
                                                                    offs_q, BLOCK_Q)
    io_mask = real[:, None]
    q_block = Q + b * sq_b + h * sq_h + first * sq_n
    if VARIANTS == 1:
        q = _rows(q_block, offs_q, offs_d, dil * sq_n, io_mask)
    kvh = h // GROUPS
    k_head = K + b * sk_b + kvh * sk_h
    v_head = V + b * sv_b + kvh * sv_h
    acc, m_i, l_i = online_softmax_start(BLOCK_Q, BLOCK_D)
    entry = h * NQB + qb
    for part in tl.static_range(2):  # the FULL runs, then the PART (masked) runs
        count, runs, variants, width = _list(part, FULL_N, FULL_R, FULL_V, WIDTH_F, PART_N, PART_R, PART_V, WIDTH_P)
        for r in range(tl.load(count + entry)):
            run = runs + (entry * width + r) * 2
            if VARIANTS > 1:  # the run's copy of q
                q = _run_rows(q_block + tl.load(variants + entry * width + r).to(tl.int64) * sq_v, offs_q, offs_d,
                              dil * sq_n, rows - qb * BLOCK_Q)
            for kb in range(tl.load(run), tl.load(run + 1) + 1):
                acc, m_i, l_i = _fwd_block(acc, m_i, l_i, q, k_head, v_head, kb, start, dil, rows, lo, hi, step, shi,
                                           sk_n, sv_n, qk_scale, offs_k, offs_d, BLOCK_K, part == 1, STEPPED, SINKS,
                                           PRECISION)
    empty = l_i == 0.0  # rows that see no key: output 0, LSE +inf (so the backward's p is 0)
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    tl.store(O + b * so_b + h * so_h + first * so_n + (offs_q * (dil * so_n))[:, None] + offs_d[None, :],
             out.to(O.dtype.element_ty), mask=io_mask)
    lse = tl.where(empty, float("inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
    tl.store(LSE + (b * H + h) * N + first + offs_q * dil, lse, mask=real)


@triton.jit
def _delta_kernel(O, DO, DELTA, so_b, so_h, so_n, sd_b, sd_h, sd_n, H, N,
                  BLOCK: tl.constexpr, BLOCK_D: tl.constexpr):
    """Row sums of O·dO in fp32, per position (the softmax backward's correction term)."""
    first = (tl.program_id(0) * BLOCK).to(tl.int64)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = bh % H
    offs = tl.arange(0, BLOCK)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (first + offs < N)[:, None]
    o = tl.load(O + b * so_b + h * so_h + first * so_n + (offs * so_n)[:, None] + offs_d[None, :], mask=mask, other=0.0)
    do = tl.load(DO + b * sd_b + h * sd_h + first * sd_n + (offs * sd_n)[:, None] + offs_d[None, :], mask=mask, other=0.0)
    tl.store(DELTA + (b * H + h) * N + first + offs, tl.sum(o.to(tl.float32) * do.to(tl.float32), 1), mask=first + offs < N)


@triton.jit
def _dq_block(dq, q, do, lse, delta, k_head, v_head, kb, start, dil, rows, lo, hi, step, shi, sk_n, sv_n, qk_scale,
              offs_k, offs_d, BLOCK_K: tl.constexpr, MASKED: tl.constexpr,
              STEPPED: tl.constexpr, SINKS: tl.constexpr, PRECISION: tl.constexpr):
    first = (start + dil * kb * BLOCK_K).to(tl.int64)
    kt_ptrs = k_head + first * sk_n + (offs_k * (dil * sk_n))[None, :] + offs_d[:, None]
    vt_ptrs = v_head + first * sv_n + (offs_k * (dil * sv_n))[None, :] + offs_d[:, None]
    t = kb * BLOCK_K + offs_k
    if MASKED:
        kt = tl.load(kt_ptrs, mask=(t < rows)[None, :], other=0.0)
        vt = tl.load(vt_ptrs, mask=(t < rows)[None, :], other=0.0)
    else:
        kt = tl.load(kt_ptrs)
        vt = tl.load(vt_ptrs)
    p = tl.exp2(tl.dot(q, kt, input_precision=PRECISION) * qk_scale - lse[:, None])
    if MASKED:
        vis = (t[None, :] >= lo[:, None]) & (t[None, :] <= hi[:, None])
        if STEPPED:
            vis = vis & ((t[None, :] - lo[:, None]) % step[:, None] == 0)
        if SINKS:
            vis = vis | (t[None, :] <= shi[:, None])
        p = tl.where(vis, p, 0.0)
    dp = tl.dot(do, vt, input_precision=PRECISION)
    ds = p * (dp - delta[:, None])
    dq += tl.dot(ds.to(kt.dtype), tl.trans(kt), input_precision=PRECISION)
    return dq


@triton.jit
def _dq_kernel(Q, K, V, DO, DQ, LSE, DELTA,
               sq_v, sq_b, sq_h, sq_n, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n, sd_b, sd_h, sd_n,
               sdq_v, sdq_b, sdq_h, sdq_n,
               STRIDE, START, ROWS, LO, HI, STEP, SINK, R,
               FULL_N, FULL_R, FULL_V, PART_N, PART_R, PART_V, NQB, WIDTH_F, WIDTH_P,
               H, N, GROUPS, qk_scale, sm_scale,
               BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
               STEPPED: tl.constexpr, SINKS: tl.constexpr, VARIANTS: tl.constexpr, PRECISION: tl.constexpr):
    """dQ of one (batch, head, query block), over the forward's lists; with variants, ``dq``
    holds copy ``held``'s share and is added into its gradient when the runs' copy changes."""
    qb, b, h, offs_q, offs_k, offs_d = program_offsets(H, BLOCK_Q, BLOCK_K, BLOCK_D)
    rows, dil, start, first, real, lo, hi, step, shi = _query_block(STRIDE, START, ROWS, LO, HI, STEP, SINK, R, h, qb,
                                                                    offs_q, BLOCK_Q)
    io_mask = real[:, None]
    q_block = Q + b * sq_b + h * sq_h + first * sq_n
    dq_block = DQ + b * sdq_b + h * sdq_h + first * sdq_n
    if VARIANTS == 1:
        q = _rows(q_block, offs_q, offs_d, dil * sq_n, io_mask)
    do = tl.load(DO + b * sd_b + h * sd_h + first * sd_n + (offs_q * (dil * sd_n))[:, None] + offs_d[None, :],
                 mask=io_mask, other=0.0)
    rowwise = (b * H + h) * N + first + offs_q * dil
    lse = tl.load(LSE + rowwise, mask=real, other=float("inf"))
    delta = tl.load(DELTA + rowwise, mask=real, other=0.0)
    kvh = h // GROUPS
    k_head = K + b * sk_b + kvh * sk_h
    v_head = V + b * sv_b + kvh * sv_h
    dq = tl.zeros([BLOCK_Q, BLOCK_D], dtype=tl.float32)
    entry = h * NQB + qb
    held = tl.where(tl.load(FULL_N + entry) > 0, tl.load(FULL_V + entry * WIDTH_F), tl.load(PART_V + entry * WIDTH_P))
    for part in tl.static_range(2):  # the FULL runs, then the PART (masked) runs
        count, runs, variants, width = _list(part, FULL_N, FULL_R, FULL_V, WIDTH_F, PART_N, PART_R, PART_V, WIDTH_P)
        for r in range(tl.load(count + entry)):
            run = runs + (entry * width + r) * 2
            if VARIANTS > 1:
                var = tl.load(variants + entry * width + r)
                if var != held:
                    _add_rows(dq_block + held.to(tl.int64) * sdq_v, dq * sm_scale, offs_q, offs_d, dil * sdq_n,
                              rows - qb * BLOCK_Q)
                    dq = tl.zeros([BLOCK_Q, BLOCK_D], dtype=tl.float32)
                    held = var
                q = _run_rows(q_block + var.to(tl.int64) * sq_v, offs_q, offs_d, dil * sq_n, rows - qb * BLOCK_Q)
            for kb in range(tl.load(run), tl.load(run + 1) + 1):
                dq = _dq_block(dq, q, do, lse, delta, k_head, v_head, kb, start, dil, rows, lo, hi, step, shi, sk_n, sv_n,
                               qk_scale, offs_k, offs_d, BLOCK_K, part == 1, STEPPED, SINKS, PRECISION)
    if VARIANTS > 1:
        _add_rows(dq_block + held.to(tl.int64) * sdq_v, dq * sm_scale, offs_q, offs_d, dil * sdq_n, rows - qb * BLOCK_Q)
    else:
        tl.store(dq_block + (offs_q * (dil * sdq_n))[:, None] + offs_d[None, :], (dq * sm_scale).to(DQ.dtype.element_ty),
                 mask=io_mask)


@triton.jit
def _dkv_block(dk, dv, k, v, q_head, do_head, rowwise, qb, t, start, dil, rows, lo_row, hi_row, step_row, sink,
               sq_n, sd_n, qk_scale, offs_q, offs_d, BLOCK_Q: tl.constexpr, MASKED: tl.constexpr,
               STEPPED: tl.constexpr, SINKS: tl.constexpr, PRECISION: tl.constexpr):
    """One query block's contribution to a key block's dK/dV (transposed: keys are rows);
    ``sink``: the head's sink tokens (its rows are positions then)."""
    m = qb * BLOCK_Q + offs_q
    real = m < rows
    io_mask = real[:, None]
    first = (start + dil * qb * BLOCK_Q).to(tl.int64)
    q = tl.load(q_head + first * sq_n + (offs_q * (dil * sq_n))[:, None] + offs_d[None, :], mask=io_mask, other=0.0)
    do = tl.load(do_head + first * sd_n + (offs_q * (dil * sd_n))[:, None] + offs_d[None, :], mask=io_mask, other=0.0)
    lse = tl.load(rowwise[0] + first + offs_q * dil, mask=real, other=float("inf"))
    delta = tl.load(rowwise[1] + first + offs_q * dil, mask=real, other=0.0)
    pt = tl.exp2(tl.dot(k, tl.trans(q), input_precision=PRECISION) * qk_scale - lse[None, :])
    if MASKED:
        lo = tl.load(lo_row + m, mask=real, other=0)
        hi = tl.load(hi_row + m, mask=real, other=-1)
        vis = (t[:, None] >= lo[None, :]) & (t[:, None] <= hi[None, :])
        if STEPPED:
            step = tl.load(step_row + m, mask=real, other=1)
            vis = vis & ((t[:, None] - lo[None, :]) % step[None, :] == 0)
        if SINKS:
            vis = vis | (t[:, None] <= (tl.minimum(sink, m + 1) - 1)[None, :])
        pt = tl.where(vis, pt, 0.0)
    dv += tl.dot(pt.to(do.dtype), do, input_precision=PRECISION)
    dpt = tl.dot(v, tl.trans(do), input_precision=PRECISION)
    dst = pt * (dpt - delta[None, :])
    dk += tl.dot(dst.to(q.dtype), q, input_precision=PRECISION)
    return dk, dv


@triton.jit
def _dkv_kernel(Q, K, V, DO, DK, DV, LSE, DELTA,
                sq_v, sq_b, sq_h, sq_n, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n, sd_b, sd_h, sd_n,
                sdk_b, sdk_h, sdk_n, sdv_b, sdv_h, sdv_n,
                UNIT_HEADS, UNIT_COUNT, UNIT_KV, UNIT_OUT, U, UNIT_WIDTH,
                STRIDE, START, ROWS, LO, HI, STEP, SINK, R,
                FULL_N, FULL_R, FULL_V, PART_N, PART_R, PART_V, NKB, WIDTH_F, WIDTH_P,
                H, N, qk_scale, sm_scale,
                BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
                STEPPED: tl.constexpr, SINKS: tl.constexpr, VARIANTS: tl.constexpr, PRECISION: tl.constexpr):
    """dK/dV of one (batch, unit, key block): the unit's query heads, each over its transposed
    lists, accumulated in registers and stored once at the unit's output head."""
    kb = tl.program_id(0)
    bu = tl.program_id(1)
    b = (bu // U).to(tl.int64)
    u = bu % U
    lead = tl.load(UNIT_HEADS + u * UNIT_WIDTH)
    rows = tl.load(ROWS + lead)
    dil = tl.load(STRIDE + lead)
    start = tl.load(START + lead)
    kvh = tl.load(UNIT_KV + u)
    offs_q = tl.arange(0, BLOCK_Q)
    offs_k = tl.arange(0, BLOCK_K)
    offs_d = tl.arange(0, BLOCK_D)
    t = kb * BLOCK_K + offs_k
    io_mask = (t < rows)[:, None]
    first = (start + dil * kb * BLOCK_K).to(tl.int64)
    k = tl.load(K + b * sk_b + kvh * sk_h + first * sk_n + (offs_k * (dil * sk_n))[:, None] + offs_d[None, :],
                mask=io_mask, other=0.0)
    v = tl.load(V + b * sv_b + kvh * sv_h + first * sv_n + (offs_k * (dil * sv_n))[:, None] + offs_d[None, :],
                mask=io_mask, other=0.0)
    dk = tl.zeros([BLOCK_K, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_K, BLOCK_D], dtype=tl.float32)
    for g in range(tl.load(UNIT_COUNT + u)):
        h = tl.load(UNIT_HEADS + u * UNIT_WIDTH + g)
        q_head = Q + b * sq_b + h * sq_h
        do_head = DO + b * sd_b + h * sd_h
        rowwise = (LSE + (b * H + h) * N, DELTA + (b * H + h) * N)
        sink = tl.load(SINK + h)
        entry = h * NKB + kb
        for part in tl.static_range(2):  # the FULL runs, then the PART (masked) runs
            count, runs, variants, width = _list(part, FULL_N, FULL_R, FULL_V, WIDTH_F, PART_N, PART_R, PART_V, WIDTH_P)
            for r in range(tl.load(count + entry)):
                run = runs + (entry * width + r) * 2
                q_run = q_head
                if VARIANTS > 1:
                    q_run = q_head + tl.load(variants + entry * width + r).to(tl.int64) * sq_v
                for qb in range(tl.load(run), tl.load(run + 1) + 1):
                    dk, dv = _dkv_block(dk, dv, k, v, q_run, do_head, rowwise, qb, t, start, dil, rows,
                                        LO + h * R, HI + h * R, STEP + h * R, sink, sq_n, sd_n, qk_scale, offs_q, offs_d,
                                        BLOCK_Q, part == 1, STEPPED, SINKS, PRECISION)
    out = tl.load(UNIT_OUT + u)
    tl.store(DK + b * sdk_b + out * sdk_h + first * sdk_n + (offs_k * (dil * sdk_n))[:, None] + offs_d[None, :],
             (dk * sm_scale).to(DK.dtype.element_ty), mask=io_mask)
    tl.store(DV + b * sdv_b + out * sdv_h + first * sdv_n + (offs_k * (dil * sdv_n))[:, None] + offs_d[None, :],
             dv.to(DV.dtype.element_ty), mask=io_mask)


# --- launch -----------------------------------------------------------------------------------


def _units(layout: BlockLayout, groups: int) -> dict[str, Any]:
    """The dK/dV kernel's units for K/V groups of ``groups`` heads (see the module docstring),
    cached on the layout: ``heads`` (U, G) padded, ``count``, ``kv`` (the K/V head), ``out``
    (the head of the tensor the unit stores into) and ``direct`` (stores into dK/dV as is)."""
    key = ("units", groups)
    if key not in layout.cache:
        views = list(zip(layout.stride.tolist(), layout.start.tolist()))
        units: list[tuple[int, list[int]]] = []
        direct = True
        for kvh in range(layout.num_heads // groups):
            mine: dict[tuple[int, int], list[int]] = {}
            for h in range(kvh * groups, (kvh + 1) * groups):
                mine.setdefault(views[h], []).append(h)
            direct &= len({stride for stride, _ in mine}) == 1 and (len(mine) == 1 or min(s for s, _ in mine) > 1)
            units += [(kvh, heads) for heads in mine.values()]
        width = max(len(heads) for _, heads in units)
        table = torch.zeros(len(units), width, dtype=torch.int32)
        for u, (_, heads) in enumerate(units):
            table[u, : len(heads)] = torch.tensor(heads, dtype=torch.int32)
        kv = torch.tensor([kvh for kvh, _ in units], dtype=torch.int32)
        device = layout.device
        layout.cache[key] = dict(heads=table.to(device), count=torch.tensor([len(h) for _, h in units], dtype=torch.int32).to(device),
                                 kv=kv.to(device), out=(kv if direct else torch.arange(len(units), dtype=torch.int32)).to(device),
                                 kv_index=kv.long().to(device), direct=direct, width=width, size=len(units))
    return layout.cache[key]


def _strides(x: torch.Tensor) -> tuple[int, ...]:
    """Strides of every dim but the last (unit) one: (b, h, n), or (v, b, h, n) for q copies."""
    return x.stride()[:-1]


def _launch(q: torch.Tensor) -> dict[str, Any]:
    """fp32 runs IEEE dots (TF32 would lose the fp32 exactness the tests hold it to)."""
    return dict(BLOCK_D=q.shape[-1], PRECISION="ieee" if q.dtype == torch.float32 else "tf32")


def _lists(layout: BlockLayout, transposed: bool) -> tuple:
    """The layout's rows and its runs with their variants (per query block, or transposed per
    key block)."""
    kind = "_q" if transposed else ""
    f_n, f_r, f_v = (getattr(layout, f"full{kind}_run{x}") for x in ("_counts", "s", "_variants"))
    p_n, p_r, p_v = (getattr(layout, f"partial{kind}_run{x}") for x in ("_counts", "s", "_variants"))
    return (layout.stride, layout.start, layout.rows, layout.lo, layout.hi, layout.step, layout.sinks, layout.lo.shape[1],
            f_n, f_r, f_v, p_n, p_r, p_v, f_n.shape[1], f_r.shape[2], p_r.shape[2])


def _flags(layout: BlockLayout, tile: Tiles) -> dict[str, Any]:
    return dict(BLOCK_Q=tile.block_q, BLOCK_K=tile.block_k, STEPPED=layout.stepped, SINKS=layout.sunk, VARIANTS=layout.variants,
                num_warps=tile.warps, num_stages=tile.stages)


Layouts = Callable[[Tiles], BlockLayout]  # the layout a kernel runs from, for its tile


def _forward(q, k, v, layout: BlockLayout, *, tile: Tiles, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    copies, b, h, n, d = q.shape
    if layout.variants > copies:
        raise ValueError(f"block-sparse kernel: the layout's runs choose among {layout.variants} copies of q, got {copies}")
    out = torch.zeros_like(q[0]) if layout.compressed else torch.empty_like(q[0])
    lse = torch.empty(b, h, n, dtype=torch.float32, device=q.device)
    _fwd_kernel[(layout.num_q_blocks, b * h)](
        q, k, v, out, lse, *_strides(q), *_strides(k), *_strides(v), *_strides(out), *_lists(layout, False),
        h, n, h // k.shape[1], LOG2E * scale, **_flags(layout, tile), **_launch(q))
    return out, lse


def _backward(q, k, v, out, *, lse, dout, layouts: Layouts, kernel_tiles: tuple[Tiles, Tiles, Tiles],
              scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _, b, h, n, d = q.shape
    hkv = k.shape[1]
    launch = _launch(q)
    qk_scale, sm_scale = LOG2E * scale, scale
    delta = torch.empty(b, h, n, dtype=torch.float32, device=q.device)
    _delta_kernel[(triton.cdiv(n, 64), b * h)](out, dout, delta, *_strides(out), *_strides(dout), h, n,
                                              BLOCK=64, BLOCK_D=d)
    _, tile, dkv_tile = kernel_tiles
    layout = layouts(tile)
    dq = torch.zeros_like(q) if layout.compressed or layout.variants > 1 else torch.empty_like(q)
    _dq_kernel[(layout.num_q_blocks, b * h)](
        q, k, v, dout, dq, lse, delta, *_strides(q), *_strides(k), *_strides(v), *_strides(dout), *_strides(dq),
        *_lists(layout, False), h, n, h // hkv, qk_scale, sm_scale, **_flags(layout, tile), **launch)
    layout, tile = layouts(dkv_tile), dkv_tile
    units = _units(layout, h // hkv)
    if units["direct"]:
        dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    else:
        dk, dv = (torch.zeros(b, units["size"], n, d, dtype=torch.float32, device=q.device) for _ in range(2))
    _dkv_kernel[(layout.num_k_blocks, b * units["size"])](
        q, k, v, dout, dk, dv, lse, delta, *_strides(q), *_strides(k), *_strides(v), *_strides(dout),
        *_strides(dk), *_strides(dv), units["heads"], units["count"], units["kv"], units["out"], units["size"],
        units["width"], *_lists(layout, True), h, n, qk_scale, sm_scale, **_flags(layout, tile), **launch)
    if not units["direct"]:  # overlapping units of one K/V head: summed here, in fp32
        dk, dv = (torch.zeros(b, hkv, n, d, dtype=torch.float32, device=q.device).index_add_(1, units["kv_index"], x).to(k.dtype)
                  for x in (dk, dv))
    return dq, dk, dv


class _BlockSparseAttention(torch.autograd.Function):
    """Saves q (its copies), k, v, the output and its LSE (base 2, per position; +inf where a
    row sees nothing); the layouts come from ``layouts`` (cached by whoever builds them)."""

    @staticmethod
    def forward(ctx, q, k, v, layouts, kernel_tiles, scale):
        tile = kernel_tiles[0]
        out, lse = _forward(q, k, v, layouts(tile), tile=tile, scale=scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.layouts, ctx.tiles, ctx.scale = layouts, kernel_tiles, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _backward(q, k, v, out, lse=lse, dout=_unit_last(dout), layouts=ctx.layouts, kernel_tiles=ctx.tiles,
                               scale=ctx.scale)
        return dq, dk, dv, None, None, None


def _unit_last(x: torch.Tensor) -> torch.Tensor:
    """The kernels step rows by strides but read a row's elements contiguously."""
    return x if x.stride(-1) == 1 else x.contiguous()


def block_sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layouts: Layouts, *, scale: float,
                           period: Optional[int] = None) -> torch.Tensor:
    """Attention of q ``(V, B, H, N, D)`` (V copies of the queries; a layout's runs pick one
    each, see the module docstring) to k/v ``(B, Hkv, N, D)`` from ``layouts(tile)``, softmax
    scale ``scale``; ``period``: every block must lie in one chunk of that many positions
    (:func:`tiles`). Differentiable in all of q's copies, k and v; checked by the caller's
    backend resolution before. Under autocast it computes in the autocast dtype (as SDPA
    does), else in q's dtype. A head dim that is no power of two >= 16 (what ``tl.dot`` and
    ``tl.arange`` take) is zero-padded to one: zeros add nothing to q·k, and the padded
    output columns are dropped."""
    device = q.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else q.dtype
    why = triton_unsupported(device, dtype, q.shape[-1]) if dtype != q.dtype else None
    if why is not None:
        raise ValueError(f"backend='triton' cannot run here under autocast: {why}; use backend='sdpa'")
    d = q.shape[-1]
    width = max(MIN_BLOCK, triton.next_power_of_2(d))
    q, k, v = (_unit_last(F.pad(x.to(dtype), (0, width - d)) if width != d else x.to(dtype)) for x in (q, k, v))
    out = _BlockSparseAttention.apply(q, k, v, layouts, tiles(q, period), scale)
    return out[..., :d] if width != d else out


def triton_forward(pattern: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``pattern`` on q (B, H, N, D), k/v (B, Hkv, N, D) through the block-sparse kernel (one
    copy of q), scale 1/sqrt(D); checked by :func:`attn_patterns.kernels.resolve_backend`."""
    n, heads, device = q.shape[2], q.shape[1], q.device

    def layouts(tile: Tiles) -> BlockLayout:
        return block_layout(pattern, n, heads, block_q=tile.block_q, block_k=tile.block_k, strided=True, device=device)

    return block_sparse_attention(q.unsqueeze(0), k, v, layouts, scale=1.0 / math.sqrt(q.shape[-1]))
