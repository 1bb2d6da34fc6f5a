"""A pattern's fast path as maskless attention calls on strided views of q, k and v.

Every pattern of this package is, head by head, dense attention over a few regular sets of
rows: chunks, shifted chunks, the rows of one residue mod θ. A :class:`Piece` names one such
set for some heads, the keys it sees and whether it is square-causal or over every key, and
:func:`run` makes it one SDPA (or flash-attn) call on ``as_strided`` views: no gather, no
copy, no mask, grouped K/V native. Two small autograd functions keep the backward free of
copies too:

- :class:`_Views` hands out all views of one tensor and writes their gradients into one
  buffer (autograd would zero-fill a gradient of the whole tensor per view, then sum them);
- :class:`_Assemble` writes the pieces' outputs into one preallocated output and hands each
  piece its part of the output's gradient as a view (``torch.cat`` copies the output once
  more, slice assignment the whole gradient once per piece).

A piece's blocks go into the kernel's batch dimension, ``(blocks, heads, rows, D)``, when the
batch holds one sequence (the long-context case), one call per sequence otherwise; a piece of
one block takes the batch as it is.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Optional, Sequence

import torch

from attn_patterns.kernels import attend, piece_kernels


@dataclass(frozen=True)
class Rows:
    """Sequence positions ``start + c·stride + t·step`` for block ``c < count``, row ``t < width``."""

    start: int
    width: int
    count: int = 1
    stride: int = 0
    step: int = 1

    def after(self, rows: int) -> "Rows":
        """The same blocks without their first ``rows`` rows."""
        return replace(self, start=self.start + rows * self.step, width=self.width - rows)


@dataclass(frozen=True)
class Piece:
    """Query ``heads`` at ``rows`` attend the key rows ``keys`` (block c to block c): every one
    of them, or square causal (row t sees key rows up to t). The first ``skip`` rows of each
    block are computed only because a square call needs them and are not written: their keys
    are another piece's. Every row also sees the first ``prefix`` keys of the sequence (its
    sink tokens, none of them among ``keys``, all before every row): they are copied in front
    of each block's keys, and a square-causal piece gets as many zero rows in front of its
    queries, computed and not written, so the call stays square causal, one call (the
    one copy this module makes: O(rows + blocks·prefix))."""

    heads: range
    rows: Rows
    keys: Rows
    causal: bool
    skip: int = 0
    prefix: int = 0

    def moved(self, heads: int) -> "Piece":
        """This piece on the heads ``heads`` further on (a part of a head mix)."""
        h = self.heads
        return replace(self, heads=range(h.start + heads, h.stop + heads, h.step))


Unit = tuple[int, int, int]  # a step in (sequence, head, row)


def _multiple(value: int, step: int, size: int) -> bool:
    """Whether ``value`` is ``j * step`` for some ``|j| < size``."""
    return value == 0 or (step != 0 and value % step == 0 and abs(value // step) < size)


@dataclass(frozen=True)
class _View:
    """A 4-D view ``(x0, x1, x2, D)`` of a (B, H, N, D) tensor: element (x0, x1, x2) is at
    (sequence, head, row) ``base + x0·steps[0] + x1·steps[1] + x2·steps[2]``; x1 steps through
    heads, x2 through rows, x0 is the kernel's batch (sequences, blocks, or calls joined)."""

    base: Unit
    sizes: tuple[int, int, int]
    steps: tuple[Unit, Unit, Unit]

    @classmethod
    def at(cls, heads: range, rows: Rows, seq: Optional[int], batch: int) -> "_View":
        """``heads`` × ``rows``: ``(B, heads, width)`` for one block (``seq`` None), else
        sequence ``seq``'s ``(blocks, heads, width)``."""
        first = (batch, (1, 0, 0)) if seq is None else (rows.count, (0, 0, rows.stride))
        return cls((seq or 0, heads.start, rows.start), (first[0], len(heads), rows.width),
                   (first[1], (0, heads.step, 0), (0, 0, rows.step)))

    def of(self, x: torch.Tensor) -> torch.Tensor:
        strides = x.stride()
        at = lambda unit: sum(u * s for u, s in zip(unit, strides))  # noqa: E731
        return x.as_strided((*self.sizes, x.shape[3]), (*(at(step) for step in self.steps), strides[3]),
                            x.storage_offset() + at(self.base))

    def first(self, rows: int) -> "_View":
        """The first ``rows`` positions of the same sequences and heads (x0's steps through rows
        dropped): a call's sink tokens."""
        (seq, head, _), steps = self.steps[0], self.steps[1:]
        return _View((self.base[0], self.base[1], 0), (self.sizes[0], self.sizes[1], rows), ((seq, head, 0), steps[0], (0, 0, 1)))

    def then(self, other: "_View") -> Optional["_View"]:
        """This view with ``other`` (one entry of x0) as its next entry of x0, where ``other`` has
        the same shape, continues the progression of bases by a step forward in sequence, head
        and row, and the result has no element twice; else None."""
        if other.sizes[0] != 1 or (self.sizes[1:], self.steps[1:]) != (other.sizes[1:], other.steps[1:]):
            return None
        step = tuple(o - b for o, b in zip(other.base, self.base)) if self.sizes[0] == 1 else self.steps[0]
        if min(step) < 0 or tuple(b + self.sizes[0] * s for b, s in zip(self.base, step)) != other.base:
            return None  # a negative step is a negative stride in some layout (as_strided takes none)
        joined = replace(self, sizes=(self.sizes[0] + 1, *self.sizes[1:]), steps=(step, *self.steps[1:]))
        (_, heads, rows), (_, head_step, row_step) = joined.sizes, joined.steps
        for i in range(1, joined.sizes[0]):  # entry i of x0 must not land on entry 0's elements
            seq, head, row = (i * c for c in step)
            if seq == 0 and _multiple(head, head_step[1], heads) and _multiple(row, row_step[2], rows):
                return None
        return joined


