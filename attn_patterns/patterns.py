"""The patterns. Each leaf says which keys a query sees (``keys``) and how to compute it with
:func:`block_attention` (``forward``); the published patterns are head mixes of leaves.

Notation: w = ceil(N / chunks) chunk size, g = w // 2 shift, c = i // w query chunk; floor
division throughout; causality (j <= i) is always added by the base class and kernels.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Union

import torch
import torch.nn.functional as F

from attn_patterns.base import PATTERNS, Keys, Pattern, chunk_size, register
from attn_patterns.checks import check_int
from attn_patterns.kernels import BACKENDS, block_attention, causal_varlen, chunk, resolve_backend, unchunk


def _one_block(x: torch.Tensor) -> torch.Tensor:
    return x.unsqueeze(2)


def causal_attention(q, k, v, backend: str) -> torch.Tensor:
    return block_attention(_one_block(q), _one_block(k), _one_block(v), offset=0, backend=backend).squeeze(2)


def local_attention(q, k, v, *, chunk_len: int, backend: str) -> torch.Tensor:
    """Causal inside consecutive chunks of ``chunk_len`` (w); a partial last chunk runs on its
    own rather than padded, so whole chunks stay zero-copy views."""
    n, w = q.shape[2], chunk_len
    whole = n // w * w
    if whole == n:
        return unchunk(block_attention(chunk(q, w), chunk(k, w), chunk(v, w), offset=0, backend=backend), n)
    sizes = [whole, n - whole] if whole else [n]
    parts = [x.split(sizes, dim=2) for x in (q, k, v)]
    outs = [local_attention(*(p[0] for p in parts), chunk_len=w, backend=backend)] if whole else []
    outs.append(causal_attention(*(p[-1] for p in parts), backend))
    return torch.cat(outs, dim=2)


class _Builtin(Pattern):
    """The patterns of this module: kernels that take grouped K/V as they are, on the
    backends of :mod:`attn_patterns.kernels` (checked here, so a recipe typo fails at ``get``)."""

    native_gqa = True

    def __init__(self, backend: Optional[str] = None, **params: Any) -> None:
        if backend is not None and backend not in BACKENDS:
            raise ValueError(f"{self.name}: backend={backend!r} is unknown; allowed: {', '.join(BACKENDS)} or None (= sdpa)")
        super().__init__(backend, **params)


@register
class Causal(_Builtin):
    """``causal``: every earlier key, on the toolkit's kernels (the model's own attention is
    the method ``full``)."""

    name = "causal"
    head_invariant = True

    def __init__(self, backend: Optional[str] = None) -> None:
        super().__init__(backend)

    def keys(self, h, i, n, num_heads) -> Keys:
        return torch.zeros_like(i), i, torch.ones_like(i)

    def forward(self, q, k, v, backend):
        return causal_attention(q, k, v, backend)

    def packed_kernel(self, q):
        return causal_varlen if resolve_backend(self.backend, q) == "flash" else None


class _Chunked(_Builtin):
    head_invariant = True

    def __init__(self, chunks: int = 4, backend: Optional[str] = None) -> None:
        super().__init__(backend, chunks=check_int("chunks", chunks, self.name))
        self.chunks = chunks

    def sizes(self, n: int) -> tuple[int, int]:
        w = chunk_size(n, self.chunks)
        return w, w // 2


class Local(_Chunked):
    """Same chunk: ``i // w == j // w`` (LongLoRA S² unshifted heads, SCCA's plain heads)."""

    name = "local"

    def keys(self, h, i, n, num_heads) -> Keys:
        w, _ = self.sizes(n)
        lo = i // w * w
        return lo, lo + w - 1, torch.ones_like(i)

    def forward(self, q, k, v, backend):
        return local_attention(q, k, v, chunk_len=self.sizes(q.shape[2])[0], backend=backend)


