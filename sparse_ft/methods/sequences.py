"""Where the independent sequences lie in the rows transformers hands an attention function,
and running a kernel on each of them alone.

A row may hold padding (left for ``generate``, right for batched evaluation) and several
documents (padding-free packing: position ids that restart at each document, as transformers'
``DataCollatorWithFlattening`` and TRL's ``padding_free`` give, or flash-attention's
``cu_seq_lens_q/k``). A pattern or an algorithm is defined on one sequence: its chunks count
from the sequence's start and nothing may attend across documents. The cheapest exact way is
to cut the rows at those boundaries and run the kernel on each sequence at its own length,
sequences of equal length batched together: the kernel's own memory (O(N·chunk)), never an
N×N mask, and each sequence's output is the one it gets alone (up to the rounding of a
batched kernel call), whatever the other sequences hold.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F

# attend(q, k, v, group) -> (G,H,Nq,D): q (G,H,Nq,D) the sequences' queries (the last Nq of
# their Nk keys), k/v (G,Hkv,Nk,D); ``group`` names the batch of sequences the same way at
# every call of one generation (LongHeads keeps its state per group).
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Hashable], torch.Tensor]


@dataclass(frozen=True)
class Spans:
    """The sequences of a call: ``starts`` (B,Nk) bool, True on each sequence's first key;
    ``real`` (B,Nk) bool, False on padding; ``rows``/``begins``/``lengths``, one entry per
    sequence, its row, first key index and number of keys."""

    starts: torch.Tensor
    real: torch.Tensor
    rows: list[int]
    begins: list[int]
    lengths: list[int]

    def local_positions(self) -> torch.Tensor:
        """(B,Nk) each key's index from its sequence's first key: the position it must have
        been rotated at (padding gets garbage)."""
        index = torch.arange(self.starts.shape[1], device=self.starts.device).expand_as(self.starts)
        return index - torch.where(self.starts, index, 0).cummax(dim=1).values


def find_spans(real: Optional[torch.Tensor], kwargs: Mapping[str, Any], *, batch: int, q_len: int, kv_len: int,
               owner: str) -> Optional[Spans]:
    """The sequences in a call with ``kv_len`` keys per row, the last ``q_len`` of them
    queried; None when every row is one sequence from its first key, unpadded (the fast path).

    ``real`` (B,Nk) bool marks real keys (None: no padding). Documents start where
    ``position_ids`` do not continue by one (transformers' own rule for packed rows) and at
    ``cu_seq_lens_k`` (offsets into the rows laid end to end, as flash-attention's varlen
    kernels take them); both only where the call sees every key, not while decoding. A
    sequence's real tokens must be contiguous."""
    positions, cu_seq_lens = kwargs.get("position_ids"), kwargs.get("cu_seq_lens_k", kwargs.get("cu_seq_lens_q"))
    device = next((x.device for x in (real, positions, cu_seq_lens) if x is not None), torch.device("cpu"))
    starts = torch.zeros(batch, kv_len, dtype=torch.bool, device=device)
    if cu_seq_lens is not None:
        if q_len != kv_len:
            raise ValueError(f"{owner}: cu_seq_lens (packed documents) while decoding {q_len} queries against a KV cache "
                             f"of {kv_len} keys; packed rows are for training and scoring, not generation")
        _mark_cu_seq_lens(starts, cu_seq_lens, owner)
    # positions of another length are not these keys' (a sequence-parallel shard's, before DeepSpeed gathers them)
    if positions is not None and q_len == kv_len and positions.shape[-1] == kv_len and kv_len > 1:
        starts[:, 1:] |= (positions[..., 1:] - positions[..., :-1] != 1).expand(batch, -1)
    if real is None:
        if not bool(starts.any()):
            return None
        real = torch.ones_like(starts)
    elif not bool(starts.any()) and bool(real.all()):
        return None
    first = real & F.pad(~real[:, :-1] | starts[:, 1:], (1, 0), value=True)  # a run of real keys begins
    documents = starts.clone()
    documents[:, 0] = True
    segment = documents.long().cumsum(dim=1) + kv_len * torch.arange(batch, device=device)[:, None]
    runs = torch.zeros(batch * kv_len + kv_len + 1, dtype=torch.long, device=device).index_add_(
        0, segment[first], torch.ones_like(segment[first]))
    if bool((runs > 1).any()):
        row = (int((runs > 1).nonzero()[0]) - 1) // kv_len
        raise ValueError(
            f"{owner}: attention_mask row {row} has padding between the real tokens of one sequence; "
            "pad on the left (tokenizer.padding_side='left', as generate expects) or the right, or restart "
            "position_ids at each packed document"
        )
    rows, begins = first.nonzero(as_tuple=True)
    last = real & F.pad(~real[:, 1:] | starts[:, 1:], (0, 1), value=True)
    lengths = last.nonzero(as_tuple=True)[1] - begins + 1
    return Spans(starts=first, real=real, rows=rows.tolist(), begins=begins.tolist(), lengths=lengths.tolist())


def _mark_cu_seq_lens(starts: torch.Tensor, cu_seq_lens: torch.Tensor, owner: str) -> None:
    batch, n = starts.shape
    cu = cu_seq_lens.to(starts.device).long().flatten()
    if cu.numel() < 2 or int(cu[0]) != 0 or int(cu[-1]) != batch * n or bool((cu[1:] < cu[:-1]).any()):
        raise ValueError(
            f"{owner}: cu_seq_lens={cu.tolist()[:8]}{'...' if cu.numel() > 8 else ''} are not the cumulative lengths "
            f"of the documents in {batch} row(s) of {n} tokens (from 0 up to {batch * n}, non-decreasing)"
        )
    inner = cu[1:-1]
    starts.view(-1)[inner[inner < batch * n]] = True  # one starting a row is marked too, harmlessly
    first, end = cu[:-1], cu[1:]
    if bool(((first // n != (end - 1) // n) & (end > first)).any()):
        raise ValueError(f"{owner}: cu_seq_lens put a document across two rows of the batch; each row must hold whole "
                         "documents")


def per_span(attend: Attend, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, spans: Optional[Spans]) -> torch.Tensor:
    """``attend`` on every sequence alone: q (B,H,Nq,D) the last Nq of k/v's (B,Hkv,Nk,D) keys
    -> (B,H,Nq,D), 0 on padding queries. Sequences of equal length and equal number of
    queries go through one call; a lone sequence goes as views, without a copy. No spans:
    the rows are the sequences, one call (group None)."""
    if spans is None:
        return attend(q, k, v, None)
    b, h, nq, d = q.shape
    nk = k.shape[2]
    first_query = nk - nq
    groups: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for row, begin, length in zip(spans.rows, spans.begins, spans.lengths):
        queries = begin + length - max(begin, first_query)
        if queries > 0:
            groups.setdefault((length, queries), []).append((row, begin))
    placed: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # rows, query columns, (G,Lq,H,D)
    for (length, queries), members in sorted(groups.items()):
        begins = torch.tensor([begin for _, begin in members], device=q.device)[:, None]
        rows = torch.tensor([row for row, _ in members], device=q.device)[:, None]
        query_index = begins + torch.arange(length - queries, length, device=q.device) - first_query
        if len(members) == 1:  # views of its row, no copy
            (row, begin), = members
            keys, asked = slice(begin, begin + length), slice(begin + length - queries - first_query, begin + length - first_query)
            part = attend(q[row : row + 1, :, asked], k[row : row + 1, :, keys], v[row : row + 1, :, keys], tuple(members))
        else:
            key_index = begins + torch.arange(length, device=q.device)
            part = attend(q[rows, :, query_index].transpose(1, 2), k[rows, :, key_index].transpose(1, 2),
                          v[rows, :, key_index].transpose(1, 2), tuple(members))
        placed.append((rows, query_index, part.transpose(1, 2)))
    # the kernels' dtype, which autocast may make other than q's
    out = placed[0][2].new_zeros(b, nq, h, d) if placed else q.new_zeros(b, nq, h, d)
    for rows, query_index, part in placed:
        out[rows, query_index] = part
    return out.transpose(1, 2)


def packed_call(kernel: Callable[..., torch.Tensor], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                spans: Spans) -> torch.Tensor:
    """``kernel(q, k, v, lengths=...)`` on every sequence's tokens laid end to end (T,H,D),
    one call (a varlen kernel), for a call whose queries are its keys: (B,H,N,D), 0 on
    padding. The tokens' order is the spans' (row by row), so the lengths line up."""
    b, h, n, d = q.shape
    tokens = [x.transpose(1, 2)[spans.real] for x in (q, k, v)]
    computed = kernel(*tokens, lengths=spans.lengths)
    out = computed.new_zeros(b, n, h, d)  # the kernel's dtype, which autocast may make other than q's
    out[spans.real] = computed
    return out.transpose(1, 2)


def algorithm_spans(attention_mask: Optional[torch.Tensor], kwargs: Mapping[str, Any], *, q: torch.Tensor,
                    k: torch.Tensor, owner: str) -> Optional[Spans]:
    """The sequences of a call to an algorithm that moves RoPE positions (DCA, LongHeads),
    which reads transformers' 2-D padding mask and needs every query at its index in its
    sequence (:func:`check_local_positions`)."""
    q_len, kv_len = q.shape[2], k.shape[2]
    if attention_mask is not None and attention_mask.dim() != 2:
        raise ValueError(f"{owner}: expected the 2-D padding mask, got attention_mask of shape {tuple(attention_mask.shape)}")
    real = None if attention_mask is None else attention_mask[:, -kv_len:].bool()
    spans = find_spans(real, kwargs, batch=q.shape[0], q_len=q_len, kv_len=kv_len, owner=owner)
    check_local_positions(spans, kwargs.get("position_ids"), q_len=q_len, kv_len=kv_len, owner=owner)
    return spans


def check_local_positions(spans: Optional[Spans], position_ids: Optional[torch.Tensor], *, q_len: int, kv_len: int,
                          owner: str) -> None:
    """Refuse queries not rotated at their index from their sequence's first token: an
    algorithm that moves RoPE positions (DCA, LongHeads) computes from that index, so any
    other position (an offset, positions counted over padding) would give silently wrong
    outputs."""
    if position_ids is None:
        return
    if spans is None:
        expected = torch.arange(kv_len - q_len, kv_len, device=position_ids.device)[None]
        real = torch.ones_like(expected, dtype=torch.bool)
    else:
        expected, real = spans.local_positions()[:, kv_len - q_len :], spans.real[:, kv_len - q_len :]
    if position_ids.shape[-1] != q_len:
        raise ValueError(f"{owner}: position_ids cover {position_ids.shape[-1]} tokens, the call {q_len} queries")
    wrong = (position_ids != expected) & real
    if bool(wrong.any()):
        row, col = (int(x) for x in wrong.nonzero()[0])
        raise ValueError(
            f"{owner}: position_ids[{row}, {col}]={int(position_ids.expand_as(wrong)[row, col])} but that token is number "
            f"{int(expected.expand_as(wrong)[row, col])} of its sequence; positions must count from each sequence's "
            "first real token (as generate gives them with left padding), and packed documents restart them at 0"
        )
