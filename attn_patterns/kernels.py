"""The dense kernels sparse attention runs on: the one call every pattern's pieces make, and
attention with its log-sum-exp for the algorithms (DCA, LongHeads) that merge pieces.

A pattern's fast path (:mod:`attn_patterns.strided`) is a list of 4-D attention calls on views
of q, k and v, each square-causal or over every key: the two forms every fused kernel runs
without an explicit mask. No call takes a mask, because given one SDPA leaves its fastest
kernels (and on CUDA needs K/V repeated per query head). :func:`attend` makes one such call
on SDPA or flash-attn, grouped K/V native wherever the kernel is fast with them.
"""

from __future__ import annotations

import importlib.util
import math
import os
from typing import Optional

import torch
import torch.nn.functional as F

BACKENDS = ("sdpa", "flash", "flex", "triton")
_TORCH = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
_SDPA_GQA = _TORCH >= (2, 5)


def flash_available() -> bool:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


def triton_interpreted() -> bool:
    """Whether Triton's interpreter is on (``TRITON_INTERPRET``, read as Triton reads it): it
    runs the block-sparse kernel on CPU tensors, which is how tests check it without a GPU."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes", "y")


def triton_unsupported(device: str, dtype: torch.dtype, head_dim: Optional[int] = None) -> Optional[str]:
    """Why ``backend='triton'`` cannot run on such tensors, None if it can: CUDA tensors in fp16,
    bf16 or fp32, or CPU tensors under Triton's interpreter in fp16 or fp32 (its bf16 ``tl.dot``
    is wrong); head dims up to 256. A pure function of the call, so recipes check it early."""
    if importlib.util.find_spec("triton") is None:
        return "the triton package is not installed (pip install '.[dev]' in a checkout of sparse-ft, or pip install triton)"
    if device == "cuda":
        allowed = (torch.float16, torch.bfloat16, torch.float32)
    elif device == "cpu" and triton_interpreted():
        allowed = (torch.float16, torch.float32)
    else:
        return f"it needs CUDA tensors (or CPU tensors with TRITON_INTERPRET=1, for tests), got device={device}"
    if dtype not in allowed:
        names = ", ".join(str(d).replace("torch.", "") for d in allowed)
        return f"on {device} it takes {names}, got dtype={str(dtype).replace('torch.', '')}"
    if head_dim is not None and not 1 <= head_dim <= 256:
        return f"it takes head dims 1..256, got {head_dim}"
    return None


def resolve_backend(backend: Optional[str], q: torch.Tensor) -> str:
    """``None`` means ``sdpa``: it runs everywhere, has a backward everywhere and picks its own
    kernel (flash on A100/H100, memory-efficient on V100, the fused CPU kernel on CPU).
    ``flash``, ``flex`` and ``triton`` only when asked for, and only where they can run."""
    if backend is None:
        return "sdpa"
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is unknown; allowed: {', '.join(BACKENDS)} or None (= sdpa)")
    if backend == "flash":
        if not (q.is_cuda and flash_available()):
            raise ValueError(
                "backend='flash' needs the flash-attn package and CUDA tensors "
                "(pip install '.[flash]' in a checkout of sparse-ft, on a CUDA machine); use backend='sdpa'"
            )
        if q.dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"backend='flash' needs fp16 or bf16 tensors, got dtype={q.dtype}; use backend='sdpa'")
    if backend == "triton":
        why = triton_unsupported(q.device.type, q.dtype, q.shape[-1])
        if why is not None:
            raise ValueError(f"backend='triton' cannot run here: {why}; use backend='sdpa'")
    return backend


def _gqa_native(q: torch.Tensor, kv_heads: int) -> bool:
    """Whether SDPA takes fewer K/V heads at full speed. On CUDA only its flash kernel does
    (half precision; others fall back to the math kernel). On CPU the fused kernel does, but
    its backward shares work only across batch × KV heads: measured on torch 2.13 with 2
    threads, one KV head took 3-10× the CPU time of repeated K/V, and 3 units 1.2× the wall
    time (one thread idles for a third of it). So natively where those units fill the threads
    as evenly as batch × query heads would."""
    if not _SDPA_GQA:
        return False
    if not q.is_cuda:
        threads = torch.get_num_threads()
        even = lambda units: units / (threads * -(-units // threads))  # noqa: E731  busy share of the threads
        return even(q.shape[0] * kv_heads) >= even(q.shape[0] * q.shape[1])
    d = q.shape[-1]
    # under autocast q arrives in fp32 (RoPE over fp32 masters) and SDPA casts it to the
    # autocast dtype: that dtype is the one the kernel sees (found on an H200, where reading
    # q.dtype repeated K/V per query head in every recipe step: 12 KiB per token at 8B)
    dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else q.dtype
    return dtype in (torch.float16, torch.bfloat16) and d % 8 == 0 and d <= 256


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool) -> torch.Tensor:
    """4-D SDPA without a mask, scale 1/sqrt(D), k/v with ``H // groups`` heads."""
    groups = q.shape[1] // k.shape[1]
    gqa = groups > 1 and _gqa_native(q, k.shape[1])
    if groups > 1 and not gqa:  # only this call's K/V, and only where the kernel needs it
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    extra = {"enable_gqa": True} if gqa else {}
    scale = 1.0 / math.sqrt(q.shape[-1])
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, **extra)


