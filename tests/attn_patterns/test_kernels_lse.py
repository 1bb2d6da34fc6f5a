"""Attention with its log-sum-exp: every backend that runs on CPU against the math reference,
the automatic choice for every device/dtype/gradient/GPU case, and the CUDA kernels' calling
conventions (layout, bottom-right causal alignment, padded LSE, head counts) through CPU
stand-ins that implement each kernel as documented. The real CUDA runs are in test_cuda_kernels.py."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from attn_patterns import kernels
from attn_patterns.dca import dca_attention
from attn_patterns.kernels import _attend_lse_math, attend_lse, choose_lse_backend, lse_backend, lse_unsupported
from attn_patterns.rotary import default_inv_freq, rotate

# (Lq, Lk, offset): non-causal, square causal, the intra piece of chunked prefill / decoding
# (offset = Lk - Lq), and masks no DCA piece has (fewer or more keys than bottom-right).
SHAPES = [(7, 7, None), (7, 7, 0), (5, 9, 4), (1, 9, 8), (5, 9, 2), (5, 9, 6), (33, 40, 7)]
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


def qkv(lq, lk, heads=4, kv_heads=2, dtype=FP32, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(2, heads, lq, d), (2, kv_heads, lk, d), (2, kv_heads, lk, d)]
    return [torch.randn(s, generator=g).to(dtype) for s in shapes]


def assert_matches_math(q, k, v, offset, backend, tol):
    out, lse = attend_lse(q, k, v, scale=0.3, offset=offset, backend=backend, block=4)
    want_out, want_lse = _attend_lse_math(q, k, v, scale=0.3, offset=offset, block=4)
    assert out.dtype == q.dtype and out.shape == q.shape and lse.shape == q.shape[:3]
    torch.testing.assert_close(out.float(), want_out.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(lse.float(), want_lse.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("backend,kv_heads", [("sdpa", 4), ("sdpa", 2), ("sdpa", 1), ("flex", 2)])
@pytest.mark.parametrize("dtype,tol", [(FP32, 1e-5), (BF16, 2e-2)])
def test_cpu_backends_match_math(backend, kv_heads, dtype, tol):
    for lq, lk, offset in SHAPES:
        assert_matches_math(*qkv(lq, lk, kv_heads=kv_heads, dtype=dtype), offset, backend, tol)


def call(device, dtype, needs_grad, capability, flash_attn, head_dim) -> dict:
    """A row of the table below as the keyword arguments of the backend choice."""
    return dict(device=device, dtype=dtype, needs_grad=needs_grad, capability=capability, flash_attn=flash_attn,
                head_dim=head_dim)


# (device, dtype, needs_grad, capability, flash-attn installed, head dim) -> automatic choice
TABLE = [
    (("cpu", FP32, False, None, False, 64), "sdpa"),
    (("cpu", BF16, False, None, False, 64), "sdpa"),
    (("cpu", torch.float64, False, None, False, 12), "sdpa"),
    (("cpu", FP32, True, None, False, 64), "math"),
    (("cuda", BF16, False, (9, 0), False, 128), "sdpa"),  # H100
    (("cuda", FP16, False, (8, 0), False, 64), "sdpa"),  # A100
    (("cuda", BF16, False, (9, 0), True, 128), "flash"),
    (("cuda", FP16, False, (8, 0), True, 64), "flash"),
    (("cuda", FP16, False, (7, 0), True, 128), "efficient"),  # V100: no FlashAttention-2
    (("cuda", FP16, False, (7, 5), False, 64), "efficient"),  # T4
    (("cuda", BF16, False, (7, 0), False, 128), "math"),  # V100 has no bf16 kernel
    (("cuda", FP32, False, (8, 0), True, 128), "efficient"),
    (("cuda", FP32, False, (7, 0), False, 12), "efficient"),
    (("cuda", FP16, False, (9, 0), True, 320), "efficient"),  # head dim over FlashAttention's 256
    (("cuda", FP16, False, (9, 0), False, 12), "math"),  # 12 is not 16-byte rows in fp16
    (("cuda", FP32, False, (9, 0), False, 10), "math"),
    (("cuda", torch.float64, False, (9, 0), True, 64), "math"),
    (("cuda", BF16, True, (9, 0), True, 128), "math"),  # the fused LSEs have no gradient
    (("cuda", FP32, True, (7, 0), False, 64), "math"),
    (("mps", FP16, False, None, False, 64), "math"),
]


@pytest.mark.parametrize("case,want", TABLE, ids=[f"{c[0]}-{str(c[1])[6:]}-grad{c[2]}-sm{c[3]}-fa{c[4]}-d{c[5]}" for c, _ in TABLE])
def test_automatic_choice(case, want):
    assert choose_lse_backend(**call(*case)) == want


def test_explicit_backends_are_checked_with_reasons():
    assert lse_unsupported("flex", **call("cuda", BF16, True, (9, 0), False, 64)) is None  # flex differentiates its LSE
    assert "no backward on CPU" in lse_unsupported("flex", **call("cpu", FP32, True, None, False, 64))
    assert "not installed" in lse_unsupported("flash", **call("cuda", BF16, False, (9, 0), False, 64))
    assert "sm80+" in lse_unsupported("sdpa", **call("cuda", FP16, False, (7, 0), False, 64))
    assert "fp16 or bf16" in lse_unsupported("sdpa", **call("cuda", FP32, False, (9, 0), False, 64))
    q, k, v = qkv(3, 3)
    with pytest.raises(ValueError, match=r"dca: backend='efficient' cannot run here: it needs CUDA tensors, got cpu; "
                                         r"allowed here: sdpa, flex, math or None \(automatic\)"):
        lse_backend("efficient", q, k, v, owner="dca")
    with pytest.raises(ValueError, match=r"backend='cuda' is unknown; allowed: sdpa, efficient, flash, flex, math"):
        lse_backend("cuda", q, k, v, owner="dca")
    q.requires_grad_()
    with pytest.raises(ValueError, match="without a gradient.*allowed here: math or None"):
        lse_backend("sdpa", q, k, v, owner="longheads")
    assert lse_backend(None, q, k, v, owner="dca") == "math"
    with torch.no_grad():
        assert lse_backend(None, q, k, v, owner="dca") == "sdpa"


# --- the CUDA kernels' conventions, on CPU --------------------------------------------------


def documented(q, k, v, scale, causal):
    """What the CUDA kernels compute, from their documentation: (B,H,L,D) q vs k/v with the
    same or fewer heads, causal aligned bottom-right (row u sees t <= u + Lk - Lq)."""
    groups = q.shape[1] // k.shape[1]
    k, v = (x.repeat_interleave(groups, dim=1).double() for x in (k, v))
    scores = q.double() @ k.transpose(-1, -2) * scale
    if causal:
        lq, lk = q.shape[2], k.shape[2]
        hidden = torch.ones(lq, lk, dtype=torch.bool).triu(lk - lq + 1)
        scores = scores.masked_fill(hidden, float("-inf"))
    return (scores.softmax(-1) @ v).to(q.dtype), scores.logsumexp(-1).float()


def fake_efficient(query, key, value, bias, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                   custom_mask_type, compute_log_sumexp=False, *, scale=None, seqlen_k=None, window_size=None):
    """torch's _efficient_attention_forward: (B,L,H,D), as many K/V heads as query heads,
    mask type 0 none / 2 causal from the bottom right, LSE padded to 32 rows with +inf."""
    assert query.shape[2] == key.shape[2] and bias is None and compute_log_sumexp and custom_mask_type in (0, 2)
    out, lse = documented(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), scale, custom_mask_type == 2)
    pad = -lse.shape[-1] % 32
    lse = torch.cat([lse, lse.new_full((*lse.shape[:2], pad), float("inf"))], -1)
    return out.transpose(1, 2), lse, torch.empty(()), torch.empty(()), query.shape[1], key.shape[1]


def fake_torch_flash(query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
    """torch's _scaled_dot_product_flash_attention: (B,H,L,D), fewer K/V heads natively."""
    out, lse = documented(query, key, value, scale, is_causal)
    e = torch.empty(())
    return out, lse, e, e, query.shape[2], key.shape[2], e, e, e


