"""DCA's prefill in one pass of the block-sparse kernel (``backend="triton"``): no loop over
chunks, no log-sum-exp merges.

Why one pass is exact: with every key moved once to its chunk frame (key j rotated to
``j mod s``, s the period of DCA's key positions, :func:`~attn_patterns.dca.chunk_length`),
the logit of query i and key j depends only on where the query is put for j's chunk: its own
(intra-chunk target), the previous one (successive) or an earlier one (inter-chunk), the
targets of :func:`~attn_patterns.dca.query_positions`. So q is rotated into one copy per
target, and one causal block-sparse pass scores each key block with the copy that its
chunk's distance from the query's asks for (:class:`~attn_patterns.blocks.ChunkVariants`):
one online softmax over every key, which is DCA's softmax over its three pieces. The
rotations are torch ops (fp32, angles reduced in fp64: :func:`~attn_patterns.rotary.rotate`),
so autograd carries the copies' gradients back to q and k.

A block must lie in one chunk, so each tile side is the largest power of two dividing s, at
most the kernel's own and at least ``MIN_BLOCK`` (16): :func:`takes` says whether one
exists. ``pieces="intra"`` (the paper's ablation) is chunked local attention at true
distances: no rotation, no copies, any s. Decoding against a KV cache (Nq < Nk) and an s
no tile divides stay on :func:`~attn_patterns.dca.dca_attention`'s per-chunk path, which
also computes the targets this module is given (it knows no DCA variant).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from attn_patterns.blocks import BlockLayout, ChunkVariants, block_layout
from attn_patterns.rotary import rotate
from attn_patterns.triton_attention import MIN_BLOCK, Tiles, block_sparse_attention


@dataclass(frozen=True)
class ChunkKeys:
    """The keys a DCA row sees, as the ``keys`` progression block layouts are read from:
    every earlier key, or with ``own_chunk`` (pieces='intra') those of its chunk of ``step``."""

    step: int
    own_chunk: bool

    def keys(self, h: torch.Tensor, i: torch.Tensor, n: int, num_heads: int) -> tuple[torch.Tensor, ...]:
        lo = i // self.step * self.step if self.own_chunk else torch.zeros_like(i)
        return lo, i, torch.ones_like(i)

    def check_heads(self, num_heads: int) -> None:
        """Every head sees the same keys: any count."""


@functools.lru_cache(maxsize=32)
def chunk_keys(step: int, own_chunk: bool) -> ChunkKeys:
    """One instance per configuration: block layouts are cached on it, so every layer of a
    model reuses them."""
    return ChunkKeys(step, own_chunk)


def takes(step: int, own_chunk: bool) -> bool:
    """Whether :func:`dca_prefill` runs chunks of ``step`` keys (``own_chunk``: rows see their
    own chunk only, which needs no copies and so no tile dividing ``step``)."""
    return own_chunk or step % MIN_BLOCK == 0


def dca_prefill(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, step: int, scale: float,
    inv_freq: Optional[torch.Tensor] = None, targets: Sequence[torch.Tensor] = (),
) -> torch.Tensor:
    """Causal attention over a whole sequence, q (B,H,N,D) and k/v (B,Hkv,N,D) rotated at
    positions 0..N-1 with ``inv_freq``, softmax scale ``scale``, where key j stands at
    ``j mod step`` and query i at ``targets[d][i]`` for the keys d chunks before its own
    (the last target for every earlier chunk): DCA's intra, [successive,] inter-chunk
    positions (:func:`~attn_patterns.dca.query_positions`). No ``targets``: each row sees
    its own chunk only, at true distances. Differentiable; needs :func:`takes`."""
    n, heads, device = q.shape[2], q.shape[1], q.device
    own_chunk = not targets
    if own_chunk:  # true distances: the model's rotation is already right
        copies, keys, variants = q.unsqueeze(0), k, None
    else:
        i = torch.arange(n, device=device)
        copies = torch.stack([rotate(q, t - i, inv_freq) for t in targets])
        keys = rotate(k, i % step - i, inv_freq)  # key j at j mod step
        variants = ChunkVariants(step, tuple(range(len(targets))))
    rows = chunk_keys(step, own_chunk)

    def layouts(tile: Tiles) -> BlockLayout:
        return block_layout(rows, n, heads, block_q=tile.block_q, block_k=tile.block_k, strided=False, device=device,
                            variants=variants)

    return block_sparse_attention(copies, keys, v, layouts, scale=scale, period=None if own_chunk else step)
