"""What every pattern is: a rule saying which keys each (head, query) sees, plus a kernel.

The rule is an arithmetic progression of key positions ``lo, lo+step, ..., hi`` per head and
query, always intersected with causality (``j <= i``). That one form covers every chunked,
shifted and dilated pattern of the SCCA / LongLoRA family, and gives for free the dense mask
(tests and pictures), the FlexAttention mask and the exact count of visible pairs (the
benchmark's ideal speedup) in O(H·N) instead of O(H·N²). Patterns it does not fit override
the mask_mod ``rule`` instead.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from attn_patterns.checks import check_int, check_qkv
from attn_patterns.kernels import resolve_backend
from attn_patterns.registry import Registry
from attn_patterns.workspace import Workspace, kernel_call, pieces

Keys = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def chunk_size(n: int, chunks: int) -> int:
    """w = ceil(N / chunks): LongLoRA's group size, SCCA's segment length."""
    return -(-n // chunks)


def above(lo: torch.Tensor, step: torch.Tensor, floor: torch.Tensor) -> torch.Tensor:
    """The first term ``>= floor`` of the progression ``lo, lo + step, ...``: where a pattern's
    own keys resume after its sink tokens ``[0, floor)``, so that no key is counted twice."""
    return lo + torch.div(floor - lo + step - 1, step, rounding_mode="floor").clamp(min=0) * step


class Pattern:
    """Base class. A subclass states its rule either as ``keys`` (a progression per head and
    query: exact pair counts in O(H·N)) or, when that form does not fit, by overriding
    ``rule`` (an attention-gym mask_mod: pair counts then take O(H·N²) time in row blocks,
    still no N×N tensor). Causality is added to either, always. ``forward`` is the fast
    path. ``head_multiple`` is the number the head count must be divisible by (``head_rule``
    says why); ``native_gqa`` says ``forward`` accepts K/V with fewer heads than q
    (otherwise ``__call__`` repeats them first). The visible set is the rule's whatever the
    data, and ``__call__`` takes q/k as a model hands them over (rotated at their true
    positions), so any model runs any pattern through one adapter (``sparse_ft.methods``).
    What moves positions or picks keys from the data is no pattern but an
    :class:`~attn_patterns.algorithm.Algorithm` (DCA, LongHeads)."""

    name: str = "pattern"
    head_multiple: int = 1
    head_rule: str = "the pattern splits heads into groups"
    native_gqa: bool = False
    head_invariant: bool = False  # the rule ignores the head index, so any slice of heads runs ``forward`` as is
    sink_tokens: int = 0  # every query also sees keys [0, sink_tokens), causally (the patterns of attn_patterns.patterns set it)

    def __init__(self, backend: Optional[str] = None, **params: Any) -> None:
        self.backend = backend
        self.params = params

    @classmethod
    def check_params(cls, **params: Any) -> None:
        """Refuse the constructor's parameter values (ValueError, one line) without building
        the pattern: what ``PATTERNS.check`` runs on a recipe, which stays data until the run
        builds it once. A pattern that checks values overrides it and calls it first in its
        constructor, so each value is refused by one piece of code; this default checks none."""

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.params.items())
        return f"{self.name}({args})"

    # --- the rule -------------------------------------------------------------------------
    def keys(self, h: torch.Tensor, i: torch.Tensor, n: int, num_heads: int) -> Keys:
        """Visible keys of head ``h`` and query ``i`` (broadcastable int64 tensors) as the
        progression ``(lo, hi, step)``, before causality. An empty set has ``hi < lo``."""
        raise NotImplementedError

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: str) -> torch.Tensor:
        """Fast path. k/v have as many heads as q unless ``native_gqa`` (then ``H % Hkv == 0``)."""
        raise NotImplementedError

    def forward_heads(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: str, *, offset: int, total: int
    ) -> torch.Tensor:
        """``forward`` for q's heads as heads ``[offset, offset + H)`` of ``total``. Patterns whose
        rule reads the head index (head groups, dilation offsets) override it."""
        if self.head_invariant or (offset == 0 and q.shape[1] == total):
            return self.forward(q, k, v, backend)
        raise ValueError(
            f"{self.name}: its rule reads the head index and it defines no forward_heads, so it cannot compute "
            f"heads [{offset}, {offset + q.shape[1]}) of {total} alone (as a sequence-parallel rank does); "
            "define forward_heads, or set head_invariant = True if the rule ignores the head index"
        )

    def heads(self, offset: int, total: int) -> "Pattern":
        """This pattern computing heads ``[offset, offset + H)`` of ``total`` from q/k/v that hold
        only those heads (and their K/V heads): what one rank runs under DeepSpeed Ulysses, which
        hands each rank the whole sequence for a slice of the heads. Equal to those heads of
        the whole-head call. Views are kept, so a flex block mask built for one is reused."""
        views = self.__dict__.setdefault("_head_views", {})
        if (offset, total) not in views:
            views[(offset, total)] = HeadSlice(self, offset, total)
        return views[(offset, total)]

    def packed_kernel(self, q: torch.Tensor) -> Optional[Callable[..., torch.Tensor]]:
        """A kernel computing sequences laid end to end in one call, ``kernel(q, k, v, *,
        lengths)`` on (T,H,D) tokens, where this pattern has one for q's device, dtype and
        backend (``causal`` on flash-attn's varlen kernel); None: each sequence runs alone."""
        return None

    def workspace(self, n: int, heads: int, *, kv_heads: int, head_dim: int, dtype_bytes: int,
                  kernel: str = "fused") -> Workspace:
        """What one call over ``n`` tokens holds beyond q, k, v and its output, by named term,
        for the memory planner (:mod:`attn_patterns.workspace`). This default bounds any pattern
        of fused calls over at most ``n`` rows per head: pieces merged into one output, the
        largest as wide as dense attention. A pattern whose calls are narrower, or that is one
        call, overrides it: a new pattern is planned as this bound until it says otherwise."""
        call = kernel_call(n, n, heads=heads, kv_heads=kv_heads, head_dim=head_dim, dtype_bytes=dtype_bytes, kernel=kernel)
        return pieces([call], rows=n, heads=heads, kv_heads=kv_heads, head_dim=head_dim, dtype_bytes=dtype_bytes)

    def sinks(self, h: torch.Tensor, num_heads: int) -> torch.Tensor:
        """Per head ``h`` (an int tensor), how many first keys each of its queries sees besides
        ``keys`` (its sink tokens, intersected with causality); a mix answers per part."""
        return torch.full_like(h, self.sink_tokens)

    def chunk_width(self, n: int) -> Optional[int]:
        """The width of the pattern's chunks at length ``n``, None if it has none: its sink tokens
        must stay below it (a sink as wide as a chunk is a chunk seen by every query)."""
        return None

    def check_sinks(self, seq_len: int) -> None:
        """Refuse ``sink_tokens`` at or past the chunk width at this length, in one line."""
        width = self.chunk_width(seq_len)
        if self.sink_tokens and width is not None and self.sink_tokens >= width:
            raise ValueError(f"{self!r}: sink_tokens={self.sink_tokens} must be in [0, {width}) at sequence length {seq_len} "
                             f"(below the chunk width {width}); use fewer sink tokens or fewer chunks")

    # --- derived from the rule ------------------------------------------------------------
    def check_heads(self, num_heads: int) -> None:
        if num_heads % self.head_multiple:
            raise ValueError(
                f"{self.name}: num_heads={num_heads} must be divisible by {self.head_multiple} "
                f"({self.head_rule})"
            )

    def rule(self, h: torch.Tensor, i: torch.Tensor, j: torch.Tensor, *, n: int, num_heads: int) -> torch.Tensor:
        """attention-gym style mask_mod before causality: True where query i of head h may
        attend key j: the ``keys`` progression, and the sink tokens ``j < sinks(h)``. Override it
        where a progression does not fit."""
        lo, hi, step = self.keys(h, i, n, num_heads)
        return ((j >= lo) & (j <= hi) & ((j - lo) % step == 0)) | (j < self.sinks(h, num_heads))

    def visible(self, h: torch.Tensor, i: torch.Tensor, j: torch.Tensor, *, n: int, num_heads: int) -> torch.Tensor:
        """The rule, always intersected with causality: what mask(), visible_pairs() and the
        flex backend use."""
        return self.rule(h, i, j, n=n, num_heads=num_heads) & (j <= i)

    def mask(self, seq_len: int, num_heads: int) -> torch.Tensor:
        """Dense bool ``(num_heads, seq_len, seq_len)``; for tests and pictures only."""
        self.check_heads(num_heads)
        h = torch.arange(num_heads)[:, None, None]
        i = torch.arange(seq_len)[None, :, None]
        j = torch.arange(seq_len)[None, None, :]
        return self.visible(h, i, j, n=seq_len, num_heads=num_heads).expand(num_heads, seq_len, seq_len).clone()

    def check_length(self, seq_len: int, num_heads: Optional[int] = None) -> None:
        """Refuse a sequence length longer than :data:`~attn_patterns.checks.MAX_LENGTH`, or
        one at which a head lets no query see 2 keys: chunks of one token (as many ``chunks``
        as tokens, a dilation as long as the sequence) turn attention into each token
        attending to itself alone, which would train and evaluate without a word.
        ``num_heads`` defaults to the fewest heads the pattern takes. Read from
        :meth:`widest`, arithmetic for the patterns of this package; a pattern stated by
        ``rule`` alone is not checked."""
        check_int("seq_len", seq_len, repr(self))
        self.check_sinks(seq_len)
        heads = num_heads or self.fewest_heads()
        widest = None if heads is None else self.widest(seq_len, heads)
        if widest is None:
            return
        short = [h for h, count in enumerate(widest) if count < 2]
        if short:
            raise ValueError(
                f"{self!r} at sequence length {seq_len}: no query of head {short[0]} (of {heads}) sees more than "
                f"{widest[short[0]]} key, so attention would be switched off (fewer than 2 keys per chunk); "
                "use fewer chunks / a smaller dilation, or longer sequences"
            )

    def widest(self, n: int, num_heads: int) -> Optional[list[int]]:
        """Per head, the most keys any query sees at length ``n`` (causality and sink tokens
        included); None for a pattern stated by ``rule`` alone. This default reads the
        progression in O(H·N) row blocks; the patterns of this package state it in closed
        form, so that a length is checked without building anything the length's size."""
        i = torch.arange(n)[None, :]
        block = max(1, (1 << 22) // n)  # heads per step: at most ~4M entries
        out: list[int] = []
        for first in range(0, num_heads, block):
            h = torch.arange(first, min(num_heads, first + block))[:, None]
            try:
                count = self.counts(h, i, n, num_heads)
            except NotImplementedError:
                return None
            out += count.expand(len(h), n).max(dim=1).values.tolist()
        return out

    def past_sinks(self, h: torch.Tensor, i: torch.Tensor, n: int, num_heads: int) -> tuple[Keys, torch.Tensor]:
        """The visible set as two disjoint parts: the ``keys`` progression started past the
        head's sink tokens, and the sink count (what the block layout and the pair counts read).
        Raises NotImplementedError for a pattern stated by ``rule`` alone."""
        lo, hi, step = self.keys(h, i, n, num_heads)
        sink = self.sinks(h, num_heads)
        return (above(lo, step, sink), hi, step), sink

    def counts(self, h: torch.Tensor, i: torch.Tensor, n: int, num_heads: int) -> torch.Tensor:
        """How many keys query ``i`` of head ``h`` sees (broadcast int tensors): its sinks, then
        its progression's keys past them, causally. Raises NotImplementedError for a pattern
        stated by ``rule`` alone."""
        (lo, hi, step), sink = self.past_sinks(h, i, n, num_heads)
        hi = torch.minimum(hi, i)
        return torch.where(hi >= lo, torch.div(hi - lo, step, rounding_mode="floor") + 1, 0) + torch.minimum(sink, i + 1)

    def fewest_heads(self) -> Optional[int]:
        """The fewest heads the pattern can split (a multiple of ``head_multiple``, up to 256 of
        them), None if none."""
        for heads in range(self.head_multiple, 256 * self.head_multiple + 1, self.head_multiple):
            try:
                self.check_heads(heads)
            except ValueError:
                continue
            return heads
        return None

    def visible_pairs(self, seq_len: int, num_heads: int) -> int:
        """Number of True entries of ``mask(seq_len, num_heads)`` (the benchmark's ideal
        speedup is causal pairs / pattern pairs), without an N×N tensor."""
        self.check_heads(num_heads)
        h = torch.arange(num_heads)[:, None]
        i = torch.arange(seq_len)[None, :]
        try:
            count = self.counts(h, i, seq_len, num_heads)
        except NotImplementedError:
            return self._count_visible(seq_len, num_heads)
        return int(count.expand(num_heads, seq_len).sum())

    def _count_visible(self, n: int, num_heads: int) -> int:
        """Row blocks of the mask_mod, each at most ~4M entries."""
        h = torch.arange(num_heads)[:, None, None]
        j = torch.arange(n)[None, None, :]
        rows = max(1, (1 << 22) // (num_heads * n))
        total = 0
        for start in range(0, n, rows):
            i = torch.arange(start, min(n, start + rows))[None, :, None]
            total += int(self.visible(h, i, j, n=n, num_heads=num_heads).expand(num_heads, i.shape[1], n).sum())
        return total

    # --- the call -------------------------------------------------------------------------
    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: Optional[str] = None
    ) -> torch.Tensor:
        check_qkv(q, k, v)
        num_heads = q.shape[1]
        self.check_heads(num_heads)
        chosen = resolve_backend(backend or self.backend, q)
        if chosen == "flex":
            from attn_patterns.flex import flex_forward

            return flex_forward(self, q, k, v)
        if chosen == "triton":
            from attn_patterns.triton_attention import triton_forward

            return triton_forward(self, q, k, v)
        groups = num_heads // k.shape[1]
        if groups > 1 and not self.native_gqa:
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        return self.forward(q, k, v, chosen)


class HeadSlice(Pattern):
    """``pattern.heads(offset, total)``: local head h is the pattern's head ``offset + h`` of
    ``total``, in the rule (mask, pair counts, flex) and in the fast path."""

    def __init__(self, pattern: Pattern, offset: int, total: int) -> None:
        check_int("total", total, pattern.name)
        pattern.check_heads(total)
        if not isinstance(offset, int) or isinstance(offset, bool) or not 0 <= offset < total:
            raise ValueError(f"{pattern.name}: head offset={offset!r} must be an integer in [0, total={total})")
        super().__init__(pattern.backend)
        self.pattern, self.offset, self.total = pattern, offset, total
        self.name, self.native_gqa = pattern.name, pattern.native_gqa

    def __repr__(self) -> str:
        return f"{self.pattern!r}.heads({self.offset}, {self.total})"

    def check_heads(self, num_heads: int) -> None:
        if self.offset + num_heads > self.total:
            raise ValueError(
                f"{self.name}: heads [{self.offset}, {self.offset + num_heads}) reach past the pattern's "
                f"total={self.total} heads"
            )

    def keys(self, h, i, n, num_heads) -> Keys:
        return self.pattern.keys(h + self.offset, i, n, self.total)

    def widest(self, n, num_heads):
        whole = self.pattern.widest(n, self.total)
        return None if whole is None else whole[self.offset : self.offset + num_heads]

    def sinks(self, h, num_heads):
        return self.pattern.sinks(h + self.offset, self.total)

    def check_sinks(self, seq_len):
        self.pattern.check_sinks(seq_len)

    def rule(self, h, i, j, *, n, num_heads):
        return self.pattern.rule(h + self.offset, i, j, n=n, num_heads=self.total)

    def forward(self, q, k, v, backend):
        return self.pattern.forward_heads(q, k, v, backend, offset=self.offset, total=self.total)


PATTERNS: Registry[Pattern] = Registry("pattern", Pattern)
register = PATTERNS.register