def fake_flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, return_attn_probs=False, **kw):
    """flash-attn's flash_attn_func: (B,L,H,D), returns (out, softmax_lse, S_dmask)."""
    assert return_attn_probs and not kw
    out, lse = documented(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), softmax_scale, causal)
    return out.transpose(1, 2), lse, None


@pytest.fixture
def cuda_stand_ins(monkeypatch):
    lib = torch.library.Library("aten", "IMPL")
    lib.impl("_efficient_attention_forward", fake_efficient, "CPU")
    lib.impl("_scaled_dot_product_flash_attention", fake_torch_flash, "CPU")
    monkeypatch.setitem(sys.modules, "flash_attn", types.SimpleNamespace(flash_attn_func=fake_flash_attn_func))
    yield
    lib._destroy()


@pytest.mark.parametrize("backend", ["efficient", "flash"])
def test_cuda_conventions_give_the_math_result(cuda_stand_ins, backend):
    for lq, lk, offset in SHAPES:
        assert_matches_math(*qkv(lq, lk), offset, backend, 1e-5)


def test_torch_flash_op_convention(cuda_stand_ins):
    """The op behind backend='sdpa' on CUDA, fed what attend_lse feeds it for each piece shape."""
    for lq, lk, offset in SHAPES:
        q, k, v = qkv(lq, lk)
        shape = kernels._bottom_right(offset, lq, lk)
        if shape is None:  # math computes these; no DCA or LongHeads piece has them
            assert offset is not None and lk - lq < offset < lk - 1
            continue
        n, causal = shape
        out, lse = kernels._FUSED["sdpa"](q, k[:, :, :n], v[:, :, :n], scale=0.3, causal=causal)
        want_out, want_lse = _attend_lse_math(q, k, v, scale=0.3, offset=offset, block=4)
        torch.testing.assert_close(out, want_out, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=1e-5)


