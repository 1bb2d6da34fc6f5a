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
then exactly causal attention. Memory is O(N·k·l) per head, processed in query blocks;
nothing is N×N.

Decoding with a KV cache needs the queries of the chunk being filled (the cache keeps
only keys/values), so each attention layer keeps a small state: the representations of
complete chunks and the queries since the last complete chunk (paper §2.4).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from attn_patterns.base import Pattern, check_int, register
from attn_patterns.kernels import attend_lse, lse_backend, merge_lse
from attn_patterns.rotary import rotate as rerotate

# Elements of one gathered key block (rows × l × D per head): bounds memory independently of N.
_BLOCK_ELEMENTS = 1 << 26


def chunk_representations(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk_size: int, first_chunk: int, inv_freq: Optional[torch.Tensor]
) -> torch.Tensor:
    """Eqs. 1–2 for whole chunks: q (B,H,M·l,D) and k/v (B,Hkv,M·l,D) rotated at their true
    positions, chunk ``first_chunk`` first. Returns c (B,H,M,D) in fp32."""
    b, h, n, d = q.shape
    m, l = n // chunk_size, chunk_size
    starts = (torch.arange(m, device=q.device) + first_chunk) * l
    local = -starts.repeat_interleave(l)  # chunk-local RoPE: positions 0..l-1
    ql = rerotate(q.float(), local, inv_freq).view(b, h, m, l, d)
    kl = rerotate(k.float(), local, inv_freq)
    groups = h // k.shape[1]
    kl = kl.repeat_interleave(groups, dim=1).view(b, h, m, l, d)
    vl = v.float().repeat_interleave(groups, dim=1).view(b, h, m, l, d)
    pooled = F.scaled_dot_product_attention(ql, kl, vl).mean(dim=-2, keepdim=True)  # q_i^c
    return F.scaled_dot_product_attention(pooled, kl, kl).squeeze(-2)


@register
class LongHeads(Pattern):
    """Per-head chunk selection with position remapping: chunk size l (paper: 256) and k
    chunks per head, first and local included (default: as many as fit the pretraining
    length, k = L // l; the paper's 4k Llama-2 runs use k·l = 2k or 4k). ``keep_previous``
    (default, as the authors' code does) also forces the chunk before the query's own;
    ``keep_previous=False`` is the paper's text (first and own chunk only)."""

    name = "longheads"
    static = False

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
        l = self.chunk_size
        k = self.chunks if self.chunks is not None else pretraining_length // l
        least = 3 if self.keep_previous else 2
        if k < least or k * l > pretraining_length:
            raise ValueError(
                f"{self.name}: chunks={k} × chunk_size={l} = {k * l} must be <= pretraining_length="
                f"{pretraining_length} with chunks >= {least}; lower chunk_size or chunks"
            )
        return k

    def mask(self, seq_len: int, num_heads: int) -> torch.Tensor:
        raise ValueError(f"{self.name} selects keys from the data (q·k); it has no fixed mask. Use attend(...) instead")

    def visible_pairs(self, seq_len: int, num_heads: int) -> int:
        raise ValueError(f"{self.name} selects keys from the data; its visible pairs depend on q and k")

    # --- the pure-torch call ------------------------------------------------------------
    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        backend: Optional[str] = None,
        inv_freq: Optional[torch.Tensor] = None,
        chunks: Optional[int] = None,
    ) -> torch.Tensor:
        """Whole-sequence attention: q (B,H,N,D), k/v (B,Hkv,N,D) rotated at positions
        0..N-1 with ``inv_freq`` (None: a model without RoPE). ``chunks`` overrides k."""
        k_chunks = chunks or self.chunks or (self.window(self.pretraining_length) if self.pretraining_length else None)
        if k_chunks is None:
            raise ValueError(f"{self.name}: pass chunks= or pretraining_length= to know k")
        reps = chunk_representations(*_whole(q, k, v, self.chunk_size), self.chunk_size, 0, inv_freq)
        return attend(q, k, v, reps, self.chunk_size, k_chunks, inv_freq, 1.0 / math.sqrt(q.shape[-1]), self.keep_previous)


