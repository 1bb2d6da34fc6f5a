"""A pattern's block structure: which key blocks each query block sees, wholly or in part.

Block-sparse kernels (the Triton backend, FlexAttention's BlockMask) run from lists of key
blocks per (head, query block). They are read here from the pattern's ``keys`` progression in
O(H·N + entries): each row's visible keys are one interval of key blocks, the rows of a query
block are merged into a union of intervals (a sort, no N×N and no (N/bq)×(N/bk) grid), and a
block is *full* where every real row of the query block sees all of it (no mask in the
kernel), *partial* where some row sees part of it (masked with the rows' ``lo``/``hi``/
``step``). Layouts are cached on the pattern, as flex caches its masks: every layer of a
model asks for the same one in each step.

A dilated head (LongNet's, ``sda``: row i sees keys ≡ i mod θ, causally, and rows of the
other residues see nothing) is, with ``strided=True``, compressed to the dense causal
attention it is on the strided view ``start + stride·m`` of q/k/v: the kernel loads those
rows by pointer arithmetic, so a dilated head costs 1/θ² of a dense one with no gather.

*Query variants* (:class:`ChunkVariants`) give each run the index of the copy of q it is
scored with, from the distance between the chunks of its query and key blocks: DCA's
intra / successive / inter-chunk rotations of q in one pass (:mod:`attn_patterns.dca_triton`).
The runs are cut where that distance changes class, a few more per block, still O(H·N/block).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

_MAX_LAYOUTS = 16  # per pattern: (N, H, blocks, strided, device, variants) combinations kept


@dataclass(frozen=True)
class ChunkVariants:
    """Query variants by chunk distance: positions fall in chunks of ``period``, and a (query
    block, key block) whose chunks are ``d`` apart is scored with q copy ``by_distance[d]``
    (the last entry for every farther chunk). Both block sizes must divide ``period``, so
    that a block lies in one chunk; DCA's are ``(0, 1, 2)``, intra / successive / inter."""

    period: int
    by_distance: tuple[int, ...]

    @property
    def count(self) -> int:
        """The copies of q the runs choose from."""
        return max(self.by_distance) + 1