class ShiftedChunks(_Chunked):
    """S² shifted heads: chunk boundaries moved by g, ``(i-g)//w == (j-g)//w``; the first
    chunk ``[0, g)`` and the last are partial, and nothing wraps around the sequence end."""

    name = "s2_shifted"

    def keys(self, h, i, n, num_heads) -> Keys:
        w, g = self.sizes(n)
        start = torch.div(i - g, w, rounding_mode="floor") * w + g
        return start.clamp(min=0), start + w - 1, torch.ones_like(i)

    def forward(self, q, k, v, backend):
        n = q.shape[2]
        w, g = self.sizes(n)
        if g == 0 or n <= g:
            return local_attention(q, k, v, chunk_len=w, backend=backend)
        # the partial first chunk [0, g), then ordinary chunks from g on (split: no copies)
        (q0, q1), (k0, k1), (v0, v1) = (x.split([g, n - g], dim=2) for x in (q, k, v))
        first = causal_attention(q0, k0, v0, backend)
        return torch.cat([first, local_attention(q1, k1, v1, chunk_len=w, backend=backend)], dim=2)


class RolledKeys(_Chunked):
    """SCCA fixed, shifted heads: keys and values rolled right by g while queries stay, so
    query chunk c sees ``(j + g) // w == c``, the window ``[c*w - g, c*w - g + w)``. The roll
    never wraps: chunk 0 sees only ``[0, w - g)`` (the wrap is the leak other projects have)."""

    name = "scca_rolled"

    def keys(self, h, i, n, num_heads) -> Keys:
        w, g = self.sizes(n)
        start = i // w * w - g
        return start.clamp(min=0), start + w - 1, torch.ones_like(i)

    def forward(self, q, k, v, backend):
        n = q.shape[2]
        w, g = self.sizes(n)
        if g == 0:
            return local_attention(q, k, v, chunk_len=w, backend=backend)
        qc = chunk(q, w)
        blocks = qc.shape[2]
        (k0, k1), (v0, v1) = (x.split([w - g, n - w + g], dim=2) for x in (k, v))
        q0, q1 = qc.split([1, blocks - 1], dim=2)
        first = block_attention(q0, _one_block(k0), _one_block(v0), offset=0, backend=backend)
        if blocks == 1:
            return unchunk(first, n)
        kc, vc = (chunk(x, w)[:, :, : blocks - 1] for x in (k1, v1))
        rest = block_attention(q1, kc, vc, offset=g, backend=backend)
        return unchunk(torch.cat([first, rest], dim=2), n)


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

    def forward(self, q, k, v, backend):
        n = q.shape[2]
        w, _ = self.sizes(n)
        qc, kc, vc = (chunk(x, w) for x in (q, k, v))
        blocks = qc.shape[2]
        own = min(self.lag, blocks) if self.lag else blocks
        if own == blocks:
            return unchunk(block_attention(qc, kc, vc, offset=0, backend=backend), n)
        q0, q1 = qc.split([own, blocks - own], dim=2)
        first = block_attention(q0, kc[:, :, :own], vc[:, :, :own], offset=0, backend=backend)
        src = slice(0, blocks - self.lag)
        rest = block_attention(q1, kc[:, :, src], vc[:, :, src], offset=None, backend=backend)
        return unchunk(torch.cat([first, rest], dim=2), n)


