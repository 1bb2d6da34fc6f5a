"""Sink tokens for every pattern's fast path: a pattern's pieces turned into pieces in which
every query also sees the first ``k`` keys (intersected with causality), exactly once.

Why this form: softmax over the union of a query's own keys and the sinks cannot be merged
from two SDPA calls with a gradient (the fused kernels return no differentiable log-sum-exp),
so each call sees both sets at once. The visible set of query ``i`` splits into three
disjoint cases, each a maskless call:

* ``i < k``: every key up to ``i`` is a sink, so these rows are causal attention over
  ``[0, k)``, one square call on every head;
* ``i >= k`` and the pattern gives ``i`` keys at or past ``k``: the pattern's piece, cut to
  rows and keys ``>= k`` (its keys below ``k`` are sinks now, seen once), with the ``k``
  sinks in front of each block's keys (:class:`~attn_patterns.strided.Piece` ``prefix``);
* ``i >= k`` and no such key (a dilated head's other residues, a look-back chunk that lies
  inside the sinks): the sinks alone, one call per regular run of such rows.

Built once per (length, heads) with the layout it belongs to; O(H·N) to build, O(N·w + N·k)
to run.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch

from attn_patterns.strided import Piece, Rows


def with_sinks(pieces: Sequence[Piece], sink: int, *, n: int, heads: int) -> list[Piece]:
    """``pieces`` (heads numbered from 0, rows written at most once) for a pattern whose
    queries also see the first ``sink`` keys."""
    if not sink:
        return list(pieces)
    first = min(sink, n)
    found = [Piece(range(heads), Rows(0, first), Rows(0, first), causal=True)]
    cut = [part for piece in pieces for part in _cut(piece, sink)]
    return found + cut + _sinks_alone(cut, sink, n=n, heads=heads)


def _below(start: int, step: int, width: int, sink: int) -> int:
    """How many of the rows ``start, start + step, ...`` (``width`` of them) lie below ``sink``."""
    return min(width, max(0, -(-(sink - start) // step)))


def _cut(piece: Piece, sink: int) -> list[Piece]:
    """``piece`` on rows and keys ``>= sink`` with the sinks as its prefix. Only the blocks that
    start below ``sink`` change (each alone); the rest stay one piece."""
    rows, keys = piece.rows, piece.keys
    touched = [c for c in range(rows.count)
               if rows.start + c * rows.stride < sink or keys.start + c * keys.stride < sink]
    rest = len(touched) and touched[-1] + 1
    found = []
    if rest < rows.count:
        found.append(Piece(piece.heads, _from(rows, rest), _from(keys, rest), piece.causal, piece.skip, sink))
    for c in touched:
        r0, k0 = rows.start + c * rows.stride, keys.start + c * keys.stride
        dr, dk = _below(r0, rows.step, rows.width, sink), _below(k0, keys.step, keys.width, sink)
        skip = max(0, piece.skip - dr) if piece.causal else piece.skip
        if rows.width - dr <= skip or keys.width - dk == 0:
            continue  # nothing left to write, or only sinks to see (those rows get the sinks alone)
        found.append(Piece(piece.heads, Rows(r0 + dr * rows.step, rows.width - dr, step=rows.step),
                           Rows(k0 + dk * keys.step, keys.width - dk, step=keys.step), piece.causal, skip, sink))
    return found


def _from(rows: Rows, block: int) -> Rows:
    return Rows(rows.start + block * rows.stride, rows.width, rows.count - block, rows.stride, rows.step)


def _sinks_alone(pieces: Sequence[Piece], sink: int, *, n: int, heads: int) -> list[Piece]:
    """Pieces for the rows ``>= sink`` that ``pieces`` write nowhere: the sinks, whole. Rows of
    heads with the same such rows go into one piece per run (a head range and a row
    progression each)."""
    if n <= sink:
        return []
    written = torch.zeros(heads, n, dtype=torch.uint8)
    for piece in pieces:
        rows = piece.rows.after(piece.skip)
        for c in range(rows.count):
            first = rows.start + c * rows.stride
            h = piece.heads
            written[h.start : h.stop : h.step, first : first + rows.width * rows.step : rows.step] = 1
    patterns, which = torch.unique(written[:, sink:], dim=0, return_inverse=True)
    found = []
    for u, pattern in enumerate(patterns):
        free = (torch.nonzero(1 - pattern).flatten() + sink).tolist()
        if not free:
            continue
        for head_run in _ranges(torch.nonzero(which == u).flatten().tolist()):
            for row_run in _ranges(free):
                found.append(Piece(head_run, Rows(row_run.start, len(row_run), step=row_run.step), Rows(0, sink),
                                   causal=False))
    return found


def _ranges(values: Iterable[int]) -> list[range]:
    """Ascending distinct integers as few arithmetic ranges as a greedy cover finds: from the
    smallest value left, the longest range among the steps to the next few values left (a
    dilated head's other residues, runs of consecutive rows). O(values) for those."""
    left = sorted(set(values))
    member, taken, found = set(left), set(), []
    for i, a in enumerate(left):
        if a in taken:
            continue
        best, nexts, j = range(a, a + 1), [], i + 1
        while len(nexts) < 4 and j < len(left):
            if left[j] not in taken:
                nexts.append(left[j])
            j += 1
        for b in nexts:
            length = 1
            while a + length * (b - a) in member and a + length * (b - a) not in taken:
                length += 1
            if length > len(best):
                best = range(a, a + length * (b - a), b - a)
        taken.update(best)
        found.append(best)
    return found
