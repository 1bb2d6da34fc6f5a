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
  instead of re-rotating keys per query we rotate the (already rotated) query once per
  selected slot by the change in distance, ``((R - r) - (m - s))·l`` for chunk s in slot r
  (R = number of earlier slots), in fp32 with the model's ``inv_freq``.

Within ``k·l`` tokens every earlier chunk is selected and every shift is 0: LongHeads is
then exactly causal attention. The work is tensor ops over query blocks (one block = the rows
of one chunk): each block attends once to the union of the chunks its rows chose and each
row keeps its own choice (see :func:`_step`); a step of blocks holds at most
``_BLOCK_ELEMENTS`` elements, so memory does not grow with N and nothing is N×N.

Decoding with a KV cache needs the queries of the chunk being filled (the cache keeps
only keys/values), so each attention layer keeps a small state: the representations of
complete chunks and the queries since the last complete chunk (paper §2.4).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from attn_patterns.algorithm import Algorithm, register
from attn_patterns.checks import check_int
from attn_patterns.kernels import attend_lse, lse_backend
from attn_patterns.rotary import rotate as rerotate

# Upper bound (estimated by _plan) on the elements of one step's tensors: memory independent of N.
# A GPU takes 64x more per step (at most ~1 GiB): each step costs a few synchronising kernel
# launches, and at 32 heads the CPU's bound left one query row per step (16 s at 8k on an H200).
_BLOCK_ELEMENTS = 1 << 22
_CUDA_BLOCK_ELEMENTS = 1 << 28


def chunk_representations(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, chunk_size: int, first_chunk: int,
    inv_freq: Optional[torch.Tensor],
) -> torch.Tensor:
    """Eqs. 1–2 for whole chunks: q (B,H,M·l,D) and k/v (B,Hkv,M·l,D) rotated at their true
    positions, chunk ``first_chunk`` first, l = ``chunk_size``. Returns c (B,H,M,D) in fp32."""
    b, h, n, d = q.shape
    count = n // chunk_size
    starts = (torch.arange(count, device=q.device) + first_chunk) * chunk_size
    local = -starts.repeat_interleave(chunk_size)  # chunk-local RoPE: positions 0..l-1
    # chunks folded into the head dimension: 4-D input keeps SDPA's fused kernel
    local_q = rerotate(q.float(), local, inv_freq).reshape(b, h * count, chunk_size, d)
    local_k = rerotate(k.float(), local, inv_freq)
    groups = h // k.shape[1]
    local_k = local_k.repeat_interleave(groups, dim=1).view(b, h * count, chunk_size, d)
    values = v.float().repeat_interleave(groups, dim=1).view(b, h * count, chunk_size, d)
    pooled = F.scaled_dot_product_attention(local_q, local_k, values).mean(dim=-2, keepdim=True)  # q_i^c
    return F.scaled_dot_product_attention(pooled, local_k, local_k).view(b, h, count, d)


