"""The patterns. Each leaf says which keys a query sees (``keys``) and how to compute it: as
maskless attention calls on strided views of q/k/v (``pieces``, run by
:func:`attn_patterns.strided.run`). The published patterns are head mixes of leaves, whose
pieces all go into one run.

Notation: w = ceil(N / chunks) chunk size, g = w // 2 shift, c = i // w query chunk; floor
division throughout; causality (j <= i) is always added by the base class and kernels.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from typing import Any, Optional, Sequence, Union

import torch

from attn_patterns.base import PATTERNS, Keys, Pattern, chunk_size, register
from attn_patterns.checks import HEADS_WHY, MAX_HEADS, check_int
from attn_patterns.kernels import BACKENDS, causal_varlen, resolve_backend
from attn_patterns.sinks import with_sinks
from attn_patterns.strided import Piece, Rows, run
from attn_patterns.workspace import Workspace, kernel_call, pieces


_MAX_LAYOUTS = 16  # per pattern: (N, H, head offset, total heads) combinations kept


def causal_blocks(heads: range, start: int, end: int, size: int, *, skip: int = 0) -> list[Piece]:
    """Square-causal attention inside consecutive blocks of ``size`` rows from ``start`` to
    ``end``: the whole blocks as one piece, a partial last block as another (views, no
    padding); ``skip`` as in :class:`~attn_patterns.strided.Piece`."""
    whole = (end - start) // size
    tail = start + whole * size
    spans = [Rows(start, size, whole, size)] if whole else []
    spans += [Rows(tail, end - tail)] if end - tail > skip else []
    return [Piece(heads, span, span, causal=True, skip=skip) for span in spans]


@dataclass(frozen=True)
class Delegated:
    """Heads ``[start, end)`` of a mix computed by a part that states no pieces (a pattern
    registered from outside), as heads ``[offset, offset + end - start)`` of its ``total``."""

    pattern: Pattern
    start: int
    end: int
    offset: int
    total: int

    def moved(self, heads: int) -> "Delegated":
        return replace(self, start=self.start + heads, end=self.end + heads)


Layout = tuple[tuple[Piece, ...], tuple[Delegated, ...]]


def _check_backend(owner: str, backend: Optional[str]) -> None:
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"{owner}: backend={backend!r} is unknown; allowed: {', '.join(BACKENDS)} or None (= sdpa)")


def _check_share(name: str, value: Any, owner: str) -> None:
    """A fraction strictly between 0 and 1 (of the heads, of a chunk)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1:
        raise ValueError(f"{owner}: {name}={value!r} must be a number in (0, 1)")


def _sink_copies(workspace: Workspace, sink_tokens: int, *, rows: int, heads: int, kv_heads: int, head_dim: int,
                 dtype_bytes: int) -> Workspace:
    """With sink tokens the calls run on copies of their q, k and v with the sinks in front
    (:mod:`attn_patterns.sinks`), which the kernels keep for their backward: one q, k and v
    more over the calls' ``rows``."""
    if not sink_tokens:
        return workspace
    copies = dtype_bytes * head_dim * rows * (heads + 2 * kv_heads)
    return Workspace({**workspace.saved, "sink tokens: the calls' q, k, v with the sinks in front": copies},
                     workspace.backward)


def _check_sinks(owner: str, sink_tokens: Any) -> None:
    """``sink_tokens``: an integer >= 0 here; below the chunk width once the length is known
    (:meth:`Pattern.check_sinks`, run by ``check_length``)."""
    check_int("sink_tokens", sink_tokens, owner, least=0)


