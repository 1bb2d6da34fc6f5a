"""LongHeads' attention over the chosen chunks in one Triton kernel (``backend="triton"``,
attn_patterns/longheads_triton.py): equal to the torch path and to the per-query reference of
tests/attn_patterns/test_longheads.py in fp32 and fp16, with GQA 1/2/4, ``keep_previous`` both ways, lengths
that are not a multiple of the chunk, a call's last rows (decoding, chunked prefill) in steps
that start inside chunks, chunks no tile divides, partial rotary and no RoPE; a
future-perturbation leak test; the refusals; bf16 on a GPU.

Without a GPU, Triton's interpreter runs the kernel (tests/conftest.py sets TRITON_INTERPRET=1)
with 16×16 tiles, so chunks are 16 keys (24 in one case) and sequences about 100-150 tokens."""

from __future__ import annotations

import pytest
import torch

from tests.attn_patterns import test_longheads
from attn_patterns import longheads
from attn_patterns.kernels import triton_interpreted
from attn_patterns.longheads import LongHeads
from attn_patterns.rotary import default_inv_freq, rotate
from sparse_ft import use_attention
from sparse_ft.modeling.tiny import tiny_llama

GPU = torch.cuda.is_available() and not triton_interpreted()
DEVICE = "cuda" if GPU else "cpu"


def rotated(n, *, b, h, hkv, d, inv_freq, dtype, seed=0):
    """q, k rotated at positions 0..n-1 and v, in ``dtype``, and the same before RoPE (for the
    reference, which rotates itself)."""
    q_raw, k_raw, v = test_longheads._qkv(n, b=b, h=h, hkv=hkv, d=d, seed=seed)
    q_raw, k_raw, v = (x.to(dtype) for x in (q_raw, k_raw, v))
    pos = torch.arange(n)
    q, k = (x if inv_freq is None else rotate(x, pos, inv_freq) for x in (q_raw, k_raw))
    return (q, k, v), (q_raw, k_raw, v)


def no_torch_step(*args, **kwargs):
    raise AssertionError("attend_chosen ran: the triton path must replace it")


# (dtype, head dim, rotated dims, chunk size, k, keep_previous, groups, batch, length)
CASES = [
    (torch.float32, 16, 16, 16, 3, True, 1, 2, 100),
    (torch.float32, 32, 32, 16, 4, False, 2, 1, 125),
    (torch.float32, 16, 16, 16, 4, True, 4, 1, 131),
    (torch.float32, 24, 16, 24, 3, True, 2, 1, 100),  # chunks of 24: row blocks straddle chunks; partial rotary
    (torch.float16, 32, 32, 16, 3, False, 2, 1, 120),
    (torch.float16, 16, 16, 16, 4, True, 4, 2, 96),
]


@pytest.mark.parametrize("dtype,d,rotary,l,k_chunks,keep_previous,groups,b,n", CASES,
                         ids=[f"{str(c[0])[6:]}-d{c[1]}-l{c[3]}-k{c[4]}-{'prev' if c[5] else 'paper'}-gqa{c[6]}-b{c[7]}-n{c[8]}"
                              for c in CASES])
def test_matches_torch_path_and_reference(dtype, d, rotary, l, k_chunks, keep_previous, groups, b, n, monkeypatch):
    """Whole sequences: the kernel against the torch path (sdpa) on the same inputs, and against
    the float64 per-query reference on the same rounded inputs (fp32: float noise; fp16: the
    kernel rounds its rotated queries and probabilities to fp16, as the torch path does)."""
    inv = default_inv_freq(rotary)
    h = 4 if groups > 1 else 2
    (q, k, v), raw = rotated(n, b=b, h=h, hkv=h // groups, d=d, inv_freq=inv, dtype=dtype, seed=n)
    algorithm = LongHeads(chunk_size=l, chunks=k_chunks, keep_previous=keep_previous)
    torch_path = algorithm.attend(q, k, v, inv_freq=inv, backend="sdpa")
    monkeypatch.setattr(longheads, "attend_chosen", no_torch_step)
    out = algorithm.attend(*(x.to(DEVICE) for x in (q, k, v)), inv_freq=inv.to(DEVICE), backend="triton").cpu()
    monkeypatch.setattr(test_longheads, "INV_FREQ", inv)
    expected = test_longheads.reference(*(x.double() for x in raw), l, k_chunks, keep_previous)
    tol = 2e-5 if dtype == torch.float32 else 4e-3
    assert out.dtype == dtype
    torch.testing.assert_close(out, torch_path, atol=tol, rtol=tol)
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("keep_previous,inv", [(True, default_inv_freq(16)), (False, None)], ids=["prev-rope", "paper-nope"])
def test_last_rows_in_small_steps(keep_previous, inv, monkeypatch):
    """A call's last Nq rows (chunked prefill, decoding) in steps of about 9 rows that start and
    end inside chunks, so a block's rows sit in two chunks; with RoPE and without (a model
    without it)."""
    l, k_chunks, n = 16, 3, 90
    monkeypatch.setattr(longheads, "_BLOCK_ELEMENTS", 5300)  # steps of 9 rows (49-64, 64-73, 73-82, 82-90 for Nq = 41)
    (q, k, v), _ = rotated(n, b=1, h=2, hkv=1, d=16, inv_freq=inv, dtype=torch.float32, seed=5)
    whole = (n - 1) // l * l
    reps = longheads.chunk_representations(q[:, :, :whole], k[:, :, :whole], v[:, :, :whole], chunk_size=l,
                                           first_chunk=0, inv_freq=inv)
    case = dict(reps=reps, chunk_size=l, chunks=k_chunks, inv_freq=inv, scale=0.25, keep_previous=keep_previous)
    for nq in (41, 1):
        expected = longheads.longheads_attention(q[:, :, n - nq :], k, v, **case, backend="math")
        out = longheads.longheads_attention(q[:, :, n - nq :], k, v, **case, backend="triton")
        torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)


