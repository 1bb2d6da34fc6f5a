"""LongHeads (Lu et al., 2024): every head attends to k chunks of l tokens it picks itself.

Why it works without training: each head sees at most ``k·l`` tokens, all at positions it
saw in pretraining, yet different heads (and layers) pick different chunks, so together
they read a context many times longer. Per head and query token at position p (chunk
m = p // l):

* chunk representations (paper eqs. 1–2): for every *complete* chunk i,
  ``O_i = attn(Q_i, K_i, V_i)`` bidirectional inside the chunk, ``q_i^c = mean(O_i)``,
  ``c_i = attn(q_i^c, K_i, K_i)``: an attention-weighted pooling of the chunk's keys.
  RoPE inside this computation is chunk-local (positions 0..l-1), as in the authors' code,
  so a chunk's representation does not depend on where it sits;
* selection (eq. 3): the first chunk (attention sink) and the query's own chunk (the local
  one, causal) always; the other ``k-2`` are the top-scoring complete chunks among
  ``1..m-1`` by ``q_p · c_i`` (``q_p`` without RoPE, as in the authors' code);
* position remapping: the selected chunks are concatenated in their original order and
  re-positioned contiguously inside ``[0, k·l)``. RoPE only sees relative distances, so
  instead of re-rotating keys per query, keys are rotated once to chunk-local positions and
  the (already rotated) query once per selected slot, in fp32 with the model's ``inv_freq``.

Within ``k·l`` tokens every earlier chunk is selected and every shift is 0: LongHeads is
then exactly causal attention, one call. Beyond it every row keeps exactly k-1 earlier chunks,
so the work per row is fixed; rows run in steps of whole chunks (:func:`_plan`, memory
independent of N, nothing N×N), each step a selection (:func:`choose_chunks`) and an attention
over what was chosen (:func:`attend_chosen`). The chosen chunks' keys are gathered once per
(batch, KV head, chunk) and step, shared by every query head and row that chose the chunk.

Decoding with a KV cache needs the queries of the chunk being filled (the cache keeps
only keys/values), so each attention layer keeps a small state: the representations of
complete chunks and the queries since the last complete chunk (paper §2.4).
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from attn_patterns.algorithm import Algorithm, register
from attn_patterns.checks import check_int
from attn_patterns.kernels import LSE_BACKENDS, attend_lse, lse_backend
from attn_patterns.rotary import rotate as rerotate

# Upper bound (estimated by _plan, about twice what a step holds) on the elements of one step's
# tensors: memory independent of N. A step is a few dozen tensor ops whatever its size, so larger
# steps mean less overhead (on a shared CPU each parallel op can wait for a descheduled thread);
# a GPU takes more per step (its steps are short, each costs kernel launches and two syncs): at
# 32k tokens of 32 heads of 128, 14 steps of 2,048 rows.
_BLOCK_ELEMENTS = 1 << 26
_CUDA_BLOCK_ELEMENTS = 1 << 30
# _plan's cost of one (row, head, chosen chunk) pair: vectors of D (the gathered and rotated
# query, its tile row, the piece's output and its gather, the merge) and int64 indices
_PAIR_VECTORS = 8
_PAIR_INDICES = 8
# Tiles: at most _TILE_ROWS pairs share one gathered chunk of K/V in a fused call; a tile costs
# about _TILE_COST pairs more (the chunk's copy, the kernel's work per tile: on the CPU's fused
# kernel, D = 64, l = 256, tiles of 1024 rows ran as fast as causal attention with as many
# scores, tiles of 256 rows 20 % slower)
_TILE_ROWS = 1024
_TILE_COST = 128

Gather = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def chunk_representations(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, chunk_size: int, first_chunk: int,
    inv_freq: Optional[torch.Tensor],
) -> torch.Tensor:
    """Eqs. 1–2 for whole chunks: q (B,H,M·l,D) and k/v (B,Hkv,M·l,D) rotated at their true
    positions, chunk ``first_chunk`` first, l = ``chunk_size``. Returns c (B,H,M,D) in fp32.

    Inside a chunk RoPE only sees distances, so eq. 1 runs on q and k as they are; eq. 2
    averages the keys themselves, which are therefore moved to chunk-local positions. Both
    attentions see every key, so each KV group's query heads fold into one block of rows
    (chunks folded into the batch): no copy of K/V per query head."""
    b, h, n, d = q.shape
    hkv, count = k.shape[1], n // chunk_size
    starts = (torch.arange(count, device=q.device) + first_chunk) * chunk_size
    local = -starts.repeat_interleave(chunk_size)  # chunk-local RoPE: positions 0..l-1

    def fold(x: torch.Tensor) -> torch.Tensor:  # (B,X,M·l,D) -> (B·M, X, l, D)
        return x.float().unflatten(2, (count, chunk_size)).transpose(1, 2).reshape(b * count, x.shape[1], chunk_size, d)

    queries = fold(q).reshape(b * count, hkv, h // hkv * chunk_size, d)  # a KV group's heads, one after the other
    pooled = F.scaled_dot_product_attention(queries, fold(k), fold(v)).unflatten(2, (h // hkv, chunk_size)).mean(-2)  # q_i^c
    keys = fold(rerotate(k, local, inv_freq))
    reps = F.scaled_dot_product_attention(pooled, keys, keys)  # (B·M, Hkv, groups, D)
    return reps.reshape(b, count, h, d).transpose(1, 2)


@register
class LongHeads(Algorithm):
    """Per-head chunk selection with position remapping: chunk size l (paper: 256) and k
    chunks per head, first and local included (default: as many as fit the pretraining
    length, k = L // l; the paper's 4k Llama-2 runs use k·l = 2k or 4k). ``keep_previous``
    (default, as the authors' code does) also forces the chunk before the query's own;
    ``keep_previous=False`` is the paper's text (first and own chunk only). ``backend``: the
    attention kernel (default automatic; ``"triton"``: the one-kernel path on CUDA, named only)."""

    name = "longheads"

    def __init__(
        self, chunk_size: int = 256, chunks: Optional[int] = None, pretraining_length: Optional[int] = None,
        *, keep_previous: bool = True, backend: Optional[str] = None,
    ) -> None:
        check_int("chunk_size", chunk_size, self.name)
        if backend is not None and backend not in LSE_BACKENDS:
            raise ValueError(f"{self.name}: backend={backend!r} is unknown; allowed: {', '.join(LSE_BACKENDS)} or None "
                             "(automatic)")
        if not isinstance(keep_previous, bool):
            raise ValueError(f"{self.name}: keep_previous={keep_previous!r} must be true or false")
        least = 3 if keep_previous else 2
        if chunks is not None:
            check_int("chunks", chunks, self.name)
            if chunks < least:
                raise ValueError(
                    f"{self.name}: chunks={chunks} must be >= {least} (the first, "
                    f"{'the previous ' if keep_previous else ''}and the local chunk are always kept)"
                )
        if pretraining_length is not None:
            check_int("pretraining_length", pretraining_length, self.name)
        super().__init__(chunk_size=chunk_size, chunks=chunks, pretraining_length=pretraining_length, keep_previous=keep_previous,
                         backend=backend)
        self.backend = backend
        self.keep_previous = keep_previous
        self.chunk_size = chunk_size
        self.chunks = chunks
        self.pretraining_length = pretraining_length
        if pretraining_length is not None:
            self.window(pretraining_length)

    def window(self, pretraining_length: int) -> int:
        """k for a model pretrained on ``pretraining_length`` tokens; k·l must fit in it."""
        size = self.chunk_size
        chunks = self.chunks if self.chunks is not None else pretraining_length // size
        least = 3 if self.keep_previous else 2
        if chunks < least or chunks * size > pretraining_length:
            raise ValueError(
                f"{self.name}: chunks={chunks} × chunk_size={size} = {chunks * size} must be <= pretraining_length="
                f"{pretraining_length} with chunks >= {least}; lower chunk_size or chunks"
            )
        return chunks

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
               inv_freq: Optional[torch.Tensor], backend: Optional[str] = None) -> torch.Tensor:
        """Whole-sequence LongHeads of q, k rotated at positions 0..N-1 with ``inv_freq``."""
        if self.chunks is None and self.pretraining_length is None:
            raise ValueError(f"{self.name}: pass chunks= or pretraining_length= to know k")
        chunks = self.chunks or self.window(self.pretraining_length)
        n, size = q.shape[2], self.chunk_size
        scored = (n - 1) // size * size if n > chunks * size else 0  # the chunks a row beyond the window can choose
        reps = chunk_representations(q[:, :, :scored], k[:, :, :scored], v[:, :, :scored], chunk_size=size, first_chunk=0,
                                     inv_freq=inv_freq)
        return longheads_attention(q, k, v, reps=reps, chunk_size=self.chunk_size, chunks=chunks, inv_freq=inv_freq,
                                   scale=1.0 / math.sqrt(q.shape[-1]), keep_previous=self.keep_previous,
                                   backend=backend or self.backend)


def select_chunks(scores: torch.Tensor, query_chunk: int | torch.Tensor, chunks: int,
                  keep_previous: bool = False) -> torch.Tensor:
    """Which chunks a query of chunk m = ``query_chunk`` attends besides its own, as a mask
    over the chunk ids of ``scores`` (..., C): chunk 0 (and chunk m-1 with ``keep_previous``)
    and the best of the other chunks in 1..m-1 by ``scores``, min(k-1, m) in all, k =
    ``chunks``. ``query_chunk`` is an int or a tensor broadcastable to ``scores.shape[:-1]``,
    so query blocks of different chunks are selected in one call."""
    ids = torch.arange(scores.shape[-1], device=scores.device)
    m = torch.as_tensor(query_chunk, device=scores.device).unsqueeze(-1)
    previous = (m >= 2) & keep_previous
    forced = ((ids == 0) & (m >= 1)) | (previous & (ids == m - 1))
    candidate = (ids >= 1) & (ids < m - previous.long())
    free = chunks - 1 - forced.sum(-1, keepdim=True)
    top = scores.masked_fill(~candidate, float("-inf")).topk(min(chunks - 2, scores.shape[-1]), dim=-1)
    # fewer candidates than free slots: the -inf picks are dropped, so every candidate is kept
    picked = (torch.arange(top.indices.shape[-1], device=scores.device) < free) & (top.values > float("-inf"))
    return torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, top.indices, picked) | forced


def longheads_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, reps: torch.Tensor, chunk_size: int, chunks: int,
    inv_freq: Optional[torch.Tensor], scale: float, keep_previous: bool = False, backend: Optional[str] = None,
) -> torch.Tensor:
    """LongHeads output (B,H,Nq,D) for the last Nq positions of Nk keys (rotated at their
    true positions): chunks of l = ``chunk_size`` tokens, k = ``chunks`` per head. ``reps``
    (B,H,>=M,D) are the complete chunks' representations.

    Rows inside the window k·l are causal attention (one call). Beyond it every row keeps
    exactly k-1 earlier chunks, and the rows run in steps of consecutive rows that
    :func:`_plan` sizes: per step :func:`choose_chunks` (the selection) then
    :func:`attend_chosen` (the attention over what was chosen), or with ``backend="triton"``
    (named, never automatic; no gradients) one kernel per step instead
    (:mod:`attn_patterns.longheads_triton`), the window on the automatic backend."""
    b, h, nq, d = q.shape
    nk = k.shape[2]
    start = nk - nq
    backend = lse_backend(backend, q, k, v, owner="longheads", block_sparse=backend == "triton")
    kernel = None
    if backend == "triton":
        from attn_patterns.longheads_triton import chosen_attention

        kernel = chosen_attention(q, k, v, chunk_size=chunk_size, inv_freq=inv_freq, scale=scale)
        backend = lse_backend(None, q, k, v, owner="longheads")
    out = torch.empty_like(q)
    window = min(nk, chunks * chunk_size)
    if start < window:  # every earlier chunk chosen and no position moved: causal attention
        rows = window - start
        out[:, :, :rows] = attend_lse(q[:, :, :rows], k[:, :, :window], v[:, :, :window], scale=scale,
                                      offset=start if rows > 1 else None, backend=backend, block=chunk_size)[0]
    steps = _plan(start=start, nk=nk, chunk_size=chunk_size, chunks=chunks, batch_heads=b * h, head_dim=d,
                  budget=_CUDA_BLOCK_ELEMENTS if q.is_cuda else _BLOCK_ELEMENTS)
    buffers = _Buffers(q, k, v, reps)
    if steps and kernel is None:  # prefill gathers more keys than exist: rotate them all once
        gather = _chunk_gather(k, v, chunk_size=chunk_size, inv_freq=inv_freq, buffers=buffers,
                               whole=(nk - steps[0][0]) * h * (chunks - 1) >= nk * k.shape[1])
    for first, last in steps:
        rows = q[:, :, first - start : last - start]
        chosen = choose_chunks(rows, reps, first=first, chunk_size=chunk_size, chunks=chunks, inv_freq=inv_freq,
                               keep_previous=keep_previous)
        if kernel is not None:
            kernel(rows, chosen, first, out[:, :, first - start : last - start])
            continue
        out[:, :, first - start : last - start] = attend_chosen(rows, k, v, chosen, first=first, chunk_size=chunk_size,
                                                                inv_freq=inv_freq, scale=scale, keep_previous=keep_previous,
                                                                backend=backend, gather=gather, buffers=buffers)
    return out


class _Buffers:
    """Flat tensors that the steps of one call write their large intermediates into (``out=``),
    one per role, grown when a step needs more. A fresh CPU tensor above glibc's mmap threshold
    is new memory, first touched page by page, and in a VM those page faults cost about as much
    as the copies themselves (a third of an 8k call when every step allocated afresh); the CUDA
    allocator caches, where this changes nothing. Off when ``tensors`` need gradients (``out=``
    does not differentiate): every role is then a fresh tensor."""

    def __init__(self, *tensors: torch.Tensor) -> None:
        self._flat: dict[str, torch.Tensor] = {}
        self._on = not (torch.is_grad_enabled() and any(x.requires_grad for x in tensors))

    def take(self, role: str, shape: tuple[int, ...], like: torch.Tensor) -> Optional[torch.Tensor]:
        """An uninitialised (``shape``) tensor of ``like``'s dtype and device for ``role`` to
        pass as ``out=``, or None (a fresh result) when off."""
        if not self._on:
            return None
        numel = math.prod(shape)
        flat = self._flat.get(role)
        if flat is None or flat.numel() < numel or flat.dtype != like.dtype:
            flat = self._flat[role] = torch.empty(numel, dtype=like.dtype, device=like.device)
        return flat[:numel].view(shape)


def _chunk_gather(k: torch.Tensor, v: torch.Tensor, *, chunk_size: int, inv_freq: Optional[torch.Tensor],
                  whole: bool, buffers: _Buffers) -> Gather:
    """``gather(batch, kv_head, chunk)`` -> keys in chunk-local RoPE (positions 0..l-1) and
    values, (E,l,D) in the input dtype, of complete chunks. ``whole``: rotate every complete
    chunk's keys once into a chunk-major copy (and copy the values so) and gather whole chunks
    as rows (into ``buffers``); otherwise (decoding) gather and rotate only what is asked, not
    the whole cache."""
    b, hkv, nk, d = k.shape
    count = nk // chunk_size
    keys, values = (x[:, :, : count * chunk_size] for x in (k, v))
    if whole:
        local = -(torch.arange(count * chunk_size, device=k.device) // chunk_size * chunk_size)
        keys, values = (x.reshape(b * hkv * count, chunk_size * d) for x in (rerotate(keys, local, inv_freq), values))

        def gather(batch: torch.Tensor, kv_head: torch.Tensor, chunk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            rows = (batch * hkv + kv_head) * count + chunk
            return tuple(torch.index_select(x, 0, rows, out=buffers.take(role, (len(rows), x.shape[1]), x))
                         .view(-1, chunk_size, d) for role, x in (("keys", keys), ("values", values)))

        return gather

    def gather(batch: torch.Tensor, kv_head: torch.Tensor, chunk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        index = (batch, kv_head, chunk)
        return (rerotate(keys.unflatten(2, (count, chunk_size))[index], -(chunk * chunk_size)[:, None], inv_freq),
                values.unflatten(2, (count, chunk_size))[index])

    return gather


def _plan(*, start: int, nk: int, chunk_size: int, chunks: int, batch_heads: int, head_dim: int,
          budget: Optional[int] = None) -> list[tuple[int, int]]:
    """Positions ``[first, last)`` of each step beyond the window (rows before k·l are causal
    attention, no step). Every row there keeps k-1 chunks, so a row costs the same at any
    length: per (head, chosen chunk) a few vectors of D (its re-rotated query, its piece's
    output, the merge) and 2·l·D / rows-per-tile of gathered keys and values, plus its
    selection scores over the earlier chunks. A step takes as many rows as ``budget``
    (elements) allows, so memory does not grow with N; steps start at chunk boundaries (but
    the first, when the call starts inside a chunk)."""
    first = max(start, chunks * chunk_size)
    per_row = batch_heads * ((chunks - 1) * (_PAIR_VECTORS * head_dim + _PAIR_INDICES) + 4 * ((nk - 1) // chunk_size))
    rows = max(1, (budget or _BLOCK_ELEMENTS) // per_row)
    if rows >= chunk_size:  # whole chunks: a step's own chunks are one square-causal call
        rows -= rows % chunk_size
    aligned = -(-first // chunk_size) * chunk_size
    starts = [first] * (first < min(aligned, nk)) + list(range(aligned, nk, rows))
    return list(zip(starts, [*starts[1:], nk]))


def choose_chunks(q: torch.Tensor, reps: torch.Tensor, *, first: int, chunk_size: int, chunks: int,
                  inv_freq: Optional[torch.Tensor], keep_previous: bool) -> torch.Tensor:
    """Selection (eq. 3) for query rows q (B,H,n,D) at positions ``first``.. (rotated there),
    all beyond the window: the k-1 earlier chunks each row keeps, (B,H,n,k-1), ascending."""
    n = q.shape[2]
    positions = torch.arange(first, first + n, device=q.device)
    count = (first + n - 1) // chunk_size  # chunks before the last row's: all complete
    raw = rerotate(q, -positions, inv_freq).float()  # RoPE-free, as the authors score
    scores = torch.einsum("bhnd,bhcd->bhnc", raw, reps[:, :, :count].float())
    chosen = select_chunks(scores, positions // chunk_size, chunks, keep_previous).nonzero()[:, -1]  # row-major: ascending
    if len(chosen) != scores[..., 0].numel() * (chunks - 1):
        raise ValueError("longheads: a query row chose fewer chunks than k-1 (non-finite queries or representations?)")
    return chosen.view(*scores.shape[:-1], chunks - 1)


def attend_chosen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chosen: torch.Tensor, *, first: int,
                  chunk_size: int, inv_freq: Optional[torch.Tensor], scale: float, keep_previous: bool, backend: str,
                  gather: Optional[Gather] = None, buffers: Optional[_Buffers] = None) -> torch.Tensor:
    """Output (B,H,n,D) of query rows q at positions ``first``.. (all beyond the window) over
    the chunks ``chosen`` (B,H,n,k-1, ascending; the last is the previous chunk with
    ``keep_previous``) re-positioned contiguously before their own chunk, and that chunk
    causally; q and k/v (B,Hkv,Nk,D) at their true positions. The attention half of a step,
    apart from the selection, so that a kernel taking these arguments can replace it
    (``gather``: :func:`_chunk_gather` of k/v, and ``buffers``, made once per call).

    One softmax over a row's k·l keys, computed as pieces merged by their log-sum-exps
    (exact): the own chunk and, with ``keep_previous``, the previous one, which in the last
    slot keeps its true distance (:func:`_near`: no gather, no rotation), and each of the
    other chosen chunks (:func:`_far`); the merge is one softmax over the (rows, pieces)
    log-sum-exps and one batched matmul."""
    near = [_near(q, k, v, first=first, chunk_size=chunk_size, back=back, scale=scale, backend=backend)
            for back in range(1 + keep_previous)]
    buffers = buffers or _Buffers(q, k, v)
    gather = gather or _chunk_gather(k, v, chunk_size=chunk_size, inv_freq=inv_freq, whole=False, buffers=buffers)
    pieces, lse = _far(q, gather, chosen[..., : chosen.shape[-1] - keep_previous], slots=chosen.shape[-1],
                       kv_heads=k.shape[1], first=first, chunk_size=chunk_size, inv_freq=inv_freq, scale=scale,
                       backend=backend, buffers=buffers)
    weight = torch.softmax(torch.cat([piece_lse.float()[..., None] for _, piece_lse in near] + [lse.float()], -1), -1)
    out = torch.matmul(weight[..., None, len(near) :], pieces.float()).squeeze(-2)
    for i, (piece, _) in enumerate(near):
        out.addcmul_(piece.float(), weight[..., i : i + 1])
    return out.to(q.dtype)


def _near(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, first: int, chunk_size: int, back: int, scale: float,
          backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of q (positions ``first``..) over the chunk ``back`` chunks before its own, at
    the true positions (no shift): its own chunk up to itself (``back = 0``) or a whole
    earlier chunk. Output (B,H,n,D) and LSE (B,H,n). Rows that start inside a chunk are one
    call (bottom-right causal for the own chunk); the rest, from a chunk boundary, one call
    with the chunks folded into the batch, each block of rows over its block of keys (views;
    the own chunks of the last block zero-padded: padded keys sit after every real row)."""
    b, h, n, d = q.shape
    last, shift = first + n, back * chunk_size
    head = min(last, -(-first // chunk_size) * chunk_size)  # the end of a chunk the rows start inside
    out, lse = q.new_empty(b, h, n, d), q.new_empty(b, h, n, dtype=torch.float32)
    if head > first:
        base = first // chunk_size * chunk_size
        keys = slice(base - shift, head if back == 0 else base - shift + chunk_size)
        causal = back == 0 and head - first > 1
        piece = attend_lse(q[:, :, : head - first], k[:, :, keys], v[:, :, keys], scale=scale,
                           offset=first - base if causal else None, backend=backend, block=chunk_size)
        out[:, :, : head - first], lse[:, :, : head - first] = piece
    if last > head:
        size = min(chunk_size, last - head)
        count = -(-(last - head) // size)
        length = chunk_size if back else size  # keys per block

        def fold(x: torch.Tensor, at: int, width: int) -> torch.Tensor:  # from x's row ``at``: (B·count, X, width, D)
            span = (count - 1) * size + width
            x = x[:, :, at : at + span]
            x = F.pad(x, (0, 0, 0, span - x.shape[2])) if x.shape[2] < span else x
            return x.unfold(2, width, size).permute(0, 2, 1, 4, 3).reshape(b * count, x.shape[1], width, d)

        piece_out, piece_lse = attend_lse(fold(q, head - first, size), fold(k, head - shift, length),
                                          fold(v, head - shift, length), scale=scale, offset=None if back else 0,
                                          backend=backend, block=chunk_size)
        out[:, :, head - first :] = piece_out.view(b, count, h, size, d).transpose(1, 2).flatten(2, 3)[:, :, : last - head]
        lse[:, :, head - first :] = piece_lse.view(b, count, h, size).transpose(1, 2).flatten(2, 3)[:, :, : last - head]
    return out, lse


def _far(q: torch.Tensor, gather: Gather, chosen: torch.Tensor, *, slots: int, kv_heads: int, first: int, chunk_size: int,
         inv_freq: Optional[torch.Tensor], scale: float, backend: str,
         buffers: _Buffers) -> tuple[torch.Tensor, torch.Tensor]:
    """Each (row, chosen chunk) pair, ``chosen`` (B,H,n,F) the first F of the row's ``slots``
    = k-1 chunks: output (B,H,n,F,D) in q's dtype and LSE (B,H,n,F) of the row's query,
    moved to the slot the chunk takes, over the chunk's l keys.

    Re-positioning: a row of chunk m sits at R·l + (p mod l) with R = k-1 and the chunk in
    slot r at r·l. With the keys rotated back by their chunk's start (chunk-local, once per
    key) the query, rotated at p, moves by ``(R - r - m)·l``: back to its own chunk's start,
    then forward by one of k-1 shifts shared by every row, which is one matmul of the rows by
    k-1 rotation matrices (a rotation is linear).

    Attention: the pairs are grouped by key chunk (batch, KV head, chunk), so every query head
    of a KV group that chose a chunk reads one gathered copy of it, and each group is cut into
    tiles of T pairs (:func:`_tiles`); one fused call attends every tile to its chunk. A
    pair's place in the tiles is a running count over a (rows, chunks) grid, no sort."""
    b, h, n, d = q.shape
    far, size = chosen.shape[-1], chunk_size
    groups, count = h // kv_heads, (first + n - 1) // size  # chunks that can be chosen: all complete
    dev = q.device
    # the pair's rank among those of its key chunk, counted over (query head of the group, row)
    grid = torch.zeros(b, h, n, count, dtype=torch.int32, device=dev).scatter_(-1, chosen, 1)
    rank = grid.view(b, kv_heads, groups * n, count).cumsum(2, dtype=torch.int32)
    counts = rank[:, :, -1].flatten()
    rows, tiles, total = _tiles(counts)
    tile_first = (tiles.cumsum(0) - tiles).view(b, kv_heads, 1, count)
    place = (tile_first * rows + rank - 1).view(b, h, n, count).gather(-1, chosen).flatten()  # pair -> tile row
    # queries: back to the own chunk's start, then the k-1 slot shifts as one matmul
    positions = torch.arange(first, first + n, device=dev)
    local = rerotate(q.float(), -(positions // size * size), inv_freq)
    turns = rerotate(torch.eye(d, device=dev).expand(far, d, d), ((slots - torch.arange(far, device=dev)) * size)[:, None],
                     inv_freq)  # row i of turn r: unit vector i moved by (R - r)·l
    local = local.reshape(-1, d)
    queries = torch.mm(local, turns.transpose(0, 1).reshape(d, far * d),
                       out=buffers.take("queries", (len(local), far * d), local))
    queries = queries.view(-1, d).to(q.dtype)  # pairs in (b, h, row, slot) order
    source = torch.zeros(total * rows, dtype=torch.long, device=dev).scatter_(0, place, torch.arange(len(place), device=dev))
    tile_q = torch.index_select(queries, 0, source, out=buffers.take("tiles", (len(source), d), queries))
    tile_q = tile_q.view(total, 1, rows, d)  # padding rows repeat pair 0
    tile_group = torch.repeat_interleave(torch.arange(len(counts), device=dev), tiles, output_size=total)
    tile_k, tile_v = gather(tile_group // (kv_heads * count), tile_group // count % kv_heads, tile_group % count)
    out, lse = attend_lse(tile_q, tile_k.unsqueeze(1), tile_v.unsqueeze(1), scale=scale, offset=None, backend=backend,
                          block=size)
    out = torch.index_select(out.reshape(-1, d), 0, place, out=buffers.take("pieces", (len(place), d), out))
    return out.view(b, h, n, far, d), lse.reshape(-1).index_select(0, place).view(b, h, n, far)


def _tiles(counts: torch.Tensor) -> tuple[int, torch.Tensor, int]:
    """Tiles for groups of ``counts`` pairs: pairs per tile T, tiles per group, their total.
    T is the power of two up to :data:`_TILE_ROWS` of least cost, each group's pairs rounded
    up to whole tiles plus :data:`_TILE_COST` per tile: few pairs per group (decoding) get
    small tiles and little padding, many get large tiles and few gathered copies of K/V. One
    host sync."""
    sizes = 2 ** torch.arange(_TILE_ROWS.bit_length(), device=counts.device)
    tiles = (counts + sizes[:, None] - 1) // sizes[:, None]
    totals = tiles.sum(1)
    cost, totals_host = torch.stack(((sizes + _TILE_COST) * totals, totals)).tolist()
    choice = cost.index(min(cost))
    return 1 << choice, tiles[choice], totals_host[choice]