class _Builtin(Pattern):
    """The patterns of this module: ``pieces``, maskless calls on views that take grouped K/V
    as they are, on the backends of :mod:`attn_patterns.kernels`. Each class checks its
    parameters in :meth:`check_params`, which its constructor calls first, so a recipe typo
    fails when the recipe loads, without building the pattern. Every one takes
    ``sink_tokens``: each query also sees the first that many keys (with causality), in every
    backend, from one rule (:meth:`Pattern.sinks`) and one transform of the pieces
    (:mod:`attn_patterns.sinks`)."""

    native_gqa = True

    @classmethod
    def check_params(cls, backend: Optional[str] = None, sink_tokens: int = 0) -> None:
        _check_backend(cls.name, backend)
        _check_sinks(cls.name, sink_tokens)

    def with_sinks(self, sink_tokens: int) -> "_Builtin":
        """This pattern with ``sink_tokens`` sink tokens: a copy (the caches stay behind), or
        itself when it has them already."""
        if sink_tokens == self.sink_tokens:
            return self
        clone = copy.copy(self)
        clone.__dict__ = {key: value for key, value in self.__dict__.items() if not key.startswith("_")}
        clone._set_sinks(sink_tokens)
        return clone

    def _set_sinks(self, sink_tokens: int) -> None:
        self.sink_tokens = sink_tokens
        self.params = {key: value for key, value in self.params.items() if key != "sink_tokens"}
        if sink_tokens:  # shown (repr, errors) only when set
            self.params["sink_tokens"] = sink_tokens

    def pieces(self, n: int, heads: int, *, offset: int, total: int) -> list[Piece]:
        """The calls that compute ``heads`` heads, heads ``[offset, offset + heads)`` of
        ``total``, at length ``n``; heads numbered from 0, rows written at most once. (A mix
        states its :meth:`layout` instead: parts registered from outside have no pieces.)"""
        raise NotImplementedError

    def layout(self, n: int, heads: int, *, offset: int, total: int) -> Layout:
        """:meth:`pieces` and the heads delegated to parts that state none, kept on the pattern
        (every layer of a model asks for the same)."""
        kept = self.__dict__.setdefault("_layouts", {})
        key = (n, heads, offset, total)
        if key not in kept:
            if len(kept) >= _MAX_LAYOUTS:
                kept.pop(next(iter(kept)))
            kept[key] = self._layout(n, heads, offset=offset, total=total)
        return kept[key]

    def _layout(self, n: int, heads: int, *, offset: int, total: int) -> Layout:
        found = self.pieces(n, heads, offset=offset, total=total)
        return tuple(with_sinks(found, self.sink_tokens, n=n, heads=heads)), ()

    def forward(self, q, k, v, backend):
        return self.forward_heads(q, k, v, backend, offset=0, total=q.shape[1])

    def forward_heads(self, q, k, v, backend, *, offset, total):
        found, delegated = self.layout(q.shape[2], q.shape[1], offset=offset, total=total)
        groups, extras = q.shape[1] // k.shape[1], []
        for d in delegated:
            kv = _kv_heads(k, v, start=d.start, end=d.end, groups=groups, native=d.pattern.native_gqa)
            out = d.pattern.forward_heads(q[:, d.start : d.end], *kv, backend, offset=d.offset, total=d.total)
            extras.append((range(d.start, d.end), out))
        return run(q, k, v, found, backend=backend, extras=extras)


@register
class Causal(_Builtin):
    """``causal``: every earlier key, on the toolkit's kernels (the model's own attention is
    the method ``full``)."""

    name = "causal"
    head_invariant = True

    def __init__(self, backend: Optional[str] = None, sink_tokens: int = 0) -> None:
        self.check_params(backend, sink_tokens)
        super().__init__(backend)
        self._set_sinks(sink_tokens)

    def keys(self, h, i, n, num_heads) -> Keys:
        return torch.zeros_like(i), i, torch.ones_like(i)

    def widest(self, n, num_heads):
        return [n] * num_heads

    def pieces(self, n, heads, *, offset, total):
        return [Piece(range(heads), Rows(0, n), Rows(0, n), causal=True)]

    def packed_kernel(self, q):
        return causal_varlen if resolve_backend(self.backend, q) == "flash" else None

    def workspace(self, n, heads, *, kv_heads, head_dim, dtype_bytes, kernel="fused") -> Workspace:
        """One dense call, whose output is the model's layout already: no merge."""
        return kernel_call(n, n, heads=heads, kv_heads=kv_heads, head_dim=head_dim, dtype_bytes=dtype_bytes, kernel=kernel)

    def _layout(self, n, heads, *, offset, total):
        """Its keys hold any sink tokens already: the one call, no copy."""
        return tuple(self.pieces(n, heads, offset=offset, total=total)), ()