# The SDPA backends a pattern's strided pieces may run on CUDA: not cuDNN. With torch 2.11 and
# cuDNN 9.19 (an H100 and an H200, 2026-11-26) its attention on the pieces' views returned
# gradients off by more than 1 (scca_fixed, N=1000, D=64, bf16 and fp16), failed to execute its
# graph at D=128, and read out of bounds in a 1B training step at 16k (an illegal memory access):
# results/bench/sdpa-views-h200.txt. Dense calls on whole tensors keep SDPA's own choice.
PIECE_SDPA = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH")
_SDPA_ENABLED = {"FLASH_ATTENTION": "flash_sdp_enabled", "EFFICIENT_ATTENTION": "mem_efficient_sdp_enabled",
                 "MATH": "math_sdp_enabled"}


def piece_kernels(device_type: str):
    """The context a pattern's pieces run SDPA in: on CUDA, the backends enabled now (a caller's
    ``sdpa_kernel`` pin included) less cuDNN; a pin that leaves none fails as SDPA does ("No
    available kernel"), naming why."""
    from contextlib import nullcontext

    if device_type != "cuda":
        return nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    allowed = [getattr(SDPBackend, name) for name in PIECE_SDPA if getattr(torch.backends.cuda, _SDPA_ENABLED[name])()]
    if not allowed:
        raise RuntimeError("No available kernel for a pattern's strided pieces: SDPA is pinned to cuDNN, whose "
                           f"attention is wrong on such views (attn_patterns.kernels.PIECE_SDPA: {', '.join(PIECE_SDPA)})")
    return sdpa_kernel(allowed)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, backend: str) -> torch.Tensor:
    """q ``(X, H, L, D)``, k/v ``(X, Hkv, L', D)`` with ``H % Hkv == 0`` -> ``(X, H, L, D)``,
    scale 1/sqrt(D): over every key, or square causal (``L == L'``: row u sees key rows
    t <= u). Any strides with a unit last one: views of q/k/v go in as they are."""
    if backend == "flash":
        from flash_attn import flash_attn_func

        t = lambda x: x.transpose(1, 2)  # noqa: E731  flash-attn's (X, L, H, D); it takes fewer K/V heads
        return t(flash_attn_func(t(q), t(k), t(v), causal=causal))
    return sdpa(q, k, v, causal=causal)


def causal_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, lengths: list[int]) -> torch.Tensor:
    """Causal attention inside each of the sequences of ``lengths`` laid end to end: q (T,H,D),
    k/v (T,Hkv,D) -> (T,H,D), scale 1/sqrt(D). One call of flash-attn's varlen kernel whatever
    the lengths (packed documents need no loop over them); it takes fewer K/V heads natively."""
    from flash_attn import flash_attn_varlen_func

    cu = torch.tensor([0, *lengths], device=q.device).cumsum(0).to(torch.int32)
    longest = max(lengths)
    return flash_attn_varlen_func(q, k, v, cu, cu, longest, longest, causal=True, softmax_scale=q.shape[-1] ** -0.5)


# --- attention with its log-sum-exp, and the exact merge of such pieces ----------------------
# Methods that give one query several sets of keys at different positions (DCA's three pieces,
# LongHeads' re-positioned chunks) compute each set's attention apart and merge them exactly:
# softmax over a union of key sets is a log-sum-exp-weighted mix of the per-set softmaxes.