def dca_cases(backend, dtype=FP32, device="cpu", d=16, tails=(29, 13, 1)):
    """DCA's prefill, chunked prefill and decoding rows with ``backend`` and with math."""
    s, w, c, n = 6, 3, 10, 29
    q, k, v = (x.to(device) for x in qkv(n, n, dtype=dtype, d=d))
    inv = default_inv_freq(d).to(device)
    pos = torch.arange(n, device=device)
    q, k = rotate(q, pos, inv), rotate(k, pos, inv)
    for tail in tails:
        sizes = dict(inv_freq=inv, chunk_size=s, local_window=w, pretraining_length=c)
        got = dca_attention(q[:, :, -tail:], k, v, **sizes, backend=backend)
        yield got, dca_attention(q[:, :, -tail:], k, v, **sizes, backend="math")


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
def test_dca_with_each_cpu_backend_equals_math(backend):
    # decoding is mask-free, so flex (slow on CPU: unfused) runs prefill and chunked prefill
    for got, want in dca_cases(backend, tails=(29, 13) if backend == "flex" else (29, 13, 1)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["efficient", "flash"])
def test_dca_through_the_cuda_conventions_equals_math(cuda_stand_ins, backend, monkeypatch):
    # the stand-ins run on CPU tensors, so let the backend check pass as on a CUDA machine
    monkeypatch.setattr(kernels, "lse_unsupported", lambda backend, **case: None)
    for got, want in dca_cases(backend):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_merge_stays_fp32_and_keeps_the_input_dtype():
    q, k, v = qkv(6, 12, dtype=BF16)
    pieces = [attend_lse(q, k[:, :, :6], v[:, :, :6], scale=0.25, offset=None, backend="sdpa", block=4),
              attend_lse(q, k[:, :, 6:], v[:, :, 6:], scale=0.25, offset=0, backend="sdpa", block=4)]
    assert all(lse.dtype == FP32 for _, lse in pieces)
    merged = kernels.merge_lse(pieces)
    want, _ = _attend_lse_math(q, k, v, scale=0.25, offset=6, block=4)
    assert merged.dtype == BF16
    torch.testing.assert_close(merged.float(), want.float(), atol=1e-2, rtol=1e-2)