class _Chunked(_Builtin):
    head_invariant = True

    def __init__(self, chunks: int = 4, backend: Optional[str] = None, sink_tokens: int = 0) -> None:
        self.check_params(chunks, backend, sink_tokens)
        super().__init__(backend, chunks=chunks)
        self.chunks = chunks
        self._set_sinks(sink_tokens)

    @classmethod
    def check_params(cls, chunks: int = 4, backend: Optional[str] = None, sink_tokens: int = 0) -> None:
        check_int("chunks", chunks, cls.name)
        super().check_params(backend, sink_tokens)

    def sizes(self, n: int) -> tuple[int, int]:
        w = chunk_size(n, self.chunks)
        return w, w // 2

    def chunk_width(self, n: int) -> Optional[int]:
        return self.sizes(n)[0]

    def own_widest(self, n: int, num_heads: int) -> list[int]:
        """``widest`` without sink tokens, in closed form (each leaf's)."""
        raise NotImplementedError

    def widest(self, n, num_heads):
        """With sinks, a query sees them and then its own keys past them; along rows that share
        their first key that count grows with the row, so the most is at the end of such a
        stretch: a chunk's or a shifted chunk's last row, or the sequence's (O(chunks) rows)."""
        if not self.sink_tokens:
            return self.own_widest(n, num_heads)
        w, g = self.sizes(n)
        ends = {n - 1} | {end for c in range(-(-n // w) + 1) for end in (c * w - 1, c * w + g - 1) if 0 <= end < n}
        count = self.counts(torch.zeros(1, dtype=torch.int64), torch.tensor(sorted(ends)), n, num_heads)
        return [max(min(self.sink_tokens, n), int(count.max()))] * num_heads

    def workspace(self, n, heads, *, kv_heads, head_dim, dtype_bytes, kernel="fused") -> Workspace:
        """Chunks folded into the calls' batch: n rows, each scored against one chunk of w keys."""
        call = kernel_call(n, n, heads=heads, kv_heads=kv_heads, head_dim=head_dim, dtype_bytes=dtype_bytes, kernel=kernel,
                           width=self.sizes(n)[0])
        merged = pieces([call], rows=n, heads=heads, kv_heads=kv_heads, head_dim=head_dim, dtype_bytes=dtype_bytes)
        return _sink_copies(merged, self.sink_tokens, rows=n, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                            dtype_bytes=dtype_bytes)


class Local(_Chunked):
    """Same chunk: ``i // w == j // w`` (LongLoRA S² unshifted heads, SCCA's plain heads)."""

    name = "local"

    def keys(self, h, i, n, num_heads) -> Keys:
        w, _ = self.sizes(n)
        lo = i // w * w
        return lo, lo + w - 1, torch.ones_like(i)

    def own_widest(self, n, num_heads):
        return [self.sizes(n)[0]] * num_heads  # the first chunk is whole (w <= n)

    def pieces(self, n, heads, *, offset, total):
        return causal_blocks(range(heads), 0, n, self.sizes(n)[0])


class ShiftedChunks(_Chunked):
    """S² shifted heads: chunk boundaries moved by g, ``(i-g)//w == (j-g)//w``; the first
    chunk ``[0, g)`` and the last are partial, and nothing wraps around the sequence end."""

    name = "s2_shifted"

    def __init__(self, chunks: int = 4, shift: float = 0.5, backend: Optional[str] = None) -> None:
        super().__init__(chunks, backend)
        _check_share("shift", shift, self.name)
        self.shift = shift
        if shift != 0.5:
            self.params["shift"] = shift

    def sizes(self, n: int) -> tuple[int, int]:
        """g = floor(w · shift): w // 2 at the default half a chunk."""
        w = chunk_size(n, self.chunks)
        return w, int(w * self.shift)

    def keys(self, h, i, n, num_heads) -> Keys:
        w, g = self.sizes(n)
        start = torch.div(i - g, w, rounding_mode="floor") * w + g
        return start.clamp(min=0), start + w - 1, torch.ones_like(i)

    def own_widest(self, n, num_heads):
        w, g = self.sizes(n)
        return [max(g, min(w, n - g))] * num_heads  # the partial chunk [0, g), or the next from g

    def pieces(self, n, heads, *, offset, total):
        w, g = self.sizes(n)
        if g == 0:
            return causal_blocks(range(heads), 0, n, w)
        first = min(g, n)  # the partial first chunk [0, g), then ordinary chunks from g on
        return causal_blocks(range(heads), 0, first, first) + causal_blocks(range(heads), first, n, w)


class RolledKeys(_Chunked):
    """SCCA fixed, shifted heads: keys and values rolled right by g while queries stay, so
    query chunk c sees ``(j + g) // w == c``, the window ``[c*w - g, c*w - g + w)``. The roll
    never wraps: chunk 0 sees only ``[0, w - g)`` (the wrap is the leak other projects have)."""

    name = "scca_rolled"

    def keys(self, h, i, n, num_heads) -> Keys:
        w, g = self.sizes(n)
        start = i // w * w - g
        return start.clamp(min=0), start + w - 1, torch.ones_like(i)

    def own_widest(self, n, num_heads):
        w, g = self.sizes(n)  # chunk 0 sees [0, w - g); chunk 1 its window, cut by the sequence's end
        return [max(w - g, min(w, n - w + g)) if n > w else w - g] * num_heads

    def pieces(self, n, heads, *, offset, total):
        """Row u of chunk c sees the g keys before the chunk and its own chunk's keys up to u
        while u < s = w - g, its whole window from u = s on. So the rows u < s are causal
        attention inside the windows [c*w - g, c*w - g + w): square calls over the sequence
        cut at s, s + w, s + 2w, ..., whose first g rows (chunk c - 1's last, computed for
        the square) are not written; the rows u >= s attend their window whole. Chunk 0's
        window is [0, s): the same with a key block of s rows."""
        w, g = self.sizes(n)
        hs = range(heads)
        if g == 0:
            return causal_blocks(hs, 0, n, w)
        s, whole, last = w - g, n // w - 1, n // w
        found = causal_blocks(hs, 0, min(s, n), s) + causal_blocks(hs, s, n, w, skip=g)
        if n > s:
            found.append(Piece(hs, Rows(s, min(w, n) - s), Rows(0, s), causal=False))
        if whole > 0:
            found.append(Piece(hs, Rows(w + s, g, whole, w), Rows(s, w, whole, w), causal=False))
        if last >= 1 and n > last * w + s:
            found.append(Piece(hs, Rows(last * w + s, n - last * w - s), Rows(last * w - g, w), causal=False))
        return found


class LaggedChunk(_Chunked):
    """SCCA flow, head group ``lag``: query chunk c >= lag sees all of key chunk c - lag;
    earlier chunks (where the roll would bring in future tokens) attend their own chunk."""

    name = "scca_lag"

    def __init__(self, chunks: int = 4, lag: int = 0, backend: Optional[str] = None) -> None:
        super().__init__(chunks, backend)
        if not isinstance(lag, int) or lag < 0:
            raise ValueError(f"{self.name}: lag={lag!r} must be an integer >= 0")
        self.lag = lag
        self.params["lag"] = lag

    def keys(self, h, i, n, num_heads) -> Keys:
        w, _ = self.sizes(n)
        c = i // w
        src = torch.where(c >= self.lag, c - self.lag, c)
        return src * w, src * w + w - 1, torch.ones_like(i)

    def own_widest(self, n, num_heads):
        return [self.sizes(n)[0]] * num_heads  # chunk 0 is whole and sees itself

    def pieces(self, n, heads, *, offset, total):
        w, _ = self.sizes(n)
        hs, lag = range(heads), self.lag
        if lag == 0:
            return causal_blocks(hs, 0, n, w)
        found = causal_blocks(hs, 0, min(lag * w, n), w)  # the chunks before ``lag``: their own
        whole, last = n // w - lag, n // w
        if whole > 0:
            found.append(Piece(hs, Rows(lag * w, w, whole, w), Rows(0, w, whole, w), causal=False))
        if last >= lag and n > last * w:  # a partial last chunk sees a whole one
            found.append(Piece(hs, Rows(last * w, n - last * w), Rows((last - lag) * w, w), causal=False))
        return found


@register
class Dilated(_Builtin):
    """``sda``: head h takes offset r = h % dilation; queries and keys ≡ r (mod dilation)
    attend causally among themselves (LongNet dilation over the whole sequence); the other
    queries get 0 from that head."""

    name = "sda"

    def __init__(self, dilation: int = 2, backend: Optional[str] = None, sink_tokens: int = 0) -> None:
        self.check_params(dilation, backend, sink_tokens)
        super().__init__(backend, dilation=dilation)
        self.dilation = dilation
        self._set_sinks(sink_tokens)

    @classmethod
    def check_params(cls, dilation: int = 2, backend: Optional[str] = None, sink_tokens: int = 0) -> None:
        check_int("dilation", dilation, cls.name)
        super().check_params(backend, sink_tokens)

    def workspace(self, n, heads, *, kv_heads, head_dim, dtype_bytes, kernel="fused") -> Workspace:
        """One causal call over each head's n / dilation rows, merged into the n-row output."""
        m = -(-n // self.dilation)
        call = kernel_call(m, m, heads=heads, kv_heads=kv_heads, head_dim=head_dim, dtype_bytes=dtype_bytes, kernel=kernel)
        merged = pieces([call], rows=n, heads=heads, kv_heads=kv_heads, head_dim=head_dim, dtype_bytes=dtype_bytes)
        return _sink_copies(merged, self.sink_tokens, rows=m, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                            dtype_bytes=dtype_bytes)

    def keys(self, h, i, n, num_heads) -> Keys:
        r = h % self.dilation
        on = (i % self.dilation) == r
        lo = torch.where(on, r, 1)
        hi = torch.where(on, i, 0)  # hi < lo: nothing visible
        return lo, hi, torch.full_like(i, self.dilation)

    def widest(self, n, num_heads):
        theta, sink, out = self.dilation, self.sink_tokens, []
        for h in range(num_heads):
            rows = range(h % theta, n, theta)  # the head's rows; with sinks, its last row sees the most of them
            if not sink:
                out.append(len(rows))
                continue
            last = rows[-1] if rows else -1
            past = range(rows.start + max(0, -(-(sink - rows.start) // theta)) * theta, last + 1, theta)
            out.append(max(min(sink, n), min(sink, last + 1) + len(past)))
        return out

    def pieces(self, n, heads, *, offset, total):
        """Per residue r, the heads h with (offset + h) % dilation == r (every dilation-th head)
        in one causal call on rows r, r + dilation, ... of q/k/v: strided views, so no gather
        and no copy; the other rows of those heads stay 0."""
        step, found = self.dilation, []
        for r in range(step):
            first, rows = (r - offset) % step, len(range(r, n, step))
            if first < heads and rows:
                span = Rows(r, rows, step=step)
                found.append(Piece(range(first, heads, step), span, span, causal=True))
        return found


PatternSpec = Union[str, Pattern, dict]


class Mixed(_Builtin):
    """``mixed``: heads split in order among patterns, ``[(spec, share), ...]`` with shares
    summing to 1. Sub-patterns see their own heads numbered from 0. The published patterns
    below are mixes of this module's leaves."""

    name = "mixed"
    head_rule = ""

    def __init__(self, parts: Sequence[tuple[PatternSpec, float]], backend: Optional[str] = None,
                 sink_tokens: int = 0) -> None:
        self._mix(parts, backend, sink_tokens=sink_tokens)

    @classmethod
    def check_params(cls, parts: Sequence[tuple[PatternSpec, float]], backend: Optional[str] = None,
                     sink_tokens: int = 0) -> None:
        _check_mix(cls.name, parts, backend)
        _check_sinks(cls.name, sink_tokens)

    def _mix(self, parts: Sequence[tuple[PatternSpec, float]], backend: Optional[str],
             shown: Optional[dict[str, Any]] = None, *, sink_tokens: int = 0) -> None:
        """Check ``parts`` (as :meth:`check_params` does) and build them; ``shown``: the
        parameters ``repr`` shows (default: the parts)."""
        _check_mix(self.name, parts, backend)
        _check_sinks(self.name, sink_tokens)
        built = [(PATTERNS.build(spec), float(share)) for spec, share in parts]
        super().__init__(backend, **(shown or {"parts": [(repr(p), s) for p, s in built]}))
        self.parts = built
        self._set_sinks(sink_tokens)

    def _set_sinks(self, sink_tokens: int) -> None:
        """Sinks of a mix are its parts': each part sees at least ``sink_tokens`` (a part of its
        own with more keeps them); a part registered from outside takes none."""
        super()._set_sinks(sink_tokens)
        if not sink_tokens:
            return
        for p, _ in self.parts:
            if not isinstance(p, _Builtin):
                raise ValueError(f"{self.name}: sink_tokens={sink_tokens} needs parts of attn_patterns' own patterns; "
                                 f"{p!r} is registered from outside (give it sink tokens of its own, or none here)")
        self.parts = [(p.with_sinks(max(p.sink_tokens, sink_tokens)), share) for p, share in self.parts]

    def sinks(self, h, num_heads):
        out = torch.zeros_like(h)
        for pattern, start, end in self.split(num_heads):
            out = torch.where((h >= start) & (h < end), pattern.sinks(h - start, end - start), out)
        return out

    def check_sinks(self, seq_len: int) -> None:
        """Each part's sinks against its chunks, refused in the mix's name (what a recipe names)."""
        try:
            for pattern, _ in self.parts:
                pattern.check_sinks(seq_len)
        except ValueError as err:
            raise ValueError(f"{self!r}: {str(err).split(': ', 1)[1]}") from None

    def split(self, num_heads: int) -> list[tuple[Pattern, int, int]]:
        spans, start = [], 0
        for pattern, share in self.parts:
            count = share * num_heads
            if abs(count - round(count)) <= 1e-6 and round(count) > 0:
                try:
                    pattern.check_heads(round(count))
                except ValueError as err:
                    raise ValueError(f"{self.name}: num_heads={num_heads} gives {round(count)} heads to {err}") from None
            if abs(count - round(count)) > 1e-6 or round(count) == 0:
                raise ValueError(
                    f"{self.name}: num_heads={num_heads} gives {count:g} heads to {pattern!r} "
                    f"(share {share:g}); num_heads must give every part a whole, non-zero number of heads"
                )
            count = round(count)
            spans.append((pattern, start, start + count))
            start += count
        return spans

    def check_heads(self, num_heads: int) -> None:
        super().check_heads(num_heads)
        self.split(num_heads)

    def workspace(self, n, heads, *, kv_heads, head_dim, dtype_bytes, kernel="fused") -> Workspace:
        """Each part on its own heads (and their share of K/V heads), merged once."""
        groups = heads // kv_heads
        parts = [p.workspace(n, e - s, kv_heads=max(1, (e - s) // groups), head_dim=head_dim, dtype_bytes=dtype_bytes,
                             kernel=kernel)
                 for p, s, e in self.split(heads)]
        return pieces(parts, rows=n, heads=heads, kv_heads=kv_heads, head_dim=head_dim, dtype_bytes=dtype_bytes)

    def keys(self, h, i, n, num_heads) -> Keys:
        lo = hi = step = None
        for pattern, start, end in self.split(num_heads):
            p_lo, p_hi, p_step = pattern.keys(h - start, i, n, end - start)
            inside = (h >= start) & (h < end)
            if lo is None:
                lo, hi, step = (torch.broadcast_to(x, torch.broadcast_shapes(h.shape, i.shape)) for x in (p_lo, p_hi, p_step))
            lo, hi, step = (torch.where(inside, new, old) for new, old in ((p_lo, lo), (p_hi, hi), (p_step, step)))
        return lo, hi, step

    def widest(self, n, num_heads):
        out: list[int] = []
        for pattern, start, end in self.split(num_heads):
            part = pattern.widest(n, end - start)
            if part is None:
                return None
            out += part
        return out

    def rule(self, h, i, j, *, n, num_heads):
        """Each part's own rule on its heads (works for parts stated as a mask_mod only)."""
        out = None
        for pattern, start, end in self.split(num_heads):
            local = (h - start).clamp(0, end - start - 1)
            own = ((h >= start) & (h < end)) & pattern.rule(local, i, j, n=n, num_heads=end - start)
            out = own if out is None else out | own
        return out

    def _layout(self, n, heads, *, offset, total):
        # each part's share of heads [offset, last), as local heads [s, e) and the part's own
        # heads [s + offset - start, ...) of its end - start; every part's pieces in one run
        last = offset + heads
        found, delegated = [], []
        for p, start, end in self.split(total):
            if start >= last or end <= offset:
                continue
            s, e = max(start, offset) - offset, min(end, last) - offset
            own = dict(offset=s + offset - start, total=end - start)
            if isinstance(p, _Builtin):
                sub_pieces, sub_delegated = p.layout(n, e - s, **own)
                found += [piece.moved(s) for piece in sub_pieces]
                delegated += [d.moved(s) for d in sub_delegated]
            else:
                delegated.append(Delegated(p, s, e, **own))
        return tuple(found), tuple(delegated)


def _kv_heads(k, v, *, start: int, end: int, groups: int, native: bool):
    """K/V for query heads ``[start, end)``: the KV heads they read, as they are when the
    slice covers whole KV groups or lies inside one; repeated only when it cuts across a
    group boundary or the sub-pattern needs one K/V head per query head."""
    lo, hi = start // groups, (end - 1) // groups + 1
    if native and ((start % groups == 0 and end % groups == 0) or hi - lo == 1):
        return k[:, lo:hi], v[:, lo:hi]
    return tuple(x[:, lo:hi].repeat_interleave(groups, dim=1)[:, start - lo * groups : end - lo * groups] for x in (k, v))


def _check_mix(owner: str, parts: Any, backend: Optional[str]) -> None:
    """What a mix refuses: no parts, an entry that is no (pattern, share) pair, a share out of
    (0, 1], a part its registry would refuse (checked, not built), shares not summing to 1."""
    if not parts:
        raise ValueError(f"{owner}: parts=[] must list at least one (pattern, share of heads)")
    shares = []
    for entry in parts:
        if not (isinstance(entry, (tuple, list)) and len(entry) == 2):
            raise ValueError(f"{owner}: parts entry {entry!r} must be a (pattern, share of heads) pair")
        spec, share = entry
        if not isinstance(share, (int, float)) or not 0 < share <= 1:
            raise ValueError(f"{owner}: share={share!r} of {spec!r} must be a number in (0, 1]")
        PATTERNS.check_spec(spec)
        shares.append(float(share))
    if abs(sum(shares) - 1.0) > 1e-6:
        raise ValueError(f"{owner}: shares={shares} must sum to 1 (they sum to {sum(shares):g})")
    _check_backend(owner, backend)


# --- the published patterns -----------------------------------------------------------------
# Tagged "scca_table2": the patterns SCCA's Table 2 fine-tunes, which the experiment trains and
# `sparse-ft bench train` times by default (PATTERNS.names(tag="scca_table2")). A selection, not
# every sparse pattern: sda is LongMixed's component, not a row of the paper's table.


class _ChunkMix(Mixed):
    """A published pattern: a mix of leaves built from one parameter, ``chunks``, which is
    checked as the leaf ``leaf`` checks it (so the message names that leaf, as building it would)."""

    leaf: type[Pattern] = Local

    def __init__(self, chunks: int = 4, backend: Optional[str] = None, sink_tokens: int = 0) -> None:
        self.check_params(chunks, backend, sink_tokens)
        self._mix(self.leaves(chunks), backend, {"chunks": chunks}, sink_tokens=sink_tokens)

    @classmethod
    def check_params(cls, chunks: int = 4, backend: Optional[str] = None, sink_tokens: int = 0) -> None:  # type: ignore[override]
        cls.leaf.check_params(chunks=chunks)
        _check_backend(cls.name, backend)
        _check_sinks(cls.name, sink_tokens)

    def leaves(self, chunks: int) -> list[tuple[Pattern, float]]:
        raise NotImplementedError


@register(tags=("scca_table2",))
class S2(_ChunkMix):
    """LongLoRA S²: half the heads in chunks, half in chunks shifted by g."""

    name, head_multiple, head_rule = "s2", 2, "half the heads in chunks, half in shifted chunks"

    def leaves(self, chunks):
        return [(Local(chunks), 0.5), (ShiftedChunks(chunks), 0.5)]


@register(tags=("scca_table2",))
class SccaFixed(_ChunkMix):
    """SCCA fixed: heads [0, H/2) see keys rolled by g, heads [H/2, H) their own chunk."""

    name, head_multiple, head_rule, leaf = "scca_fixed", 2, "half the heads on shifted keys, half in chunks", RolledKeys

    def leaves(self, chunks):
        return [(RolledKeys(chunks), 0.5), (Local(chunks), 0.5)]


@register(tags=("scca_table2",))
class SccaFlow(_ChunkMix):
    """SCCA flow: ``chunks`` head groups, group k looks k chunks back, so across the heads every
    query chunk reaches each of the ``chunks`` chunks up to itself."""

    name = "scca_flow"

    @classmethod
    def check_params(cls, chunks: int = 4, backend: Optional[str] = None, sink_tokens: int = 0) -> None:
        check_int("chunks", chunks, cls.name, most=MAX_HEADS, why=HEADS_WHY)  # one head group per chunk, built below
        _check_backend(cls.name, backend)
        _check_sinks(cls.name, sink_tokens)

    @property
    def head_multiple(self) -> int:  # type: ignore[override]
        return self.params["chunks"]

    @property
    def head_rule(self) -> str:  # type: ignore[override]
        return f"one group of num_heads/chunks heads per look-back 0..{self.head_multiple - 1}; lower chunks or change heads"

    def leaves(self, chunks):
        return [(LaggedChunk(chunks, lag), 1.0 / chunks) for lag in range(chunks)]


@register(tags=("scca_table2",))
class LongMixed(_ChunkMix):
    """SCCA LongMixed: heads [H/4 | H/4 | H/2] = scca_fixed | sda θ=2 | sda θ=4
    (the paper's 8 / 8 / 16 of 32 heads)."""

    name, head_multiple, leaf = "longmixed", 8, SccaFixed
    head_rule = "heads split H/4 | H/4 | H/2 into scca_fixed | sda 2 | sda 4, and scca_fixed halves its heads"

    def leaves(self, chunks):
        return [(SccaFixed(chunks), 0.25), (Dilated(2), 0.25), (Dilated(4), 0.5)]


@register
class SfAttn(_ChunkMix):
    """SinkLoRA's SF-Attn (Sink Fixed Attention; Zhang, arXiv 2406.05678): S²-Attn's head
    groups with the shifted groups *reassembled*, plus global attention to sink tokens.

    What the paper defines: LongLoRA's S²-Attn splits the sequence into groups and, on half
    of the heads, shifts the tokens by half a group with a cyclic roll, so the last group
    mixes the sequence's last tokens with its first ones (the "unnecessary information
    exchange between token groups" the paper blames for S² reaching 39 % of full attention's
    perplexity gain). SF-Attn's segmentation and reassembly returns the tokens the shift
    carried past the end to their original place, so no group spans the wrap, and adds
    global attention to the first tokens, the "sink attention tokens"; it reports 92 %.

    Our reading, where the paper leaves it open: heads ``[0, (1 - shifted)·H)`` attend inside
    chunks of w = ceil(N / chunks) (``i // w == j // w``), heads ``[(1 - shifted)·H, H)``
    inside chunks shifted by g = floor(shift · w), whose first chunk ``[0, g)`` is the
    reassembled one (the tokens the roll had wrapped, back at the start, in a segment of
    their own) and whose last is partial, never spanning the wrap; every query also sees the
    first ``sink_tokens`` keys; causality always. The paper's split and shift, half the heads
    by half a group, are the defaults; 4 sink tokens (StreamingLLM's number, which SinkLoRA
    builds on) is our default, the paper's count being a hyperparameter. Under causality
    the reassembled shifted heads see what this package's non-wrapping ``s2`` shifted heads
    see: SF-Attn with ``sink_tokens=0`` is ``s2``."""

    name = "sf_attn"
    head_rule = "heads split by shifted into whole numbers of plain and shifted heads"

    def __init__(self, chunks: int = 4, shifted: float = 0.5, shift: float = 0.5, *, sink_tokens: int = 4,
                 backend: Optional[str] = None) -> None:
        self.check_params(chunks, shifted, shift, sink_tokens=sink_tokens, backend=backend)
        self.shifted, self.shift = shifted, shift
        self._mix(self.leaves(chunks), backend, {"chunks": chunks, "shifted": shifted, "shift": shift},
                  sink_tokens=sink_tokens)

    @classmethod
    def check_params(cls, chunks: int = 4, shifted: float = 0.5, shift: float = 0.5, *,  # type: ignore[override]
                     sink_tokens: int = 4, backend: Optional[str] = None) -> None:
        check_int("chunks", chunks, cls.name)
        _check_share("shifted", shifted, cls.name)
        _check_share("shift", shift, cls.name)
        _check_backend(cls.name, backend)
        _check_sinks(cls.name, sink_tokens)

    def leaves(self, chunks):
        return [(Local(chunks), 1.0 - self.shifted), (ShiftedChunks(chunks, self.shift), self.shifted)]


register(Mixed)  # last: the order names are listed in