# "sdpa": torch's fused flash op (its CPU kernel on CPU, FlashAttention-2 on sm80+ GPUs);
# "efficient": torch's memory-efficient op (CUDA, V100 and fp32 too); "flash": the flash-attn
# package; "flex": FlexAttention; "math": the matmul reference every other one is tested on;
# "triton": no pieces at all, the whole call in one pass of the block-sparse kernel, where the
# caller has such a path for it (``block_sparse``: DCA's prefill, attn_patterns.dca_triton).
LSE_BACKENDS = ("sdpa", "efficient", "flash", "flex", "math", "triton")
# Automatic order, fastest first. flex only when named: compiled per piece shape on CUDA and
# unfused (scores materialised) on CPU, it is the cross-check, not the fast path. triton first
# on CUDA where the call has a one-pass path (the pieces' loop and merges are its overhead).
_AUTO_LSE = ("flash", "sdpa", "efficient", "math")
_HALF = (torch.float16, torch.bfloat16)


def lse_unsupported(
    backend: str, *, device: str, dtype: torch.dtype, needs_grad: bool,
    capability: Optional[tuple[int, int]], flash_attn: bool, head_dim: int, block_sparse: bool = False,
) -> Optional[str]:
    """Why ``backend`` cannot return attention with its LSE for such a call, None if it can.
    A pure function of the machine and the call, so the whole table is tested without CUDA.
    ``block_sparse``: the caller runs the call in one pass of the block-sparse kernel, where
    ``triton`` runs (:func:`triton_unsupported`); it differentiates, having no LSE to merge."""
    sm = capability or (0, 0)
    if backend == "math":
        return None
    if backend == "triton":
        if not block_sparse:
            return "the block-sparse kernel runs no such call (it runs DCA's prefill)"
        return triton_unsupported(device, dtype, head_dim)
    if backend == "flex":
        return "FlexAttention has no backward on CPU" if needs_grad and device != "cuda" else None
    if needs_grad:  # torch's derivatives.yaml and flash-attn's autograd both drop the LSE's gradient
        return "the fused kernels return the LSE without a gradient, and the merge differentiates it"
    if backend == "sdpa" and device == "cpu":
        return None
    if device != "cuda":
        return f"it needs CUDA tensors, got {device}"
    if backend == "efficient":
        if dtype not in (torch.float32, *_HALF) or (dtype == torch.bfloat16 and sm < (8, 0)):
            return f"it takes fp32, fp16 and (sm80+) bf16, got {dtype} on sm{sm[0]}{sm[1]}"
        align = 8 if dtype in _HALF else 4  # 16-byte rows for its GEMMs
        return f"it needs a head dim divisible by {align}, got {head_dim}" if head_dim % align else None
    if backend == "flash" and not flash_attn:
        return "the flash-attn package is not installed"
    if dtype not in _HALF:
        return f"FlashAttention takes fp16 or bf16, got {dtype}"
    if sm < (8, 0):
        return f"FlashAttention-2 needs sm80+ (A100, H100), this GPU is sm{sm[0]}{sm[1]}"
    if head_dim % 8 or head_dim > 256:
        return f"FlashAttention takes head dims divisible by 8 up to 256, got {head_dim}"
    return None


def choose_lse_backend(
    *, device: str, dtype: torch.dtype, needs_grad: bool,
    capability: Optional[tuple[int, int]], flash_attn: bool, head_dim: int, block_sparse: bool = False,
) -> str:
    """The automatic choice: on CUDA the block-sparse kernel where the call has a one-pass
    path (``block_sparse``) and Triton runs; else flash-attn, else torch's flash op, else its
    memory-efficient op, whichever runs first; math when none does (gradients, other devices)."""
    case = dict(device=device, dtype=dtype, needs_grad=needs_grad, capability=capability, flash_attn=flash_attn,
                head_dim=head_dim, block_sparse=block_sparse)
    order = ("triton", *_AUTO_LSE) if device == "cuda" else _AUTO_LSE
    return next(b for b in order if lse_unsupported(b, **case) is None)


def lse_backend(backend: Optional[str], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, owner: str,
                block_sparse: bool = False) -> str:
    """``None``: :func:`choose_lse_backend` for this call. A named backend is checked against
    the same table and refused with the reason and what does run here; errors name ``owner``.
    ``block_sparse``: the caller has a one-pass path for the call (see :func:`lse_unsupported`)."""
    if backend is not None and backend not in LSE_BACKENDS:
        raise ValueError(f"{owner}: backend={backend!r} is unknown; allowed: {', '.join(LSE_BACKENDS)} or None (automatic)")
    case = dict(device=q.device.type, dtype=q.dtype, needs_grad=torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v)),
                capability=torch.cuda.get_device_capability(q.device) if q.is_cuda else None,
                flash_attn=q.is_cuda and flash_available(), head_dim=q.shape[-1], block_sparse=block_sparse)
    if backend is None:
        return choose_lse_backend(**case)
    why = lse_unsupported(backend, **case)
    if why is not None:
        here = [b for b in LSE_BACKENDS if lse_unsupported(b, **case) is None]
        raise ValueError(f"{owner}: backend={backend!r} cannot run here: {why}; allowed here: {', '.join(here)} or None (automatic)")
    return backend


