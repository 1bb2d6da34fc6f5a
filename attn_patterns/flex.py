"""FlexAttention backend: a BlockMask read straight off the pattern's block structure, so it
cross-checks the hand-written kernels and runs new patterns that have none.

Why it compiles once: the mask is built by ``BlockMask.from_kv_blocks`` from the block lists
of :func:`attn_patterns.blocks.block_layout` (O(H·N + entries), no ``create_block_mask``
compile, no N×N grid), and inside partial blocks it asks every (head, query) row one
question, "is key j on the progression lo, lo+step, ..., hi?", reading the layout's per-row
tensors. Every pattern and length hands the compiled kernel the same ``mask_mod`` code and
differs only in tensor values and sizes, which ``torch.compile(..., dynamic=True)`` takes as
symbols, with the BlockMask's block dimensions marked dynamic too (torch would otherwise
compile them static once, then recompile). So one compile per grad mode serves every pattern
and every length of two blocks or more (torch 2.11 on an H200: s2 and longmixed at 4k-64k,
forward and backward, one compile, 4.5 s to the first result; torch 2.13 on CPU alike). What
still compiles anew: another head count, K/V head count or head dim (flex keeps them static:
constant in a model), a length of one block (torch specialises sizes 0 and 1), and a pattern
stated by ``rule`` alone (its own mask_mod). On CPU torch has no FlexAttention backward and
the call runs unfused (scores materialised): an inference-only cross-check there."""

from __future__ import annotations

import functools
import math
from typing import Any, Callable

import torch
import torch.nn.functional as F

from attn_patterns.blocks import block_layout

# FlexAttention's own sparse block (its kernels' tile divides it); the layout uses it both ways.
BLOCK = 128
_MAX_MASKS = 8  # per pattern: (N, H, device) combinations kept
# The BlockMask's (batch, head, block, block) lists, forward and transposed.
_BLOCK_LISTS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
                "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")


@functools.cache
def compiled_flex() -> Callable[..., Any]:
    """One compiled flex_attention per process (torch keeps one graph per grad mode in it).
    ``dynamic=True`` makes the sequence length and the sizes of the row tensors the mask reads
    symbolic from the first call, so a new length or pattern reuses the kernel."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=True)


def progression_mask(lo: torch.Tensor, hi: torch.Tensor, step: torch.Tensor, sinks: torch.Tensor) -> Callable[..., torch.Tensor]:
    """The mask_mod of every pattern: key ``kv`` is visible to row (head, q) when it lies on
    ``lo[h, q], lo[h, q] + step[h, q], ..., hi[h, q]`` (``hi`` already causal; ``hi < lo``:
    nothing) or is one of the head's sink tokens, ``kv < sinks[h]`` and ``kv <= q``. Only the
    captured tensors change between patterns, never the code."""

    def mask_mod(batch, head, q_idx, kv_idx):
        first = lo[head, q_idx]
        own = (kv_idx >= first) & (kv_idx <= hi[head, q_idx]) & ((kv_idx - first) % step[head, q_idx] == 0)
        return own | ((kv_idx < sinks[head]) & (kv_idx <= q_idx))

    return mask_mod


def _widen(indices: torch.Tensor, width: int) -> torch.Tensor:
    """Key-block lists padded to one entry per key block: ``from_kv_blocks`` transposes them
    for the backward through a (query block, key block) table of that width."""
    return F.pad(indices, (0, width - indices.shape[-1]))


def _states_keys(pattern, n: int, num_heads: int) -> bool:
    """Whether ``pattern`` states its visible keys as a progression (``keys``), which has a
    block layout, rather than by a ``rule`` alone."""
    origin = torch.zeros(1, 1, dtype=torch.long)
    try:
        pattern.keys(origin, origin, n, num_heads)
    except NotImplementedError:
        return False
    return True


def _blocks_and_mask_mod(pattern, n: int, num_heads: int, device: torch.device):
    """``from_kv_blocks``' four lists (partial counts and indices, full counts and indices, on
    CPU) and the mask_mod inside partial blocks."""
    if _states_keys(pattern, n, num_heads):
        layout = block_layout(pattern, n, num_heads, block_q=BLOCK, block_k=BLOCK, strided=False)
        width = layout.num_k_blocks
        lists = (layout.partial_counts, _widen(layout.partial_indices, width),
                 layout.full_counts, _widen(layout.full_indices, width))
        return lists, progression_mask(*(x.to(device) for x in (layout.lo, layout.hi, layout.step, layout.sinks)))
    # a rule alone has no layout: every causal block is partial, the rule decides inside
    blocks = -(-n // BLOCK)
    lists = (torch.arange(1, blocks + 1, dtype=torch.int32).expand(num_heads, blocks),
             torch.arange(blocks, dtype=torch.int32).expand(num_heads, blocks, blocks), None, None)

    def mask_mod(batch, head, q_idx, kv_idx):
        return pattern.visible(head, q_idx, kv_idx, n=n, num_heads=num_heads)

    return lists, mask_mod


def block_mask(pattern, n: int, num_heads: int, device: torch.device) -> Any:
    """The FlexAttention BlockMask of ``pattern`` for ``num_heads`` heads of length ``n``,
    kept on the pattern: every layer of a model asks for the same mask in each step."""
    from torch.nn.attention.flex_attention import BlockMask

    masks = pattern.__dict__.setdefault("_flex_block_masks", {})
    key = (n, num_heads, str(device))
    if key not in masks:
        if len(masks) >= _MAX_MASKS:
            masks.pop(next(iter(masks)))
        lists, mask_mod = _blocks_and_mask_mod(pattern, n, num_heads, device)
        mask = BlockMask.from_kv_blocks(*(None if x is None else x[None].to(device) for x in lists), BLOCK_SIZE=BLOCK,
                                        mask_mod=mask_mod, seq_lengths=(n, n))
        for name in _BLOCK_LISTS:
            blocks = getattr(mask, name)
            for dim in range(2, 0 if blocks is None else blocks.dim()):
                torch._dynamo.maybe_mark_dynamic(blocks, dim)
        masks[key] = mask
    return masks[key]


def flex_forward(pattern, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``pattern`` on FlexAttention: compiled on CUDA, torch's unfused path on CPU (no grad)."""
    from torch.nn.attention.flex_attention import flex_attention

    if not q.is_cuda and torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v)):
        raise ValueError(
            "backend='flex' has no backward on CPU in torch; use backend='sdpa' for training on CPU"
        )
    b, h, n, d = q.shape
    mask = block_mask(pattern, n, h, q.device)
    kernel = compiled_flex() if q.is_cuda else flex_attention
    return kernel(q, k, v, block_mask=mask, scale=1.0 / math.sqrt(d), enable_gqa=k.shape[1] != h)
