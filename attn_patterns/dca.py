"""Dual Chunk Attention (An et al., 2024): training-free context extension by re-using only
the relative positions a model saw in pretraining.

Why it works: a RoPE model breaks on relative distances it never saw (>= its pretraining
length c), not on long inputs as such. DCA keeps every key at its position inside its chunk
of s tokens (``j mod s``) and gives the query three positions, one per kind of key
(paper eqs. 2–8), with ``d = i//s - j//s``, ``a = i mod s``, ``b = j mod s``:

* intra-chunk (d = 0): query at ``a``            -> distance ``a - b``  (exact, < s)
* successive (d = 1): query at ``s + a`` if ``a < w`` else ``c - 1`` -> the w nearest keys
  keep their true distance, the rest are pushed to at most c - 1
* inter-chunk (d > 1): query at ``c - 1``         -> distance ``c - 1 - b`` (>= c - s)

so no distance reaches c. Two other variants follow published code instead of the equations
(``VARIANTS``; docs/dca.md has the table and sources): ``chunkllama`` (the authors'
``chunkllama_attn_replace.py``) and ``qwen`` (the serving engines' DCA for Qwen's
``dual_chunk_attention_config``). Both put keys at ``j mod L`` with ``L = s - w``, successive
queries at ``min(a + L, s)`` and inter-chunk queries at ``min(2L - 1, s)``; they differ in
defaults and in the length-dependent factor on the attention logits (``LOGIT_SCALES``).
Every causal key stays visible: DCA changes positions, not the
set of keys (``mask`` is plain causal attention), except in the paper's ablation with the
intra-chunk piece alone (``pieces="intra"``), where a query sees its own chunk only.

How it runs: RoPE is a rotation, so vectors already rotated at their true position p (what
transformers hands an attention function) are moved to a target position t by rotating
them by ``t - p`` with the model's own frequencies, in fp32. That composes with any RoPE
scaling in those frequencies (PI, NTK-by-base, YaRN including its magnitude factor, Llama-3):
the paper's "orthogonality". The three pieces are three attentions per query chunk, each
returning its log-sum-exp, merged exactly in fp32 (Algorithm 1). Nothing is N×N: per query
chunk the kernels see at most s queries, and the inter-chunk piece (all keys of chunks
before the previous one, all seen from c - 1) is one call of a fused kernel that streams
its keys; memory is O(N·s). Decoding with a KV cache needs no state: cached keys sit at
their true positions and are re-rotated like any other.
On CUDA (``backend="triton"``, the automatic choice there) a prefill runs instead in one pass
of the block-sparse kernel, with no loop over chunks and no merges: :mod:`attn_patterns.dca_triton`.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from attn_patterns.algorithm import Algorithm, register
from attn_patterns.checks import check_int
from attn_patterns.kernels import LSE_BACKENDS, attend_lse, lse_backend, merge_lse
from attn_patterns.rotary import rotate

VARIANTS = ("paper", "chunkllama", "qwen")
# A factor on the attention logits that grows with the sequence length L beyond c, per call
# (the sources compute it from the whole length, never per query): ChunkLlama multiplies its
# cos/sin tables, so q and k, by 1 + 0.05 ln(L/c); the engines multiply cached keys and the
# softmax scale by max(1, 1 + 0.1 ln(L/c)). Either way the logits carry the factor squared.
LOGIT_SCALES = {"none": 0.0, "chunkllama": 0.05, "qwen": 0.1}
DEFAULT_LOGIT_SCALE = {"paper": "none", "chunkllama": "chunkllama", "qwen": "qwen"}
# the paper's ablation (its Figure 4): intra-chunk alone is chunked local attention (low PPL,
# no retrieval across chunks); adding inter-chunk sees every key but from c - 1 only (retrieval
# back, locality lost); successive-chunk restores the true distance of the w nearest keys.
PIECES = ("intra", "intra+inter", "intra+inter+successive")


# --- positions --------------------------------------------------------------------------
def dca_sizes(
    pretraining_length: int, chunk_size: Optional[int] = None, local_window: Optional[int] = None, variant: str = "paper"
) -> tuple[int, int, int]:
    """``(s, w, c)`` with the defaults s = 3c/4 and w = c - s (paper) or w = c/8 (ChunkLlama's
    ``replace_with_chunkllama``, which the ``qwen`` variant shares when no model config gives
    them), checked so that every relative position stays below c. ``qwen`` skips that check:
    Qwen's configs set chunk_size = original_max_position_embeddings, and c only sets the
    length the logit scale counts from."""
    c = check_int("pretraining_length", pretraining_length, "dca", 2)
    s = (3 * c) // 4 if chunk_size is None else check_int("chunk_size", chunk_size, "dca", 1)
    if s >= c and variant != "qwen":
        raise ValueError(
            f"dca: chunk_size={s} must be < pretraining_length={c} (the largest relative position is c - 1 in the "
            f"paper, chunk_size in ChunkLlama's code); the paper uses 3c/4 = {(3 * c) // 4}"
        )
    if variant != "paper":
        w = c // 8 if local_window is None else check_int("local_window", local_window, "dca", 0)
        if w >= s:
            raise ValueError(
                f"dca: local_window={w} must be < chunk_size={s} for variant={variant!r} "
                "(its chunks hold chunk_size - local_window tokens)"
            )
        return s, w, c
    w = c - s if local_window is None else check_int("local_window", local_window, "dca", 0)
    if w > c - s:
        raise ValueError(
            f"dca: local_window={w} must be <= pretraining_length - chunk_size = {c - s} "
            f"(successive-chunk distances reach chunk_size + local_window - 1, which must stay < {c})"
        )
    return s, w, c


def chunk_length(s: int, w: int, variant: str) -> int:
    """The period of the key positions: s in the paper, s - w in the published code."""
    return s if variant == "paper" else s - w


def logit_factor(kind: str, length: int, c: int) -> float:
    """What ``kind`` (``LOGIT_SCALES``) multiplies the attention logits by for a call over
    ``length`` keys: ``(1 + slope·ln(length/c))²``, 1 up to c."""
    if length <= c:
        return 1.0
    return (1.0 + LOGIT_SCALES[kind] * math.log(length / c)) ** 2


def query_positions(
    i: torch.Tensor, *, chunk_size: int, local_window: int, pretraining_length: int, variant: str = "paper",
    pieces: str = PIECES[-1],
) -> tuple[torch.Tensor, ...]:
    """Target positions ``(intra, successive, inter)`` of queries at true positions ``i``;
    without the successive piece the previous chunk is seen like any other (inter-chunk)."""
    s, w, c = chunk_size, local_window, pretraining_length
    a = i % s
    if variant != "paper":
        # the published code: chunks of L = s - w tokens, successive queries at min(a + L, s),
        # inter-chunk queries where the last row's successive query sits, min(2L - 1, s).
        step = s - w
        a = i % step
        inter = torch.full_like(i, min(2 * step - 1, s))
        succ = torch.clamp(a + step, max=s)
    else:
        inter = torch.full_like(i, c - 1)
        succ = torch.where(a < w, s + a, inter)
    return a, (succ if "successive" in pieces else inter), inter


def relative_positions(
    n: int, *, chunk_size: int, local_window: int, pretraining_length: int, variant: str = "paper",
    pieces: str = PIECES[-1],
) -> torch.Tensor:
    """The ``(n, n)`` int64 matrix M of eqs. 2–8; -1 where the key is not seen (above the
    diagonal; other chunks with ``pieces='intra'``). Tests and pictures only (it is N×N)."""
    i = torch.arange(n)
    step = chunk_length(chunk_size, local_window, variant)
    targets = query_positions(i, chunk_size=chunk_size, local_window=local_window,
                              pretraining_length=pretraining_length, variant=variant, pieces=pieces)
    intra, succ, inter = (p[:, None] for p in targets)
    d = i[:, None] // step - i[None, :] // step
    target = torch.where(d == 0, intra, torch.where(d == 1, succ, inter))
    rel = target - (i % step)[None, :]
    seen = (i[None, :] <= i[:, None]) & ((d == 0) | (pieces != "intra"))
    return torch.where(seen, rel, torch.full_like(rel, -1))


def dca_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    inv_freq: torch.Tensor,
    chunk_size: int,
    local_window: int,
    pretraining_length: int,
    scale: Optional[float] = None,
    backend: Optional[str] = None,
    variant: str = "paper",
    pieces: str = PIECES[-1],
) -> torch.Tensor:
    """DCA output (B,H,Nq,D) for the last Nq of Nk positions: q (B,H,Nq,D) and k/v
    (B,Hkv,Nk,D), q and k rotated at their true positions with ``inv_freq`` (what a
    transformers attention function receives).

    Per query chunk, the paper's three pieces, each returning its LSE, merged in fp32:

    * intra-chunk: one causal attention of the chunk on the untouched q and k — the
      distance is the true one, so the model's own rotation is already right;
    * successive-chunk: the first w rows are at the true distance too (untouched q and k);
      the other rows put the query at c - 1 like the inter-chunk piece, so for them both
      pieces are one attention over all earlier chunks;
    * inter-chunk: the query rotated once to c - 1, keys rotated to ``j mod s``.

    Non-causal pieces need no mask, the causal one is square: no masked work in prefill.
    ``pieces`` drops pieces for the paper's ablation (see ``PIECES``).

    ``backend="triton"`` (automatic on CUDA where Triton runs) computes a prefill (Nq = Nk)
    in one pass of the block-sparse kernel instead, no loop and no merges
    (:mod:`attn_patterns.dca_triton`); decoding, and chunks of a length no kernel tile
    divides (not a multiple of 16), take the loop above with the automatic backend."""
    s, w, c = chunk_size, local_window, pretraining_length
    nq, nk = q.shape[2], k.shape[2]
    start = nk - nq
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    step = chunk_length(s, w, variant)  # the length keys repeat their positions with
    backend = lse_backend(backend, q, k, v, owner="dca", block_sparse=True)
    if backend == "triton":
        from attn_patterns import dca_triton

        if nq == nk and dca_triton.takes(step, own_chunk=pieces == "intra"):
            intra, succ, inter = query_positions(torch.arange(nk, device=q.device), chunk_size=s, local_window=w,
                                                 pretraining_length=c, variant=variant, pieces=pieces)
            targets = {"intra": (), "intra+inter": (intra, inter)}.get(pieces, (intra, succ, inter))
            return dca_triton.dca_prefill(q, k, v, step=step, scale=scale, inv_freq=inv_freq, targets=targets)
        backend = lse_backend(None, q, k, v, owner="dca")
    paper = variant == "paper"
    near = min(step, w if paper else w + 1)  # rows whose successive distance is true
    inter_at = c - 1 if paper else min(2 * step - 1, s)
    succ_at = c - 1 if paper else s  # the far rows' successive query position
    if "successive" not in pieces:  # the previous chunk is one more inter-chunk chunk
        near, succ_at = 0, inter_at
    dev = q.device
    out = torch.empty_like(q)
    far_keys: Optional[torch.Tensor] = None  # keys at j mod step, made on first use (never within c tokens)

    def far(rows: slice, pos: torch.Tensor, keys: slice, at: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows' attention, queries moved to position ``at``, to ``keys`` at j mod step."""
        nonlocal far_keys
        if far_keys is None:
            far_keys = _keys_in_chunk_frame(k, step, inv_freq)
        return attend_lse(rotate(q[:, :, rows], at - pos, inv_freq), far_keys[:, :, keys], v[:, :, keys],
                          scale=scale, offset=None, backend=backend, block=step)

    for chunk in range(start // step, (nk - 1) // step + 1):
        lo, hi = max(chunk * step, start), min((chunk + 1) * step, nk)
        intra = attend_lse(q[:, :, lo - start : hi - start], k[:, :, chunk * step : hi], v[:, :, chunk * step : hi],
                           scale=scale, offset=lo - chunk * step, backend=backend, block=step)
        if chunk == 0 or pieces == "intra":
            out[:, :, lo - start : hi - start] = intra[0]
            continue
        prev, before = slice((chunk - 1) * step, chunk * step), slice(0, (chunk - 1) * step)
        near_rows, far_rows = (lo, min(hi, chunk * step + near), True), (max(lo, chunk * step + near), hi, False)
        for row_lo, row_hi, is_near in (near_rows, far_rows):
            if row_lo >= row_hi:
                continue
            rows, pos = slice(row_lo - start, row_hi - start), torch.arange(row_lo, row_hi, device=dev)
            parts = [(intra[0][:, :, row_lo - lo : row_hi - lo], intra[1][:, :, row_lo - lo : row_hi - lo])]
            if is_near:  # successive chunk at the true distance: the model's own rotation
                parts.append(attend_lse(q[:, :, rows], k[:, :, prev], v[:, :, prev],
                                        scale=scale, offset=None, backend=backend, block=step))
            elif succ_at == inter_at:  # previous chunk and all before seen from one position
                parts.append(far(rows, pos, slice(0, chunk * step), inter_at))
            else:
                parts.append(far(rows, pos, prev, succ_at))
            if chunk >= 2 and (is_near or succ_at != inter_at):
                parts.append(far(rows, pos, before, inter_at))
            out[:, :, rows] = merge_lse(parts)
    return out


def _keys_in_chunk_frame(k: torch.Tensor, step: int, inv_freq: torch.Tensor) -> torch.Tensor:
    """Keys moved from position j to j mod ``step`` (chunk c rotated by -c·step), for every
    chunk but the last, whose keys are never far from any query."""
    chunks = (k.shape[2] - 1) // step
    whole = k[:, :, : chunks * step].reshape(*k.shape[:2], chunks, step, k.shape[-1])
    shift = -step * torch.arange(chunks, device=k.device)[:, None]
    return rotate(whole, shift, inv_freq).flatten(2, 3)


# --- the algorithm ----------------------------------------------------------------------
@register
class DualChunkAttention(Algorithm):
    """DCA with chunk size s, local window w and pretraining length c; any left as None is
    taken from the model (c = ``config.max_position_embeddings``, the context the model
    handles with its current RoPE) and the variant's defaults (paper: s = 3c/4, w = c - s).
    ``variant`` picks the paper's equations or a published code's (``VARIANTS``);
    ``logit_scale`` the length-dependent logit factor (``LOGIT_SCALES``; None: the variant's
    own, ``DEFAULT_LOGIT_SCALE``); ``pieces`` is the paper's ablation (``PIECES``)."""

    name = "dca"

    def __init__(
        self,
        *,
        chunk_size: Optional[int] = None,
        local_window: Optional[int] = None,
        pretraining_length: Optional[int] = None,
        variant: str = "paper",
        backend: Optional[str] = None,
        pieces: str = PIECES[-1],
        logit_scale: Optional[str] = None,
    ) -> None:
        if variant not in VARIANTS:
            raise ValueError(f"dca: variant={variant!r} is unknown; allowed: {', '.join(VARIANTS)}")
        if logit_scale is not None and logit_scale not in LOGIT_SCALES:
            raise ValueError(f"dca: logit_scale={logit_scale!r} is unknown; allowed: {', '.join(LOGIT_SCALES)} "
                             "or None (the variant's own)")
        if pieces not in PIECES:
            raise ValueError(f"dca: pieces={pieces!r} is unknown; allowed: {', '.join(PIECES)}")
        if backend is not None and backend not in LSE_BACKENDS:
            raise ValueError(f"dca: backend={backend!r} is unknown; allowed: {', '.join(LSE_BACKENDS)} or None (automatic)")
        if chunk_size is not None:
            check_int("chunk_size", chunk_size, "dca", 1)
        if local_window is not None:
            check_int("local_window", local_window, "dca", 0)
        if pretraining_length is not None:
            dca_sizes(pretraining_length, chunk_size, local_window, variant)
        super().__init__(backend=backend, chunk_size=chunk_size, local_window=local_window,
                         pretraining_length=pretraining_length, variant=variant, pieces=pieces,
                         logit_scale=logit_scale)
        self.backend = backend
        self.chunk_size, self.local_window, self.pretraining_length = chunk_size, local_window, pretraining_length
        self.variant, self.pieces = variant, pieces
        self.logit_scale = DEFAULT_LOGIT_SCALE[variant] if logit_scale is None else logit_scale

    def sizes(self, pretraining_length: Optional[int] = None) -> tuple[int, int, int]:
        """``(s, w, c)``; ``pretraining_length`` is the model's, used when none was given."""
        c = self.pretraining_length or pretraining_length
        if c is None:
            raise ValueError("dca: pretraining_length is unknown; pass pretraining_length=<the model's context>")
        return dca_sizes(c, self.chunk_size, self.local_window, self.variant)

    def scale(self, length: int, head_dim: int, pretraining_length: Optional[int] = None,
              base: Optional[float] = None) -> float:
        """The softmax scale of a call over ``length`` keys: the model's (``base``, default
        1/sqrt(head_dim)) times the logit factor, one number per call as in the sources."""
        base = 1.0 / math.sqrt(head_dim) if base is None else base
        return base * logit_factor(self.logit_scale, length, self.sizes(pretraining_length)[2])

    def relative_positions(self, n: int, pretraining_length: Optional[int] = None) -> torch.Tensor:
        """:func:`relative_positions` of this configuration; ``pretraining_length`` as in :meth:`sizes`."""
        s, w, c = self.sizes(pretraining_length)
        return relative_positions(n, chunk_size=s, local_window=w, pretraining_length=c, variant=self.variant,
                                  pieces=self.pieces)

    def mask(self, seq_len: int, num_heads: int) -> torch.Tensor:
        """Dense bool ``(num_heads, seq_len, seq_len)`` of the keys each query sees: every
        causal key, since DCA moves positions and never hides a key, except with
        ``pieces='intra'``, where a query sees its own chunk only. For tests and pictures."""
        seen = self.relative_positions(seq_len) >= 0
        return seen.expand(num_heads, seq_len, seq_len).clone()

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
               inv_freq: Optional[torch.Tensor], backend: Optional[str] = None) -> torch.Tensor:
        """Whole-sequence DCA of q, k rotated at positions 0..N-1 with ``inv_freq``."""
        s, w, c = self.sizes()
        return dca_attention(q, k, v, inv_freq=inv_freq, chunk_size=s, local_window=w, pretraining_length=c,
                             scale=self.scale(q.shape[2], q.shape[-1]), backend=backend or self.backend,
                             variant=self.variant, pieces=self.pieces)