@register
class Dilated(_Builtin):
    """``sda``: head h takes offset r = h % dilation; queries and keys ≡ r (mod dilation)
    attend causally among themselves (LongNet dilation over the whole sequence); the other
    queries get 0 from that head."""

    name = "sda"

    def __init__(self, dilation: int = 2, backend: Optional[str] = None) -> None:
        super().__init__(backend, dilation=check_int("dilation", dilation, self.name))
        self.dilation = dilation

    def keys(self, h, i, n, num_heads) -> Keys:
        r = h % self.dilation
        on = (i % self.dilation) == r
        lo = torch.where(on, r, 1)
        hi = torch.where(on, i, 0)  # hi < lo: nothing visible
        return lo, hi, torch.full_like(i, self.dilation)

    def forward(self, q, k, v, backend):
        return self.forward_heads(q, k, v, backend, offset=0, total=q.shape[1])

    def forward_heads(self, q, k, v, backend, *, offset, total):
        # View the sequence as (M, dilation) and let head h take column (offset + h) % dilation
        # of its own q and of its K/V head h // groups: one causal call for all heads, K/V
        # never repeated. Tail padding sits after every real token, so it is invisible to real
        # queries; the rows it adds are dropped.
        b, h, n, d = q.shape
        step = self.dilation
        m = -(-n // step)
        heads = torch.arange(h, device=q.device)
        column = (heads + offset) % step

        def pick(x: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
            grid = F.pad(x, (0, 0, 0, m * step - n)).view(b, x.shape[1], m, step, d)
            return grid[:, source, :, column].transpose(0, 1)  # (B, H, M, D)

        groups = h // k.shape[1]
        out = causal_attention(pick(q, heads), pick(k, heads // groups), pick(v, heads // groups), backend)
        index = column.view(1, h, 1, 1, 1).expand(b, h, m, 1, d)
        # in the kernel's dtype, not q's: under autocast the model hands q (and k) in fp32 (RoPE
        # over fp32 masters) and v in half precision, and the kernel answers in half precision
        spread = out.new_zeros(b, h, m, step, d).scatter(3, index, out.unsqueeze(3))
        return spread.view(b, h, m * step, d)[:, :, :n]


PatternSpec = Union[str, Pattern, dict]


class Mixed(_Builtin):
    """Heads split in order among patterns: ``[(spec, share), ...]`` with shares summing to 1.
    Sub-patterns see their own heads numbered from 0."""

    name = "mixed"

    def __init__(
        self,
        parts: Sequence[tuple[PatternSpec, float]],
        backend: Optional[str] = None,
        *,
        name: str = "mixed",
        head_multiple: int = 1,
        head_rule: str = "",
        **params: Any,
    ) -> None:
        self.name = name
        self.head_multiple, self.head_rule = head_multiple, head_rule
        if not parts:
            raise ValueError(f"{name}: parts=[] must list at least one (pattern, share of heads)")
        built, shares = [], []
        for entry in parts:
            if not (isinstance(entry, (tuple, list)) and len(entry) == 2):
                raise ValueError(f"{name}: parts entry {entry!r} must be a (pattern, share of heads) pair")
            spec, share = entry
            if not isinstance(share, (int, float)) or not 0 < share <= 1:
                raise ValueError(f"{name}: share={share!r} of {spec!r} must be a number in (0, 1]")
            built.append(PATTERNS.build(spec))
            shares.append(float(share))
        if abs(sum(shares) - 1.0) > 1e-6:
            raise ValueError(f"{name}: shares={shares} must sum to 1 (they sum to {sum(shares):g})")
        super().__init__(backend, **(params or {"parts": [(repr(p), s) for p, s in zip(built, shares)]}))
        self.parts = list(zip(built, shares))

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

    def keys(self, h, i, n, num_heads) -> Keys:
        lo = hi = step = None
        for pattern, start, end in self.split(num_heads):
            p_lo, p_hi, p_step = pattern.keys(h - start, i, n, end - start)
            inside = (h >= start) & (h < end)
            if lo is None:
                lo, hi, step = (torch.broadcast_to(x, torch.broadcast_shapes(h.shape, i.shape)) for x in (p_lo, p_hi, p_step))
            lo, hi, step = (torch.where(inside, new, old) for new, old in ((p_lo, lo), (p_hi, hi), (p_step, step)))
        return lo, hi, step

    def rule(self, h, i, j, *, n, num_heads):
        """Each part's own rule on its heads (works for parts stated as a mask_mod only)."""
        out = None
        for pattern, start, end in self.split(num_heads):
            local = (h - start).clamp(0, end - start - 1)
            own = ((h >= start) & (h < end)) & pattern.rule(local, i, j, n=n, num_heads=end - start)
            out = own if out is None else out | own
        return out

    def forward(self, q, k, v, backend):
        return self.forward_heads(q, k, v, backend, offset=0, total=q.shape[1])

    def forward_heads(self, q, k, v, backend, *, offset, total):
        # each part's share of heads [offset, last), as local heads [s, e) and the part's own
        # heads [s + offset - start, ...) of its end - start
        last = offset + q.shape[1]
        spans = [(p, max(start, offset) - offset, min(end, last) - offset, start, end)
                 for p, start, end in self.split(total) if start < last and end > offset]
        groups = q.shape[1] // k.shape[1]
        sizes = [e - s for _, s, e, _, _ in spans]
        # split (not slicing): its backward is one cat instead of a zero-filled copy per part
        qs = q.split(sizes, dim=1)
        if all(p.native_gqa and s % groups == 0 and e % groups == 0 for p, s, e, _, _ in spans):
            kvs = zip(*(x.split([n // groups for n in sizes], dim=1) for x in (k, v)))
        else:
            kvs = (_kv_heads(k, v, start=s, end=e, groups=groups, native=p.native_gqa) for p, s, e, _, _ in spans)
        return torch.cat([p.forward_heads(qh, *kv, backend, offset=s + offset - start, total=end - start)
                          for (p, s, _, start, end), qh, kv in zip(spans, qs, kvs)], dim=1)


def _kv_heads(k, v, *, start: int, end: int, groups: int, native: bool):
    """K/V for query heads ``[start, end)``: the KV heads they read, as they are when the
    slice covers whole KV groups or lies inside one; repeated only when it cuts across a
    group boundary or the sub-pattern needs one K/V head per query head."""
    lo, hi = start // groups, (end - 1) // groups + 1
    if native and ((start % groups == 0 and end % groups == 0) or hi - lo == 1):
        return k[:, lo:hi], v[:, lo:hi]
    return tuple(x[:, lo:hi].repeat_interleave(groups, dim=1)[:, start - lo * groups : end - lo * groups] for x in (k, v))


# --- the published patterns -----------------------------------------------------------------


@register
def s2(chunks: int = 4, backend: Optional[str] = None) -> Mixed:
    """LongLoRA S²: half the heads in chunks, half in chunks shifted by g."""
    parts = [(Local(chunks), 0.5), (ShiftedChunks(chunks), 0.5)]
    return Mixed(parts, backend, name="s2", head_multiple=2, head_rule="half the heads in chunks, half in shifted chunks",
                 chunks=chunks)


@register
def scca_fixed(chunks: int = 4, backend: Optional[str] = None) -> Mixed:
    """SCCA fixed: heads [0, H/2) see keys rolled by g, heads [H/2, H) their own chunk."""
    parts = [(RolledKeys(chunks), 0.5), (Local(chunks), 0.5)]
    return Mixed(parts, backend, name="scca_fixed", head_multiple=2,
                 head_rule="half the heads on shifted keys, half in chunks", chunks=chunks)


@register
def scca_flow(chunks: int = 4, backend: Optional[str] = None) -> Mixed:
    """SCCA flow: ``chunks`` head groups, group k looks k chunks back, so across the heads every
    query chunk reaches each of the ``chunks`` chunks up to itself."""
    check_int("chunks", chunks, "scca_flow")
    parts = [(LaggedChunk(chunks, lag), 1.0 / chunks) for lag in range(chunks)]
    rule = f"one group of num_heads/chunks heads per look-back 0..{chunks - 1}; lower chunks or change heads"
    return Mixed(parts, backend, name="scca_flow", head_multiple=chunks, head_rule=rule, chunks=chunks)


@register
def longmixed(chunks: int = 4, backend: Optional[str] = None) -> Mixed:
    """SCCA LongMixed: heads [H/4 | H/4 | H/2] = scca_fixed | sda θ=2 | sda θ=4
    (the paper's 8 / 8 / 16 of 32 heads)."""
    parts = [(scca_fixed(chunks), 0.25), (Dilated(2), 0.25), (Dilated(4), 0.5)]
    rule = "heads split H/4 | H/4 | H/2 into scca_fixed | sda 2 | sda 4, and scca_fixed halves its heads"
    return Mixed(parts, backend, name="longmixed", head_multiple=8, head_rule=rule, chunks=chunks)


@register
def mixed(parts: Sequence[tuple[PatternSpec, float]], backend: Optional[str] = None) -> Mixed:
    return Mixed(parts, backend)