def test_future_tokens_never_leak():
    """Perturbing every query, key and value after t leaves outputs up to t bit-identical."""
    algorithm = LongHeads(chunk_size=16, chunks=3)
    inv = default_inv_freq(16)
    (q, k, v), _ = rotated(100, b=1, h=2, hkv=1, d=16, inv_freq=inv, dtype=torch.float32)
    base = algorithm.attend(q, k, v, inv_freq=inv, backend="triton")
    for t in (57, 88):
        moved = [x.clone() for x in (q, k, v)]
        for x in moved:
            x[:, :, t + 1 :] += 3 * torch.randn_like(x[:, :, t + 1 :])
        out = algorithm.attend(*moved, inv_freq=inv, backend="triton")
        torch.testing.assert_close(out[:, :, : t + 1], base[:, :, : t + 1], atol=0, rtol=0)
        assert not torch.allclose(out[:, :, t + 1 :], base[:, :, t + 1 :])


@pytest.mark.skipif(GPU, reason="the interpreter runs CPU tensors")
def test_model_with_backend_triton_equals_the_default():
    """The method's ``backend`` (``--method-arg backend=triton``) reaches the kernel: a tiny
    Llama past its window of 3 chunks of 16 gives the torch path's logits."""
    model = tiny_llama()
    ids = torch.randint(3, 259, (1, 80), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        use_attention(model, "longheads", chunk_size=16, chunks=3)
        want = model(ids).logits
        use_attention(model, "longheads", chunk_size=16, chunks=3, backend="triton")
        got = model(ids).logits
    use_attention(model, "full")
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match=r"^longheads: backend='cuda' is unknown; allowed: sdpa, "):
        LongHeads(chunk_size=16, chunks=3, backend="cuda")


def test_refusals_are_one_line(monkeypatch):
    algorithm = LongHeads(chunk_size=16, chunks=3)
    inv = default_inv_freq(16)
    q = torch.zeros(1, 2, 64, 16)
    with pytest.raises(ValueError, match=r"^longheads: backend='triton' runs the forward only \(LongHeads is training-free\), "
                                         r"got inputs that require grad; run under torch.no_grad\(\) or use backend='sdpa' or "
                                         r"'math'$"):
        algorithm.attend(q.clone().requires_grad_(), q, q, inv_freq=inv, backend="triton")
    if GPU:
        return
    with pytest.raises(ValueError, match=r"^longheads: backend='triton' cannot run here: on cpu it takes float16, float32, "
                                         r"got dtype=bfloat16; allowed here: "):
        algorithm.attend(*(q.bfloat16(),) * 3, inv_freq=inv, backend="triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match=r"^longheads: backend='triton' cannot run here: it needs CUDA tensors \(or CPU "
                                         r"tensors with TRITON_INTERPRET=1, for tests\), got device=cpu; allowed here: "):
        algorithm.attend(q, q, q, inv_freq=inv, backend="triton")


@pytest.mark.gpu
def test_gpu_bf16_at_a_realistic_shape():
    """H=32 on 8 K/V heads, D=128, N=8192, l=256, k=8 (window 2048): the kernel's bf16 output
    within 2 % of the largest value and 1 % in norm of the torch path on the same bf16 inputs
    (same selection: the selection runs before either)."""
    n, inv = 8192, default_inv_freq(128).cuda()
    gen = torch.Generator(device="cuda").manual_seed(0)
    make = lambda h: torch.randn(1, n, h, 128, generator=gen, device="cuda").bfloat16().transpose(1, 2)  # noqa: E731
    pos = torch.arange(n, device="cuda")
    q, k, v = rotate(make(32), pos, inv), rotate(make(8), pos, inv), make(8)
    algorithm = LongHeads(chunk_size=256, chunks=8)
    with torch.no_grad():
        out = algorithm.attend(q, k, v, inv_freq=inv, backend="triton")
        expected = algorithm.attend(q, k, v, inv_freq=inv).float()
    err = out.float() - expected
    assert out.dtype == torch.bfloat16
    assert err.abs().max() <= 2e-2 * expected.abs().max(), float(err.abs().max())
    assert err.norm() <= 1e-2 * expected.norm(), float(err.norm() / expected.norm())
