"""The kernels on CUDA, each test under a minute (the GPU budget is small): the patterns on
every backend in half precision against the dense reference, values and gradients; every CUDA
LSE backend against the math path; the automatic choice; DCA (prefill, chunked prefill,
decoding) and LongHeads through their fused kernels against math; grouped K/V kept native
under autocast. ``gpu``-marked: collected on CPU, where all are skipped."""

from __future__ import annotations

import pytest
import torch

import attn_patterns
from attn_patterns.kernels import _attend_lse_math, attend_lse, lse_backend, lse_unsupported
from attn_patterns.longheads import LongHeads
from attn_patterns.reference import dense_attention
from attn_patterns.rotary import default_inv_freq, rotate

from tests.attn_patterns.test_kernels_lse import SHAPES, dca_cases, qkv as lse_qkv
from tests.attn_patterns.test_patterns import PATTERNS, qkv

pytestmark = pytest.mark.gpu
HALF = [torch.bfloat16, torch.float16]
TOL = {torch.bfloat16: 2e-2, torch.float16: 3e-3, torch.float32: 1e-3}  # fp32 GEMMs may run as 3xTF32


def runnable(backend: str, dtype: torch.dtype, d: int = 64) -> None:
    """Skip only what this GPU or install cannot run (flash-attn absent, sm < 80, ...)."""
    if backend == "flash":
        pytest.importorskip("flash_attn")
    why = lse_unsupported(backend, device="cuda", dtype=dtype, needs_grad=False, capability=torch.cuda.get_device_capability(),
                          flash_attn=backend == "flash", head_dim=d)
    if why is not None:
        pytest.skip(f"{backend} on this GPU: {why}")


@pytest.mark.parametrize("backend", ["sdpa", "flex", "flash"])
@pytest.mark.parametrize("dtype", HALF)
def test_cuda_backends_match_reference(backend, dtype):
    if backend == "flash":
        pytest.importorskip("flash_attn")
    n, heads = 1000, 8
    for name, params in PATTERNS:
        pattern = attn_patterns.get(name, **params)
        q, k, v = (x.cuda() for x in qkv(n, 2, dtype=dtype, dim=64, grad=False))
        q, k, v = (x.requires_grad_() for x in (q, k, v))
        out = pattern(q, k, v, backend=backend)
        ref = dense_attention(q, k, v, pattern.mask(n, heads).cuda())
        torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
        cot = torch.randn_like(out)
        for a, b in zip(torch.autograd.grad(out, (q, k, v), cot), torch.autograd.grad(ref, (q, k, v), cot)):
            torch.testing.assert_close(a.float(), b.float(), atol=5e-2, rtol=5e-2)


# fp32 only where a kernel takes it; flex on a few shapes, as it compiles once per shape
FUSED = [(b, dt) for b in ("sdpa", "efficient", "flash", "flex") for dt in HALF] + [("efficient", torch.float32),
                                                                                  ("flex", torch.float32)]


@pytest.mark.parametrize("backend,dtype", FUSED, ids=[f"{b}-{str(dt)[6:]}" for b, dt in FUSED])
def test_lse_backends_match_math(backend, dtype):
    runnable(backend, dtype)
    shapes, heads = (SHAPES[1:5], (2,)) if backend == "flex" else (SHAPES, (4, 2, 1))
    for kv_heads in heads:
        for lq, lk, offset in shapes:
            q, k, v = (x.cuda() for x in lse_qkv(lq, lk, kv_heads=kv_heads, dtype=dtype, d=64))
            out, lse = attend_lse(q, k, v, scale=0.125, offset=offset, backend=backend, block=16)
            want_out, want_lse = _attend_lse_math(q, k, v, scale=0.125, offset=offset, block=16)
            assert out.dtype == dtype and lse.dtype == torch.float32 and lse.shape == q.shape[:3]
            torch.testing.assert_close(out.float(), want_out.float(), atol=TOL[dtype], rtol=TOL[dtype])
            torch.testing.assert_close(lse, want_lse, atol=TOL[dtype], rtol=TOL[dtype])


def test_automatic_choice_on_this_gpu():
    q = torch.randn(1, 4, 8, 64, device="cuda")
    try:
        import flash_attn  # noqa: F401

        flash = "flash"
    except ImportError:
        flash = "sdpa"
    ampere = torch.cuda.get_device_capability() >= (8, 0)
    assert lse_backend(None, *(q.bfloat16(),) * 3, owner="dca") == (flash if ampere else "math")
    assert lse_backend(None, *(q.half(),) * 3, owner="dca") == (flash if ampere else "efficient")
    assert lse_backend(None, q, q, q, owner="dca") == "efficient"
    assert lse_backend(None, q.requires_grad_(), q, q, owner="dca") == "math"


@pytest.mark.parametrize("backend", [None, "sdpa", "efficient", "flash"])
@pytest.mark.parametrize("dtype", HALF)
def test_dca_prefill_chunked_prefill_and_decoding_match_math(backend, dtype):
    """flex is left to the CPU test of the same cases: compiled per piece shape, DCA's many
    shapes would take minutes; its kernel is checked on CUDA above."""
    if backend is not None:
        runnable(backend, dtype)
    for got, want in dca_cases(backend, dtype=dtype, device="cuda", d=64):
        assert got.dtype == dtype
        torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_longheads_fused_matches_math(dtype):
    """Same inputs, same chunk selection: the automatic fused kernel (no gradients) against
    the math path (taken when gradients are needed); fp32 also against the CPU."""
    n, d = 37, 64
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, n, d, generator=g) for h in (4, 2, 2))
    inv = default_inv_freq(d)
    pos = torch.arange(n)
    q, k = rotate(q, pos, inv), rotate(k, pos, inv)
    algorithm = LongHeads(chunk_size=4, chunks=4)
    cpu = algorithm.attend(q, k, v, inv_freq=inv)
    q, k, v = (x.cuda().to(dtype) for x in (q, k, v))
    with torch.no_grad():
        fused = algorithm.attend(q, k, v, inv_freq=inv.cuda())
    math_path = algorithm.attend(q.clone().requires_grad_(), k, v, inv_freq=inv.cuda()).detach()
    torch.testing.assert_close(fused.float(), math_path.float(), atol=TOL[dtype], rtol=TOL[dtype])
    if dtype == torch.float32:
        torch.testing.assert_close(fused.cpu(), cpu, atol=1e-3, rtol=1e-3)


def test_patterns_keep_grouped_kv_native_under_autocast(monkeypatch):
    """Under autocast q arrives in fp32 and SDPA runs in the autocast dtype: the pieces must pass
    K/V with fewer heads as they are (an H200 found them repeated per query head in every
    recipe step, 12 KiB per token at 8B)."""
    import torch.nn.functional as F

    seen = []
    real = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention",
                        lambda q, k, v, **kw: seen.append(k.shape[1] < q.shape[1]) or real(q, k, v, **kw))
    q = torch.randn(1, 8, 256, 64, device="cuda")
    k, v = (torch.randn(1, 2, 256, 64, device="cuda") for _ in range(2))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        attn_patterns.get("s2")(q, k, v)
    assert seen and all(seen)