@register
class LongHeads(Algorithm):
    """Per-head chunk selection with position remapping: chunk size l (paper: 256) and k
    chunks per head, first and local included (default: as many as fit the pretraining
    length, k = L // l; the paper's 4k Llama-2 runs use k·l = 2k or 4k). ``keep_previous``
    (default, as the authors' code does) also forces the chunk before the query's own;
    ``keep_previous=False`` is the paper's text (first and own chunk only)."""

    name = "longheads"

    def __init__(
        self, chunk_size: int = 256, chunks: Optional[int] = None, pretraining_length: Optional[int] = None,
        keep_previous: bool = True,
    ) -> None:
        check_int("chunk_size", chunk_size, self.name)
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
        super().__init__(chunk_size=chunk_size, chunks=chunks, pretraining_length=pretraining_length, keep_previous=keep_previous)
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
        whole = q.shape[2] // self.chunk_size * self.chunk_size  # complete chunks only
        reps = chunk_representations(q[:, :, :whole], k[:, :, :whole], v[:, :, :whole], chunk_size=self.chunk_size,
                                     first_chunk=0, inv_freq=inv_freq)
        return longheads_attention(q, k, v, reps=reps, chunk_size=self.chunk_size, chunks=chunks, inv_freq=inv_freq,
                                   scale=1.0 / math.sqrt(q.shape[-1]), keep_previous=self.keep_previous, backend=backend)


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

    Rows are cut into blocks inside one chunk, so a block shares its own chunk, and a step
    takes as many blocks as :data:`_BLOCK_ELEMENTS` allows (a few thousand tokens of a small
    model in one step): the Python loop is over steps, never over rows or slots."""
    b, h, nq, d = q.shape
    nk = k.shape[2]
    start = nk - nq
    q_raw = rerotate(q, -torch.arange(start, nk, device=q.device), inv_freq).float()  # RoPE-free, for scoring
    gather = _chunk_gather(k, v, chunk_size=chunk_size, inv_freq=inv_freq, whole=nq * chunks * h >= nk * k.shape[1])
    call = _Call(q=q, q_raw=q_raw, reps=reps, gather=gather, groups=h // k.shape[1], start=start, chunk_size=chunk_size,
                 chunks=chunks, inv_freq=inv_freq, scale=scale, keep_previous=keep_previous,
                 backend=lse_backend(backend, q, k, v, owner="longheads"))
    out = torch.empty_like(q)
    per_block, steps = _plan(start=start, nk=nk, chunk_size=chunk_size, chunks=chunks, batch_heads=b * h, head_dim=d,
                             budget=_CUDA_BLOCK_ELEMENTS if q.is_cuda else _BLOCK_ELEMENTS)
    for blocks in steps:
        first = max(start, blocks[0][0] * chunk_size + blocks[0][1] * per_block)
        last = min(nk, blocks[-1][0] * chunk_size + min(chunk_size, (blocks[-1][1] + 1) * per_block))
        out[:, :, first - start : last - start] = _step(call, blocks, per_block)
    return out


def _chunk_gather(k: torch.Tensor, v: torch.Tensor, *, chunk_size: int, inv_freq: Optional[torch.Tensor], whole: bool):
    """``gather(batch, kv_head, chunk)`` -> keys in chunk-local RoPE (positions 0..l-1) and
    values (E,1,l,D) in the input dtype (the fused kernels' own); a chunk past the last key is
    zero-padded or repeats the last key, either way beyond every query. ``whole``: when more
    keys will be gathered than exist (prefill), rotate all keys once into a chunk-major copy
    and gather whole chunks as rows; otherwise (decoding) gather and rotate only what is
    asked, not the whole cache."""
    b, hkv, nk, d = k.shape
    if whole:
        count = -(-nk // chunk_size)
        local = -(torch.arange(nk, device=k.device) // chunk_size * chunk_size)
        keys, values = (F.pad(x, (0, 0, 0, count * chunk_size - nk)).reshape(b * hkv * count, chunk_size * d)
                        for x in (rerotate(k, local, inv_freq), v))

        def gather(batch, kv_head, chunk):
            rows = (batch * hkv + kv_head) * count + chunk
            return (keys.index_select(0, rows).view(-1, 1, chunk_size, d),
                    values.index_select(0, rows).view(-1, 1, chunk_size, d))

        return gather

    def gather(batch, kv_head, chunk):
        positions = ((chunk * chunk_size)[:, None] + torch.arange(chunk_size, device=k.device)).clamp(max=nk - 1)
        index = (batch[:, None], kv_head[:, None], positions)
        return rerotate(k[index], -(chunk * chunk_size)[:, None], inv_freq).unsqueeze(1), v[index].unsqueeze(1)

    return gather


def _plan(*, start: int, nk: int, chunk_size: int, chunks: int, batch_heads: int, head_dim: int,
          budget: Optional[int] = None) -> tuple[int, list[list[tuple[int, int]]]]:
    """Rows per block n and the blocks ``(chunk m, sub-block a)`` of each step: block (m, a)
    holds rows m·l + a·n .. m·l + a·n + n - 1 (those in the call and in chunk m are real).
    A step's size is bounded from above: a block gathers at most min(m, n·(k-1)) chunks
    besides its own, each with n×l scores and l keys and values."""

    def cost(chunk: int, per_block: int) -> int:
        gathered = min(chunk, per_block * (chunks - 1)) + 1
        return batch_heads * (gathered * chunk_size * (per_block + 2 * head_dim) + per_block * (chunks * head_dim + chunk + 1))

    budget = budget or _BLOCK_ELEMENTS
    per_block = chunk_size
    while per_block > 1 and cost((nk - 1) // chunk_size, per_block) > budget:
        per_block = (per_block + 1) // 2
    per_chunk = -(-chunk_size // per_block)

    def block_number(position: int) -> int:
        return position // chunk_size * per_chunk + position % chunk_size // per_block

    steps, size = [[]], 0
    for block in (divmod(i, per_chunk) for i in range(block_number(start), block_number(nk - 1) + 1)):
        block_cost = cost(block[0], per_block)
        if steps[-1] and size + block_cost > budget:
            steps.append([])
            size = 0
        steps[-1].append(block)
        size += block_cost
    return per_block, steps


@dataclass(frozen=True, kw_only=True)
class _Call:
    """What every step of one :func:`longheads_attention` call shares."""

    q: torch.Tensor  # (B,H,Nq,D) rotated at the true positions
    q_raw: torch.Tensor  # the same without RoPE, fp32: what chunks are scored with
    reps: torch.Tensor  # (B,H,>=M,D) the complete chunks' representations
    gather: Callable[..., tuple[torch.Tensor, torch.Tensor]]  # from _chunk_gather
    groups: int  # query heads per KV head
    start: int  # the first query's position
    chunk_size: int
    chunks: int
    inv_freq: Optional[torch.Tensor]
    scale: float
    keep_previous: bool
    backend: str


def _step(call: _Call, blocks: list[tuple[int, int]], per_block: int) -> torch.Tensor:
    """Output (B,H,rows,D) of the real rows of ``blocks``, ``per_block`` rows each.

    Each (batch, head, block) gathers the union of the earlier chunks its rows chose (a few
    times k, not N/l) once, and attends all its rows to each with one fused call
    (:func:`kernels.attend_lse`, batched over the union); the own chunk is one more, causal.
    Each row then keeps only the pieces it chose, merged exactly by their log-sum-exps in
    fp32; the pieces run in the input dtype, so a GPU's half-precision kernels can take them.
    Re-positioning happens in the chunk-local frame: keys are rotated back by their chunk's
    start, the query by its own chunk's start and forward by (R - r)·l for slot r (0 for its
    own chunk), so a row has only k query rotations, whose angles form a k-row table."""
    q, size, chunks, gather = call.q, call.chunk_size, call.chunks, call.gather
    b, h, nq, d = q.shape
    nk, dev, count = call.start + nq, q.device, len(blocks)
    block_chunk = torch.tensor([blk[0] for blk in blocks], device=dev)
    block_part = torch.tensor([blk[1] for blk in blocks], device=dev)
    offsets = torch.arange(per_block, device=dev)
    local = block_part[:, None] * per_block + offsets  # (G,n) row within its chunk
    pos = block_chunk[:, None] * size + local
    real = (local < size) & (pos >= call.start) & (pos < nk)
    row_index = (pos.clamp(call.start, nk - 1) - call.start).flatten()  # padding repeats a real row

    def by_block(x: torch.Tensor) -> torch.Tensor:
        return x.index_select(2, row_index).view(b, h, count, per_block, d)

    scores = torch.einsum("bhgid,bhcd->bhgic", by_block(call.q_raw), call.reps[:, :, : blocks[-1][0]].float())
    chosen = select_chunks(scores, block_chunk[:, None], chunks, call.keep_previous)  # (B,H,G,n,top)
    # (G,B,H,n,k,D): the query re-positioned for each of the k possible shifts. A rotation is
    # linear, so one batched matmul per block applies its k rotations (rotated identities)
    shifts = (torch.arange(chunks, device=dev) - block_chunk[:, None]) * size  # (G,k)
    table = rerotate(torch.eye(d, device=dev).expand(count, chunks, d, d), shifts[..., None], call.inv_freq)
    queries = torch.bmm(
        by_block(q).float().permute(2, 0, 1, 3, 4).reshape(count, -1, d), table.transpose(1, 2).reshape(count, d, -1)
    ).to(q.dtype).view(count, b, h, per_block, chunks, d)
    # own chunk: shift 0, causal from the block's first row on; one call per sub-block offset
    segments = torch.arange(b * h * count, device=dev)
    seg_batch, seg_head, seg_block = segments // (h * count), segments // count % h, segments % count
    own_q = queries[..., 0, :].permute(1, 2, 0, 3, 4).reshape(-1, 1, per_block, d)
    own_out, own_lse = (own_q.new_empty(len(segments), per_block, *dims, dtype=torch.float32) for dims in ((d,), ()))
    for part in sorted({blk[1] for blk in blocks}):
        idx = (block_part[seg_block] == part).nonzero().squeeze(-1)
        keys, values = gather(seg_batch[idx], seg_head[idx] // call.groups, block_chunk[seg_block[idx]])
        out, lse = attend_lse(own_q[idx], keys, values, scale=call.scale, offset=part * per_block, backend=call.backend,
                              block=size)
        own_out[idx], own_lse[idx] = out[:, 0].float(), lse[:, 0].float()
    member = chosen.any(-2)
    # union entries (batch, head, block, chunk), grouped by segment
    entry_batch, entry_head, entry_block, entry_chunk = member.nonzero(as_tuple=True)
    if not len(entry_batch):  # only chunk 0 in this step
        return own_out.view(b, h, count, per_block, d)[:, :, real]
    lengths = member.sum(-1).flatten()  # entries per segment (batch, head, block)
    shift = chosen.sum(-1, keepdim=True) - chosen.cumsum(-1) + 1  # R - r for the chunk in slot r
    entry = (entry_batch, entry_head, entry_block, entry_chunk)
    chosen, shift = (x.permute(0, 1, 2, 4, 3)[entry] for x in (chosen, shift))  # (E,n)
    segment = (entry_batch * h + entry_head) * count + entry_block
    flat = ((((entry_block * b + entry_batch) * h + entry_head)[:, None] * per_block + offsets) * chunks + shift).flatten()
    entry_q = queries.reshape(-1, d).index_select(0, flat).view(-1, 1, per_block, d)  # (E,1,n,D), shift always in 1..R
    keys, values = gather(entry_batch, entry_head // call.groups, entry_chunk)
    out, lse = attend_lse(entry_q, keys, values, scale=call.scale, offset=None, backend=call.backend, block=size)
    lse = lse[:, 0].float().masked_fill_(~chosen, float("-inf"))  # a row keeps only the chunks it chose
    top_lse = torch.maximum(torch.segment_reduce(lse, "max", lengths=lengths), own_lse)
    weight, own_weight = (lse - top_lse.index_select(0, segment)).exp_(), (own_lse - top_lse).exp_()
    # sums over a segment's entries: index_add_ runs several times faster than segment_reduce
    total = own_weight.index_add(0, segment, weight)
    mixed = (own_out * own_weight[..., None]).index_add_(0, segment, out[:, 0].float().mul_(weight[..., None]))
    return (mixed / total[..., None]).view(b, h, count, per_block, d)[:, :, real]