@dataclass(frozen=True, eq=False)
class BlockLayout:
    """The block structure of ``pattern`` at length ``n`` on ``num_heads`` heads; every tensor
    int32, on one device.

    Coordinates: head h's *rows* are the positions ``start[h] + stride[h]·m`` for
    ``m < rows[h]``, and its keys the same positions (``t`` for key ``start + stride·t``);
    uncompressed heads have stride 1, start 0, rows n. Per row, ``lo``/``hi``/``step`` (H, R)
    give the visible keys ``lo, lo+step, ..., hi`` in these coordinates, causality applied
    and ``hi`` the last visible key; ``hi < lo`` (canonically 0, -1) sees nothing, as do
    rows ``m >= rows[h]``. ``sinks`` (H): besides those, row m of head h sees keys
    ``[0, min(sinks[h], m + 1))``, its sink tokens (the progression starts past them, so no
    key is seen twice); a head with sinks is never compressed.

    Key blocks (of ``block_k`` keys) per (head, query block of ``block_q`` rows), as *runs* of
    consecutive blocks ``[first, last]``, ascending: ``full_runs`` (H, NQB, ·, 2) with
    ``full_run_counts`` (H, NQB), the blocks every real row of the query block sees entirely
    (no mask), and ``partial_runs``/``partial_run_counts``, those some row sees in part. Runs
    keep the layout O(H·N/block) however dense the pattern (causal at 128k in 32×32 blocks is
    268M blocks but ~1 run each). Transposed, per (head, key block), the query blocks:
    ``full_q_runs``/``full_q_run_counts`` and ``partial_q_runs``/``partial_q_run_counts``
    (H, NKB, ·, 2), for a KV-major backward. Entries past a count are 0. Parallel to each
    list, ``*_run_variants`` (H, NB, ·): the copy of q each run is scored with, all 0 and
    ``variants`` = 1 unless the layout was built with :class:`ChunkVariants`.

    The same lists one block per entry, padded (what FlexAttention's BlockMask takes), are
    expanded on first use: ``full_counts``/``full_indices`` (H, NQB[, ·]),
    ``partial_counts``/``partial_indices``, and transposed ``full_q_counts``/``full_q_indices``
    (H, NKB[, ·]), ``partial_q_counts``/``partial_q_indices``.
    """

    n: int
    num_heads: int
    block_q: int
    block_k: int
    strided: bool
    stride: torch.Tensor
    start: torch.Tensor
    rows: torch.Tensor
    lo: torch.Tensor
    hi: torch.Tensor
    step: torch.Tensor
    sinks: torch.Tensor
    full_runs: torch.Tensor
    full_run_counts: torch.Tensor
    partial_runs: torch.Tensor
    partial_run_counts: torch.Tensor
    full_q_runs: torch.Tensor
    full_q_run_counts: torch.Tensor
    partial_q_runs: torch.Tensor
    partial_q_run_counts: torch.Tensor
    full_run_variants: torch.Tensor
    partial_run_variants: torch.Tensor
    full_q_run_variants: torch.Tensor
    partial_q_run_variants: torch.Tensor
    variants: int  # copies of q the runs choose from (1: q as given)
    compressed: bool  # some head has stride > 1: the positions it does not own see nothing
    stepped: bool  # some row's progression has step > 1 in layout coordinates (masks test it)
    pairs: int  # visible (query, key) pairs, = pattern.visible_pairs(n, num_heads)
    sunk: bool  # some head has sink tokens (the kernels test them)
    cache: dict = field(default_factory=dict, repr=False)  # what is derived from the layout on use

    @property
    def num_q_blocks(self) -> int:
        return self.full_run_counts.shape[1]

    @property
    def num_k_blocks(self) -> int:
        return self.full_q_run_counts.shape[1]

    @property
    def device(self) -> torch.device:
        return self.lo.device

    def to(self, device: torch.device) -> "BlockLayout":
        moved = {f.name: getattr(self, f.name).to(device) for f in dataclasses.fields(self)
                 if isinstance(getattr(self, f.name), torch.Tensor)}
        return dataclasses.replace(self, cache={}, **moved)

    def entries(self) -> int:
        """(head, query block, key block) entries, full and partial: the kernel's work."""
        return sum(int(_run_lengths(runs, counts).sum()) for runs, counts in
                   ((self.full_runs, self.full_run_counts), (self.partial_runs, self.partial_run_counts)))

    def _expanded(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        if name not in self.cache:
            self.cache[name] = _expand(getattr(self, f"{name}_runs"), getattr(self, f"{name}_run_counts"))
        return self.cache[name]

    full_counts = property(lambda self: self._expanded("full")[0])
    full_indices = property(lambda self: self._expanded("full")[1])
    partial_counts = property(lambda self: self._expanded("partial")[0])
    partial_indices = property(lambda self: self._expanded("partial")[1])
    full_q_counts = property(lambda self: self._expanded("full_q")[0])
    full_q_indices = property(lambda self: self._expanded("full_q")[1])
    partial_q_counts = property(lambda self: self._expanded("partial_q")[0])
    partial_q_indices = property(lambda self: self._expanded("partial_q")[1])


def block_layout(
    pattern: Any, n: int, num_heads: int, *, block_q: int, block_k: int, strided: bool,
    device: Optional[torch.device] = None, variants: Optional[ChunkVariants] = None,
) -> BlockLayout:
    """The cached :class:`BlockLayout` of ``pattern`` (one with a ``keys`` progression: a
    pattern stated by ``rule`` alone is refused in one line) on ``device`` (default CPU),
    built there (sorts of O(H·N) elements: fast on a GPU); with ``variants``, its runs cut
    and labelled by them (uncompressed heads only)."""
    device = torch.device(device or "cpu")
    layouts = pattern.__dict__.setdefault("_block_layouts", {})
    key = (n, num_heads, block_q, block_k, bool(strided), str(device), variants)
    if key not in layouts:
        if len(layouts) >= _MAX_LAYOUTS:
            layouts.pop(next(iter(layouts)))
        layouts[key] = _build(pattern, n, num_heads, block_q=block_q, block_k=block_k, strided=bool(strided), device=device,
                              variants=variants)
    return layouts[key]


def _build(pattern: Any, n: int, num_heads: int, *, block_q: int, block_k: int, strided: bool,
           device: torch.device, variants: Optional[ChunkVariants] = None) -> BlockLayout:
    for name, value in (("n", n), ("block_q", block_q), ("block_k", block_k)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"block_layout: {name}={value!r} must be an integer >= 1")
    if variants is not None and (variants.period % block_q or variants.period % block_k):
        raise ValueError(f"block_layout: block_q={block_q} and block_k={block_k} must divide the variants' period "
                         f"{variants.period} (a block lies in one chunk)")
    pattern.check_heads(num_heads)
    heads = num_heads
    h = torch.arange(heads, device=device)[:, None]
    i = torch.arange(n, device=device)[None, :]
    past_sinks = getattr(pattern, "past_sinks", None)  # a Pattern's; DCA's chunk rows have no sinks
    try:
        keys, sink = past_sinks(h, i, n, heads) if past_sinks else (pattern.keys(h, i, n, heads), torch.zeros_like(h))
    except NotImplementedError:
        raise ValueError(
            f"{pattern!r}: a block layout is read from the pattern's keys progression and this pattern states only "
            "a rule (mask_mod); use backend='flex' or 'sdpa' for it"
        ) from None
    lo, hi, step = (torch.broadcast_to(torch.as_tensor(x, device=device), (heads, n)).to(torch.int64) for x in keys)
    sink = torch.broadcast_to(torch.as_tensor(sink, device=device), (heads, 1)).to(torch.int64)  # counted apart from lo..hi
    pos = i.expand(heads, n)
    hi = torch.minimum(hi, pos)
    seen = hi >= lo
    step = torch.where(seen, step, 1)
    if bool((step < 1).any()):
        raise ValueError(f"{pattern!r}: its keys progression has a step < 1")
    hi = torch.where(seen, lo + torch.div(hi - lo, step, rounding_mode="floor") * step, -1)  # the last visible key
    lo = torch.where(seen, lo, 0)
    pairs = int(torch.where(seen, torch.div(hi - lo, step, rounding_mode="floor") + 1, 0).sum())
    pairs += int(torch.minimum(sink, pos + 1).sum())

    if strided:  # a head with sinks is not compressed: its rows of every residue see them
        stride, start = _dilation(lo, step, pos, seen)
        stride, start = torch.where(sink[:, 0] > 0, 1, stride), torch.where(sink[:, 0] > 0, 0, start)
    else:
        stride, start = torch.ones_like(h[:, 0]), torch.zeros_like(h[:, 0])
    rows = torch.div(n - start + stride - 1, stride, rounding_mode="floor")
    width = int(rows.max())
    m = torch.arange(width, device=device)[None, :]
    owned = m < rows[:, None]
    src = (start[:, None] + stride[:, None] * m).clamp(max=n - 1)  # the position of layout row m
    lo, hi, step, seen = (x.gather(1, src) for x in (lo, hi, step, seen))
    seen = seen & owned
    squeeze = stride[:, None]
    lo = torch.where(seen, torch.div(lo - start[:, None], squeeze, rounding_mode="floor"), 0)
    hi = torch.where(seen, torch.div(hi - start[:, None], squeeze, rounding_mode="floor"), -1)
    step = torch.where(seen, torch.div(step, squeeze, rounding_mode="floor"), 1)

    nqb, nkb = -(-width // block_q), -(-width // block_k)
    sink_hi = torch.where(owned, torch.minimum(sink, m + 1) - 1, -1)  # per row, its last sink (uncompressed heads)
    full, partial = _runs(lo, hi, step, seen, owned=owned, sink_hi=sink_hi, block_q=block_q, block_k=block_k, nqb=nqb,
                          nkb=nkb)
    i32 = lambda x: x.to(torch.int32).contiguous()  # noqa: E731
    if variants is not None and bool((stride > 1).any()):
        raise ValueError(f"{pattern!r}: query variants take uncompressed heads only (build with strided=False)")
    lists = {}
    for kind, (group, first, last) in (("full", full), ("partial", partial)):
        forward, backward = (group, first, last), _transpose(group, first, last, nqb=nqb, nkb=nkb)
        if variants is not None:
            forward = _cut(*forward, variants, block=block_q, other=block_k, nb=nqb, transposed=False)
            backward = _cut(*backward, variants, block=block_k, other=block_q, nb=nkb, transposed=True)
        lists[f"{kind}_runs"], lists[f"{kind}_run_counts"], lists[f"{kind}_run_variants"] = \
            _padded(*forward, heads=heads, blocks=nqb)
        lists[f"{kind}_q_runs"], lists[f"{kind}_q_run_counts"], lists[f"{kind}_q_run_variants"] = \
            _padded(*backward, heads=heads, blocks=nkb)
    lists["variants"] = 1 if variants is None else variants.count
    return BlockLayout(
        n=n, num_heads=heads, block_q=block_q, block_k=block_k, strided=strided,
        stride=i32(stride), start=i32(start), rows=i32(rows), lo=i32(lo), hi=i32(hi), step=i32(step), sinks=i32(sink[:, 0]),
        **lists,
        compressed=bool((stride > 1).any()), stepped=bool((step[seen] > 1).any()), pairs=pairs,
        sunk=bool((sink > 0).any()),
    )


def _dilation(lo: torch.Tensor, step: torch.Tensor, pos: torch.Tensor, seen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per head, ``(stride, start)``: ``(θ, r)`` where every row that sees a key is ≡ r mod θ,
    its keys start ≡ r and step by θ > 1 (a dilated head), else ``(1, 0)``."""
    big = torch.iinfo(torch.int64).max
    theta = torch.where(seen, step, big).amin(1)
    uniform = torch.where(seen, step, theta[:, None]).eq(theta[:, None]).all(1) & (theta > 1) & (theta < big)
    theta = torch.where(uniform, theta, 1)
    first = seen.int().argmax(1, keepdim=True)
    r = lo.gather(1, first).squeeze(1) % theta
    on = ((lo % theta[:, None]) == r[:, None]) & ((pos % theta[:, None]) == r[:, None])
    dilated = uniform & torch.where(seen, on, True).all(1)
    return torch.where(dilated, theta, 1), torch.where(dilated, r, 0)


def _runs(lo, hi, step, seen, *, owned, sink_hi, block_q: int, block_k: int, nqb: int, nkb: int):
    """``(group, first, last)`` of the full and of the partial runs of key blocks, group =
    head·NQB + query block, sorted by (group, first). Per query block, the union of its rows'
    key-block intervals (their progressions' and their sinks' ``[0, sink_hi]``) is merged
    after one sort (O(H·N log N)); the blocks every real row's progression covers entirely
    form one range inside it, full, and the rest of the union is partial (sink blocks
    among them: the kernels mask them with the sinks)."""
    heads, width = lo.shape
    device = lo.device
    h = torch.arange(heads, device=device)[:, None].expand(heads, width)
    qb = torch.arange(width, device=device)[None, :].expand(heads, width) // block_q
    sunk = sink_hi >= 0
    group = torch.cat([(h * nqb + qb)[seen], (h * nqb + qb)[sunk]])
    first = torch.cat([(lo // block_k)[seen], torch.zeros_like(sink_hi[sunk])])
    last = torch.cat([(hi // block_k)[seen], (sink_hi // block_k)[sunk]])
    span = nkb + 1  # a group's keys stay below the next group's
    order = torch.argsort(group * span + first)
    group, first, last = group[order], first[order], last[order]
    reach = (group * span + last).cummax(0).values - group * span  # running end within the group
    opens = torch.ones_like(group, dtype=torch.bool)
    opens[1:] = (group[1:] != group[:-1]) | (first[1:] > reach[:-1] + 1)
    begins = opens.nonzero().flatten()
    ends = torch.cat([begins[1:] - 1, begins.new_tensor([len(group) - 1])]) if len(group) else begins
    g, a, z = group[begins], first[begins], reach[ends]

    # full: every real row of the query block sees keys [kb·bk, kb·bk + bk) entirely
    pad = nqb * block_q - width
    grid = lambda x, fill: torch.nn.functional.pad(torch.where(owned, x, fill), (0, pad), value=fill).view(heads, nqb, block_q)  # noqa: E731
    far = torch.iinfo(torch.int64).max // 4
    latest_lo = grid(lo, -far).amax(2).flatten()
    earliest_hi = grid(hi, far).amin(2).flatten()
    unit = grid(step, 1).amax(2).flatten() == 1
    full_from = -torch.div(-latest_lo, block_k, rounding_mode="floor")
    full_to = torch.div(earliest_hi + 1, block_k, rounding_mode="floor") - 1
    none = ~unit | (full_from > full_to)
    full_from, full_to = torch.where(none, far, full_from), torch.where(none, far - 1, full_to)
    f0, f1 = full_from[g], full_to[g]
    full = (torch.maximum(a, f0), torch.minimum(z, f1))
    left, right = (a, torch.minimum(z, f0 - 1)), (torch.maximum(a, f1 + 1), z)
    keep = full[0] <= full[1]
    full = (g[keep], full[0][keep], full[1][keep])
    pieces = [(g[x[0] <= x[1]], x[0][x[0] <= x[1]], x[1][x[0] <= x[1]]) for x in (left, right)]
    pg, pf, pl = (torch.cat(parts) for parts in zip(*pieces))
    order = torch.argsort(pg * span + pf)
    return full, (pg[order], pf[order], pl[order])


def _transpose(group: torch.Tensor, first: torch.Tensor, last: torch.Tensor, *, nqb: int, nkb: int):
    """The runs of query blocks per (head, key block) that hold the runs of key blocks per
    (head, query block) ``group = head·NQB + qb``: walking down the query blocks of a key
    block, membership toggles where one query block's runs differ from the previous one's,
    so the toggles (few for sliding and chunked patterns) are read from the runs' ends by one
    sort, and consecutive toggles pair into runs. O(runs + toggles), never per block."""
    device = group.device
    h, qb = group // nqb, group % nqb
    # D(b, kb) = member(b, kb) - member(b - 1, kb) at boundary b: +1/-1 at a run's ends for b = qb,
    # the opposite for b = qb + 1; each boundary's events sum to 0, so one cumsum serves all
    b = torch.cat([qb, qb, qb + 1, qb + 1])
    key = torch.cat([first, last + 1, first, last + 1])
    value = torch.cat([torch.ones_like(qb), -torch.ones_like(qb), -torch.ones_like(qb), torch.ones_like(qb)])
    hh = h.repeat(4)
    order = torch.argsort((hh * (nqb + 1) + b) * (nkb + 1) + key)
    hh, b, key, value = hh[order], b[order], key[order], value[order]
    level = value.cumsum(0)
    nxt = torch.cat([key[1:], key.new_tensor([0])]) if len(key) else key
    same = torch.zeros_like(b, dtype=torch.bool)
    same[:-1] = (hh[1:] == hh[:-1]) & (b[1:] == b[:-1])
    live = same & (level != 0) & (nxt > key)
    lengths = (nxt - key)[live]
    th, tb, tv = (x[live].repeat_interleave(lengths) for x in (hh, b, level))
    offsets = torch.cumsum(lengths, 0) - lengths
    tk = key[live].repeat_interleave(lengths) + torch.arange(int(lengths.sum()), device=device) - offsets.repeat_interleave(lengths)
    order = torch.argsort((th * nkb + tk) * (nqb + 1) + tb)
    th, tk, tb, tv = th[order], tk[order], tb[order], tv[order]
    starts, ends = tv > 0, tv < 0  # alternate within each (head, key block): start, end, start, ...
    return th[starts] * nkb + tk[starts], tb[starts], tb[ends] - 1


def _cut(group: torch.Tensor, first: torch.Tensor, last: torch.Tensor, variants: ChunkVariants, *, block: int,
         other: int, nb: int, transposed: bool):
    """Runs of ``other``-sized blocks per group (head·``nb`` + block of ``block`` positions), cut
    where the chunk distance between the group's block and the run's blocks changes class,
    each piece with its variant: ``(group, first, last, variant)``, still in order. Forward
    runs (key blocks before a query block) cut at the starts of the query's chunk and of the
    ``len(by_distance) - 2`` chunks before it, transposed runs (query blocks after a key
    block) at the starts of the ``len(by_distance) - 1`` chunks after the key's."""
    classes = len(variants.by_distance)
    chunk = (group % nb) * block // variants.period
    if transposed:  # piece p: query blocks p chunks after the key block's (p = classes - 1: or more)
        starts = chunk[:, None] + 1 + torch.arange(classes - 1, device=group.device)
        distance = torch.arange(classes, device=group.device)
    else:  # piece p: key blocks classes - 1 - p chunks before the query block's (p = 0: or more)
        starts = chunk[:, None] - (classes - 2) + torch.arange(classes - 1, device=group.device)
        distance = torch.arange(classes - 1, -1, -1, device=group.device)
    cuts = starts * variants.period // other  # the first block of each of those chunks
    far = torch.iinfo(torch.int64).max // 4
    edge = torch.full_like(first[:, None], far)
    a = torch.maximum(first[:, None], torch.cat([-edge, cuts], 1))
    z = torch.minimum(last[:, None], torch.cat([cuts - 1, edge], 1))
    keep = a <= z
    label = torch.tensor(variants.by_distance, device=group.device)[distance].expand_as(a)
    return group[:, None].expand_as(a)[keep], a[keep], z[keep], label[keep]


def _padded(group: torch.Tensor, first: torch.Tensor, last: torch.Tensor, variant: Optional[torch.Tensor] = None, *,
            heads: int, blocks: int):
    """Runs ``(heads, blocks, W, 2)`` of each group, in order, padded with 0 to the most runs
    (at least 1, so a kernel always gets a real pointer), their counts ``(heads, blocks)`` and
    their variants ``(heads, blocks, W)`` (0 where none is given)."""
    device = group.device
    counts = torch.bincount(group, minlength=heads * blocks)
    width = max(1, int(counts.max()) if len(group) else 0)
    slot = torch.arange(len(group), device=device) - (torch.cumsum(counts, 0) - counts)[group]
    table = torch.zeros(heads * blocks, width, 2, dtype=torch.int32, device=device)
    table[group, slot] = torch.stack([first, last], 1).to(torch.int32)
    labels = torch.zeros(heads * blocks, width, dtype=torch.int32, device=device)
    if variant is not None:
        labels[group, slot] = variant.to(torch.int32)
    return (table.view(heads, blocks, width, 2).contiguous(), counts.view(heads, blocks).to(torch.int32).contiguous(),
            labels.view(heads, blocks, width).contiguous())


def _run_lengths(runs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    used = torch.arange(runs.shape[2], device=runs.device) < counts[..., None]
    return torch.where(used, runs[..., 1] - runs[..., 0] + 1, 0)


def _expand(runs: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Runs as one block per entry: counts ``(H, B)`` and indices ``(H, B, ·)`` padded with 0."""
    heads, blocks = counts.shape
    lengths = _run_lengths(runs, counts).flatten()
    per = lengths.view(heads * blocks, -1).sum(1)
    width = max(1, int(per.max()) if per.numel() else 0)
    starts = runs[..., 0].flatten().long().repeat_interleave(lengths)
    offsets = torch.cumsum(lengths, 0) - lengths
    within = torch.arange(int(lengths.sum()), device=runs.device) - offsets.repeat_interleave(lengths)
    group = torch.arange(heads * blocks, device=runs.device).repeat_interleave(per)
    slot = torch.arange(len(group), device=runs.device) - (torch.cumsum(per, 0) - per)[group]
    table = torch.zeros(heads * blocks, width, dtype=torch.int32, device=runs.device)
    table[group, slot] = (starts + within).to(torch.int32)
    return per.view(heads, blocks).to(torch.int32), table.view(heads, blocks, width)