def _whole(q, k, v, l):
    n = (q.shape[2] // l) * l
    return q[:, :, :n], k[:, :, :n], v[:, :, :n]


def select_chunks(scores: torch.Tensor, m: int, k_chunks: int, keep_previous: bool = False) -> torch.Tensor:
    """Sorted chunk ids (..., R) a query of chunk m attends besides its own chunk: chunk 0
    (and chunk m-1 with ``keep_previous``) and the best of the other chunks in 1..m-1 by
    ``scores`` (..., >=m), R = min(k-1, m) in all."""
    shape = scores.shape[:-1]
    dev = scores.device
    if m == 0:
        return scores.new_zeros(*shape, 0, dtype=torch.long)
    forced = [0] + ([m - 1] if keep_previous and m >= 2 else [])
    lo, hi = 1, m - (len(forced) - 1)  # free candidates: lo..hi-1
    free = k_chunks - 1 - len(forced)
    if hi - lo <= free:
        rest = torch.arange(lo, hi, device=dev).expand(*shape, hi - lo)
    else:
        rest = scores[..., lo:hi].topk(free, dim=-1).indices + lo
    chosen = [torch.full((*shape, 1), c, dtype=torch.long, device=dev) for c in forced] + [rest]
    return torch.cat(chosen, dim=-1).sort(dim=-1).values


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, reps: torch.Tensor, l: int, k_chunks: int,
    inv_freq: Optional[torch.Tensor], scale: float, keep_previous: bool = False,
) -> torch.Tensor:
    """LongHeads output (B,H,Nq,D) for the last Nq positions of Nk keys (rotated at their
    true positions). ``reps`` (B,H,>=M,D) are the complete chunks' representations."""
    b, h, nq, d = q.shape
    nk = k.shape[2]
    start = nk - nq
    groups = h // k.shape[1]
    q_raw = rerotate(q, -torch.arange(start, nk, device=q.device), inv_freq).float()  # RoPE-free, for scoring
    out = torch.empty_like(q)
    bi = torch.arange(b, device=q.device)[:, None, None, None]
    hi = (torch.arange(h, device=q.device) // groups)[None, :, None, None]
    for m in range(start // l, (nk - 1) // l + 1):
        row_lo, row_hi = max(m * l, start), min((m + 1) * l, nk)
        slots = min(k_chunks - 1, m)
        per_row = max(1, _BLOCK_ELEMENTS // (b * h * l * d))
        for lo in range(row_lo, row_hi, per_row):
            hi_row = min(lo + per_row, row_hi)
            rows = slice(lo - start, hi_row - start)
            scores = torch.einsum("bhid,bhmd->bhim", q_raw[:, :, rows], reps[:, :, :m].float()) if m > 1 else q_raw.new_zeros(b, h, hi_row - lo, m)
            sel = select_chunks(scores, m, k_chunks, keep_previous)  # (B,H,n,R)
            out[:, :, rows] = _block(q[:, :, rows], k, v, sel, m, lo, l, slots, inv_freq, scale, bi, hi)
    return out


def _block(q, k, v, sel, m, lo, l, slots, inv_freq, scale, bi, hi) -> torch.Tensor:
    """Rows ``lo..`` of chunk m: the causal part of chunk m at its true distances, then each
    selected earlier chunk re-positioned, each piece with its log-sum-exp, merged exactly
    (:func:`kernels.merge_lse`); one gathered chunk per row exists at a time."""
    own = slice(m * l, min((m + 1) * l, k.shape[2]))
    # own chunk: true relative positions are kept, so no rotation
    pieces = [attend_lse(q, k[:, :, own], v[:, :, own], scale, lo - m * l, lse_backend(None, q, k, v, "longheads"), l)]
    offsets = torch.arange(l, device=q.device)
    for r in range(slots):
        # slot r holds chunk s = sel[..., r]; its distance to the query changes by
        # ((R - r) - (m - s))·l, applied to the query instead of the l keys
        chunk = sel[..., r]
        q_r = rerotate(q, ((slots - r) - (m - chunk)) * l, inv_freq).float()
        idx = (chunk * l).unsqueeze(-1) + offsets  # (B,H,n,l)
        scores = torch.einsum("bhid,bhijd->bhij", q_r, k[bi, hi, idx].float()) * scale
        lse = scores.logsumexp(-1)
        out = torch.einsum("bhij,bhijd->bhid", (scores - lse.unsqueeze(-1)).exp(), v[bi, hi, idx].float())
        pieces.append((out, lse))
    return merge_lse(pieces)