@dataclass(frozen=True)
class _Call:
    q: _View
    kv: _View
    out: _View
    causal: bool
    skip: int
    prefix: int = 0

    def then(self, other: "_Call") -> Optional["_Call"]:
        """One call for both, ``other`` joined along the batch (:meth:`_View.then`)."""
        if (self.causal, self.skip, self.prefix) != (other.causal, other.skip, other.prefix):
            return None
        views = [a.then(b) for a, b in ((self.q, other.q), (self.kv, other.kv), (self.out, other.out))]
        return None if None in views else replace(self, q=views[0], kv=views[1], out=views[2])

    def sinks(self) -> _View:
        """The view of the call's ``prefix`` sink keys: one entry, broadcast over the batch, where
        every entry of the batch reads the same (the blocks of one sequence)."""
        view = self.kv.first(self.prefix)
        return replace(view, sizes=(1, *view.sizes[1:])) if view.steps[0] == (0, 0, 0) else view


@dataclass(frozen=True)
class _Writes:
    """Views written into one tensor in turn. A view none of whose elements an earlier one
    wrote is copied in (``fresh``), any other added; the tensor starts zeroed only where that
    is needed (an element no view writes, or a view added onto elements not yet written)."""

    views: tuple[_View, ...]
    fresh: tuple[bool, ...]
    zero: bool

    @classmethod
    def of(cls, views: Sequence[_View], shape: tuple[int, int, int]) -> "_Writes":
        seen = torch.zeros(*shape, 1, dtype=torch.uint8)
        fresh, zero = [], False
        for view in views:
            region = view.of(seen)
            touched = int(region.sum())
            fresh.append(touched == 0)
            zero |= 0 < touched < region.numel()
            region.fill_(1)
        return cls(tuple(views), tuple(fresh), zero or int(seen.min()) == 0)

    def into(self, out: torch.Tensor, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        if self.zero:
            out.zero_()
        for view, fresh, part in zip(self.views, self.fresh, parts):
            region = view.of(out)
            region.copy_(part) if fresh else region.add_(part)
        return out


class _Views(torch.autograd.Function):
    """Views of ``x``; backward writes their gradients into one tensor of x's size."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, writes: _Writes):
        ctx.meta, ctx.writes = (x.shape, x.dtype, x.device), writes
        return tuple(view.of(x) for view in writes.views)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        shape, dtype, device = ctx.meta
        return ctx.writes.into(torch.empty(shape, dtype=dtype, device=device), grads), None


class _Assemble(torch.autograd.Function):
    """One output written part by part (zeros where no part lands); backward hands each part
    its view of the output's gradient."""

    @staticmethod
    def forward(ctx, shape: tuple[int, int, int, int], writes: _Writes, *parts: torch.Tensor) -> torch.Tensor:
        b, h, n, d = shape
        # (B, N, H, D) in memory: what a model reads back (transformers' ``transpose(1, 2)``) for free
        out = parts[0].new_empty(b, n, h, d).transpose(1, 2)
        ctx.views = writes.views
        return writes.into(out, parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return (None, None, *(view.of(grad) for view in ctx.views))


def _kv_of(heads: range, groups: int) -> Optional[range]:
    """The K/V heads of query ``heads`` as one strided range, when SDPA's grouped-query rule
    (query i of the call reads K/V head i // (queries / K/V heads)) maps them right; else None."""
    kv = [h // groups for h in heads]
    distinct = sorted(set(kv))
    per, left = divmod(len(kv), len(distinct))
    step = distinct[1] - distinct[0] if len(distinct) > 1 else 1
    run = range(distinct[0], distinct[-1] + 1, step)
    if left or list(run) != distinct or any(kv[i] != run[i // per] for i in range(len(kv))):
        return None
    return run


@functools.lru_cache(maxsize=1024)
def _kv_split(heads: range, groups: int) -> tuple[tuple[range, range], ...]:
    """``heads`` cut into the fewest leading runs whose K/V heads are a view (:func:`_kv_of`):
    one run for every head split of the published patterns (whole KV groups, or heads strided
    by a dilation that divides or is divided by the group size); a mix cutting through a KV
    group gets a run on each side of the cut. One query head always has one K/V head."""
    runs, rest = [], heads
    while len(rest):
        size = next(size for size in range(len(rest), 0, -1) if _kv_of(rest[:size], groups) is not None)
        runs.append((rest[:size], _kv_of(rest[:size], groups)))
        rest = rest[size:]
    return tuple(runs)


@dataclass(frozen=True)
class _Plan:
    calls: tuple[_Call, ...]
    q: _Writes  # the queries' gradient
    kv: _Writes  # the keys' and values' gradients: the calls' keys, then the sinks of those with a prefix
    out: _Writes  # the output, the calls' parts first, then the extras'
    whole: bool  # one call over all of q, k and v: it is the output


@functools.lru_cache(maxsize=256)
def _plan(pieces: tuple[Piece, ...], batch: int, heads: int, kv_heads: int, *, n: int,
          extras: tuple[range, ...]) -> _Plan:
    """The calls of ``pieces``: one per piece and K/V run (:func:`_kv_split`), and per sequence
    where a piece of several blocks meets a batch of several; a call joins an earlier one of
    its shape whose views it continues (a dilated pattern's residues, which alone may hold one
    head each; a shifted pattern's partial first and last chunks). Fewer calls, and more work
    per call: a CPU kernel's backward shares work only across batch × heads."""
    calls: list[_Call] = []
    for piece in pieces:
        seqs = [None] if piece.rows.count == 1 else [0] if batch == 1 else range(batch)
        for q_heads, kv_heads_ in _kv_split(piece.heads, heads // kv_heads):
            for seq in seqs:
                call = _Call(_View.at(q_heads, piece.rows, seq, batch), _View.at(kv_heads_, piece.keys, seq, batch),
                             _View.at(q_heads, piece.rows.after(piece.skip), seq, batch), piece.causal, piece.skip,
                             piece.prefix)
                for i, earlier in enumerate(calls):
                    joined = earlier.then(call)
                    if joined:
                        calls[i] = joined
                        break
                else:
                    calls.append(call)
    outs = [call.out for call in calls] + [_View.at(h, Rows(0, n), None, batch) for h in extras]
    everything = _View.at(range(heads), Rows(0, n), None, batch), _View.at(range(kv_heads), Rows(0, n), None, batch)
    whole = len(outs) == len(calls) == 1 and (calls[0].q, calls[0].kv) == everything and not (calls[0].skip or calls[0].prefix)
    return _Plan(tuple(calls), _Writes.of([c.q for c in calls], (batch, heads, n)),
                 _Writes.of([c.kv for c in calls] + [c.sinks() for c in calls if c.prefix], (batch, kv_heads, n)),
                 _Writes.of(outs, (batch, heads, n)), whole)


def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pieces: Sequence[Piece], *, backend: str,
        extras: Sequence[tuple[range, torch.Tensor]] = ()) -> torch.Tensor:
    """q ``(B, H, N, D)``, k/v ``(B, Hkv, N, D)`` -> ``(B, H, N, D)``: every piece's call, and
    each of ``extras`` (heads, output computed elsewhere) written where it lands; rows no
    piece writes are 0. Pieces must not overlap in what they write."""
    b, h, n, d = q.shape
    plan = _plan(tuple(pieces), b, h, k.shape[1], n=n, extras=tuple(heads for heads, _ in extras))
    if plan.whole:
        return attend(q, k, v, causal=plan.calls[0].causal, backend=backend)
    qs, ks, vs = (_Views.apply(x, writes) if plan.calls else () for x, writes in
                  ((q, plan.q), (k, plan.kv), (v, plan.kv)))
    parts, sinks = [], iter(zip(ks[len(plan.calls):], vs[len(plan.calls):]))
    with piece_kernels(q.device.type):
        for call, qv, kv, vv in zip(plan.calls, qs, ks, vs):
            if call.prefix:
                qv, kv, vv = _with_sinks(call.causal, (qv, kv, vv), next(sinks))
            out = attend(qv, kv, vv, causal=call.causal, backend=backend)
            start = call.skip + (call.prefix if call.causal else 0)
            parts.append(out[:, :, start:] if start else out)
    return _Assemble.apply((b, h, n, d), plan.out, *parts, *(out for _, out in extras))


def _with_sinks(causal: bool, views: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                sinks: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A call's q, k, v ``views`` with its sink keys and values (:meth:`_Call.sinks`, views
    whose gradients go into the same buffers as the calls') in front of each block's keys, and
    for a square-causal call as many zero query rows in front of its queries (their rows are
    dropped from the output; zeros keep their scores finite, so their gradient is 0)."""
    qv, kv, vv = views
    kv, vv = (torch.cat([sink.expand(x.shape[0], -1, -1, -1), x], dim=2) for sink, x in zip(sinks, (kv, vv)))
    if causal:
        prefix = sinks[0].shape[2]
        qv = torch.cat([qv.new_zeros(*qv.shape[:2], prefix, qv.shape[3]), qv], dim=2)
    return qv, kv, vv