def _fold(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """(B, H, L, D) -> (B, Hkv, G·L, D): grouped queries share their key head, so a
    non-causal attention needs no copy of K and V per query head."""
    b, h, length, d = q.shape
    return q.reshape(b, kv_heads, (h // kv_heads) * length, d)


def _unfold(x: torch.Tensor, heads: int) -> torch.Tensor:
    """Inverse of :func:`_fold` for outputs (B, Hkv, G·L, D) and LSEs (B, Hkv, G·L)."""
    return x.reshape(x.shape[0], heads, -1, *x.shape[3:])


def attend_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, offset: Optional[int], backend: str, block: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """q (B,H,L,D) vs k/v (B,Hkv,Lk,D) -> output (B,H,L,D) in q's dtype and LSE (B,H,L) in
    fp32 (fp64 for fp64 input). Query row u sees key row t when ``t <= u + offset`` (None:
    every key). ``backend`` from :func:`lse_backend`; ``block`` bounds the math path's memory
    to O(L·block)."""
    if backend == "sdpa" and not q.is_cuda:
        return _cpu_lse(q, k, v, scale=scale, offset=offset)
    if backend == "flex":
        return _flex_lse(q, k, v, scale=scale, offset=offset)
    shape = _bottom_right(offset, q.shape[2], k.shape[2])
    if backend == "math" or shape is None:
        return _attend_lse_math(q, k, v, scale=scale, offset=offset, block=block)
    n, causal = shape
    return _FUSED[backend](q, k[:, :, :n], v[:, :, :n], scale=scale, causal=causal)


def _bottom_right(offset: Optional[int], lq: int, lk: int) -> Optional[tuple[int, bool]]:
    """The mask ``t <= u + offset`` as what the CUDA kernels take: ``(n, causal)`` = the first
    n keys, all of them or causal aligned bottom-right (row u sees t <= u + n - lq; FlashAttention
    and torch's flash op align a non-square causal mask so). DCA's and LongHeads' pieces are
    all of this form (``offset = lk - lq`` or none); None for the rest, which math computes."""
    if offset is None or offset >= lk - 1:
        return lk, False
    n = lq + offset
    return (n, True) if n <= lk else None


def _cpu_lse(q, k, v, *, scale, offset):
    """torch's fused CPU kernel: GQA folded when no mask, top-left causal when square, else an
    additive (L, Lk) mask (the piece's own size, never N×N)."""
    h, hkv = q.shape[1], k.shape[1]
    lq, lk = q.shape[2], k.shape[2]
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    if offset is None:
        out, lse = op(_fold(q, hkv), k, v, 0.0, False, scale=scale)
        return _unfold(out, h), _unfold(lse, h)
    groups = h // hkv
    k, v = (x.repeat_interleave(groups, dim=1) if groups > 1 else x for x in (k, v))
    if offset == 0 and lq == lk:
        return op(q, k, v, 0.0, True, scale=scale)
    # the kernel takes additive masks only: -inf where key t > u + offset
    bias = torch.full((lq, lk), float("-inf"), dtype=q.dtype, device=q.device).triu(offset + 1)
    return op(q, k, v, 0.0, False, attn_mask=bias, scale=scale)


def _efficient_lse(q, k, v, *, scale, causal):
    """torch's memory-efficient kernel (the one V100 and fp32 have). It wants as many K/V heads
    as queries: without a mask the query groups fold onto their K/V head (no copy of K/V);
    causal pieces repeat K/V. Its LSE is padded to a multiple of 32 rows (with +inf)."""
    h, hkv = q.shape[1], k.shape[1]
    fold = hkv != h and not causal
    if fold:
        q = _fold(q, hkv)
    elif hkv != h:
        k, v = (x.repeat_interleave(h // hkv, dim=1) for x in (k, v))
    t = lambda x: x.transpose(1, 2)  # noqa: E731  the op's (B, L, H, D) layout
    out, lse = torch.ops.aten._efficient_attention_forward(
        t(q), t(k), t(v), bias=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
        dropout_p=0.0, custom_mask_type=2 if causal else 0,  # 2: causal from the bottom right
        compute_log_sumexp=True, scale=scale,
    )[:2]
    out, lse = t(out), lse[..., : q.shape[2]]
    return (_unfold(out, h), _unfold(lse, h)) if fold else (out, lse)


def _torch_flash_lse(q, k, v, *, scale, causal):
    """FlashAttention-2 inside torch: fewer K/V heads natively, LSE (B, H, L)."""
    return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, scale=scale)[:2]


def _flash_attn_lse(q, k, v, *, scale, causal):
    """The flash-attn package, (B, L, H, D) layout, fewer K/V heads natively."""
    from flash_attn import flash_attn_func

    t = lambda x: x.transpose(1, 2)  # noqa: E731
    out, lse, _ = flash_attn_func(t(q), t(k), t(v), softmax_scale=scale, causal=causal, return_attn_probs=True)
    return t(out), lse[..., : q.shape[2]]


def _flex_lse(q, k, v, *, scale, offset):
    """FlexAttention with its LSE (natural log: torch converts its internal log2 before
    returning). Any offset is a mask_mod; compiled on CUDA, unfused on CPU."""
    import torch.nn.attention.flex_attention as fa

    from attn_patterns.flex import compiled_flex

    lq, lk = q.shape[2], k.shape[2]
    mask = None
    if offset is not None and offset < lk - 1:
        mask = fa.create_block_mask(lambda batch, head, row, col: col <= row + offset, None, None, lq, lk,
                                    device=q.device, _compile=q.is_cuda)
    kernel = compiled_flex() if q.is_cuda else fa.flex_attention
    aux = getattr(fa, "AuxRequest", None)  # torch >= 2.9; return_lse before
    extra = {"return_aux": aux(lse=True)} if aux else {"return_lse": True}
    out, lse = kernel(q, k, v, block_mask=mask, scale=scale, enable_gqa=k.shape[1] != q.shape[1], **extra)
    return out, (lse.lse if aux else lse).float()


_FUSED = {"sdpa": _torch_flash_lse, "efficient": _efficient_lse, "flash": _flash_attn_lse}


def _attend_lse_math(q, k, v, *, scale, offset, block):
    """Pure matmul path (any device, differentiable): keys in blocks of ``block`` rows with
    a running max and sum in fp32."""
    h, hkv = q.shape[1], k.shape[1]
    qf = _fold(q, hkv).float() * scale
    groups, lq = h // hkv, q.shape[2]
    rows = torch.arange(lq, device=q.device).repeat(groups)[:, None]  # folded row -> query row
    top = lse = acc = None
    for start in range(0, k.shape[2], block):
        kb, vb = k[:, :, start : start + block].float(), v[:, :, start : start + block].float()
        scores = qf @ kb.transpose(-1, -2)
        if offset is not None:
            cols = torch.arange(start, start + kb.shape[2], device=q.device)[None, :]
            scores = scores.masked_fill(cols > rows + offset, float("-inf"))
        m = scores.amax(-1, keepdim=True)
        if top is None:
            top = m
            p = (scores - top).exp()
            lse, acc = p.sum(-1, keepdim=True), p @ vb
        else:
            new = torch.maximum(top, m)
            fade, p = (top - new).exp(), (scores - new).exp()
            lse, acc = lse * fade + p.sum(-1, keepdim=True), acc * fade + p @ vb
            top = new
    out = (acc / lse).to(q.dtype)
    return _unfold(out, h), _unfold((lse.log() + top).squeeze(-1), h)


def merge_lse(pieces: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Exact softmax over the union of the pieces' keys from their outputs and LSEs, folded
    in pairwise: ``o = lerp(o_b, o_a, σ(lse_a − lse_b))``, the weights in fp32. The result
    has the first piece's dtype."""
    out, lse = pieces[0][0], pieces[0][1].float()
    for o, piece_lse in pieces[1:]:
        piece_lse = piece_lse.float()
        weight = torch.sigmoid(lse - piece_lse).unsqueeze(-1)  # share of the keys merged so far
        out = torch.lerp(o.float(), out.float(), weight)
        lse = torch.logaddexp(lse, piece_lse)
    return out.to(pieces[0][0].dtype)


def auto_backend(half_precision: bool, allowed: tuple[Optional[str], ...] = (None, *BACKENDS)) -> Optional[str]:
    """``auto``: flash-attn where it can run (installed, CUDA, half precision) and ``allowed``
    has it, SDPA elsewhere, None where ``allowed`` has neither (the model's own attention
    picks its kernel itself). Resolved on the machine that runs, so a saved recipe names what
    ran."""
    if "flash" in allowed and half_precision and flash_available():
        return "flash"
    return "sdpa" if "sdpa" in allowed else None
