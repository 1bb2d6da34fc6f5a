"""DCA's prefill in one pass of the block-sparse kernel (``backend="triton"``,
attn_patterns/dca_triton.py): the query-variant layout against the chunk distances it
encodes, values and q/k/v gradients against the float64 dense DCA reference for every
variant and ``pieces`` with grouped K/V, lengths that are not a multiple of the chunk and
shorter than one; a future-perturbation leak test; what stays on the per-chunk path
(decoding, chunks no tile divides); the backend choice and refusals; and a tiny model.

Without a GPU, Triton's interpreter runs the kernel (tests/conftest.py sets
TRITON_INTERPRET=1) with 16×16 tiles, so chunks here are 16 keys: paper s = 16 (c = 24,
w = 8) and the published code's s - w = 24 - 8 (c = 32)."""

from __future__ import annotations

import pytest
import torch

import attn_patterns
from attn_patterns import dca_triton, kernels
from attn_patterns.blocks import ChunkVariants, block_layout
from attn_patterns.dca import PIECES, VARIANTS, dca_attention
from attn_patterns.kernels import choose_lse_backend, lse_unsupported, triton_interpreted
from attn_patterns.rotary import default_inv_freq, rotate

from tests.attn_patterns.test_dca import qkv, want

GPU = torch.cuda.is_available() and not triton_interpreted()
DEVICE = "cuda" if GPU else "cpu"
SIZES = {"paper": (16, 8, 24), "chunkllama": (24, 8, 32), "qwen": (24, 8, 32)}  # (s, w, c): chunks of 16


def dca(variant: str, pieces: str = PIECES[-1], sizes: tuple[int, int, int] | None = None):
    s, w, c = sizes or SIZES[variant]
    return attn_patterns.get_algorithm("dca", chunk_size=s, local_window=w, pretraining_length=c, variant=variant,
                                       pieces=pieces)


def run(p, n, kv_heads, dtype, seed=0):
    """The triton path's output and q/k/v gradients (through the model's rotation and DCA's),
    and the float64 dense reference's on the same dtype-rounded inputs."""
    q, k, v = (x.to(dtype) for x in qkv(b=1, h=4, hkv=kv_heads, n=n, seed=seed))
    ours = [x.to(DEVICE).requires_grad_() for x in (q, k, v)]
    ref = [x.double().requires_grad_() for x in (q, k, v)]
    out = p(*ours, backend="triton")
    expected = want(p, *ref)
    cot = torch.randn(expected.shape, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    got = (out, *torch.autograd.grad(out, ours, cot.to(DEVICE, dtype)))
    return got, (expected, *torch.autograd.grad(expected, ref, cot))


def assert_all_close(got, expected, tol):
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, expected):
        assert a.dtype != torch.float64 and a.shape == b.shape, name
        torch.testing.assert_close(a.cpu().double(), b, atol=tol, rtol=tol, msg=lambda m: f"{name}: {m}")


# --- the layout ---------------------------------------------------------------------------------


def listed(layout, transposed: bool) -> dict[tuple[int, int, int], int]:
    """{(head, query block, key block): variant} of the full and partial runs."""
    kind = "_q" if transposed else ""
    found = {}
    for part in ("full", "partial"):
        runs, counts, labels = (getattr(layout, f"{part}{kind}_run{x}") for x in ("s", "_counts", "_variants"))
        for h, b in zip(*torch.nonzero(counts, as_tuple=True)):
            for r in range(int(counts[h, b])):
                first, last = runs[h, b, r].tolist()
                for other in range(first, last + 1):
                    found[(int(h), other, int(b)) if transposed else (int(h), int(b), other)] = int(labels[h, b, r])
    return found


@pytest.mark.parametrize("by_distance", [(0, 1, 2), (0, 1)])
def test_layout_variants_are_the_chunk_distance(by_distance):
    """Runs cut where the chunk distance changes class: every (query block, key block) keeps
    the blocks of the layout without variants and gets by_distance[distance], forward and
    transposed alike; still a few runs per block."""
    period, n = 32, 150
    rows = dca_triton.chunk_keys(period, False)
    variants = ChunkVariants(period, by_distance)
    layout = block_layout(rows, n, 2, block_q=16, block_k=32, strided=False, variants=variants)
    plain = block_layout(rows, n, 2, block_q=16, block_k=32, strided=False)
    forward = listed(layout, transposed=False)
    assert set(forward) == set(listed(plain, transposed=False))
    for (h, qb, kb), label in forward.items():
        distance = qb * 16 // period - kb * 32 // period
        assert label == by_distance[min(distance, len(by_distance) - 1)], (h, qb, kb)
    assert listed(layout, transposed=True) == forward
    assert layout.variants == len(by_distance) and plain.variants == 1 and plain.full_run_variants.eq(0).all()
    assert int(layout.full_run_counts.max()) <= len(by_distance)


def test_layout_refuses_blocks_across_chunks():
    with pytest.raises(ValueError, match=r"^block_layout: block_q=16 and block_k=32 must divide the variants' period 48 "):
        block_layout(dca_triton.chunk_keys(48, False), 64, 1, block_q=16, block_k=32, strided=False,
                     variants=ChunkVariants(48, (0, 1, 2)))


# --- against the float64 reference --------------------------------------------------------------

CASES = [(variant, pieces, (1, 2, 4)[(i + j) % 3]) for i, variant in enumerate(VARIANTS) for j, pieces in enumerate(PIECES)]


@pytest.mark.parametrize("variant,pieces,groups", CASES, ids=[f"{v}-{p}-gqa{g}" for v, p, g in CASES])
def test_matches_float64_reference(variant, pieces, groups):
    """fp32 values and gradients; 37 tokens are 2 chunks and 5 tokens (rows of all three
    pieces, near and far successive rows), 9 tokens less than one chunk. Each case takes one
    grouping of 4 query heads (1, 2 or 4 per K/V head), every grouping thrice."""
    for n in (37, 9):
        got, expected = run(dca(variant, pieces), n, 4 // groups, torch.float32)
        assert_all_close(got, expected, 2e-5)


@pytest.mark.parametrize("variant", VARIANTS)
def test_half_precision(variant):
    got, expected = run(dca(variant), 37, 2, torch.float16)
    assert got[0].dtype == torch.float16
    assert_all_close(got, expected, 5e-3)


@pytest.mark.parametrize("pieces", PIECES[1:])
def test_future_tokens_never_leak(pieces):
    """Perturbing every query, key and value after t leaves outputs up to t bit-identical."""
    p = dca("paper", pieces)
    q, k, v = (x.to(DEVICE) for x in qkv(b=1, h=4, hkv=2, n=37))
    base = p(q, k, v, backend="triton")
    for t in (5, 20):
        moved = [x.clone() for x in (q, k, v)]
        for x in moved:
            x[:, :, t + 1 :] += 3 * torch.randn_like(x[:, :, t + 1 :])
        torch.testing.assert_close(p(*moved, backend="triton")[:, :, : t + 1], base[:, :, : t + 1], atol=0, rtol=0)


# --- what stays on the per-chunk path ----------------------------------------------------------


def test_prefill_is_one_pass_and_the_rest_takes_the_loop(monkeypatch):
    """A prefill runs no per-chunk piece; decoding (Nq < Nk) and chunks of 24 keys (no tile of
    16 or more divides them) never reach the one-pass kernel and equal the math backend."""
    q, k, v = (x.to(DEVICE) for x in qkv(b=1, h=4, hkv=2, n=37))
    inv = default_inv_freq(16).to(DEVICE)
    pos = torch.arange(37, device=DEVICE)
    q, k = rotate(q, pos, inv), rotate(k, pos, inv)
    paper = dict(inv_freq=inv, chunk_size=16, local_window=8, pretraining_length=24)
    one_pass = dca_attention(q, k, v, **paper, backend="math")

    def no_piece(*args, **kwargs):
        raise AssertionError("a per-chunk piece ran")

    with monkeypatch.context() as m:
        m.setattr(attn_patterns.dca, "attend_lse", no_piece)
        torch.testing.assert_close(dca_attention(q, k, v, **paper, backend="triton"), one_pass, atol=1e-5, rtol=1e-5)

    def no_pass(*args, **kwargs):
        raise AssertionError("the one-pass kernel ran")

    monkeypatch.setattr(dca_triton, "dca_prefill", no_pass)
    for tail in (1, 5):
        torch.testing.assert_close(dca_attention(q[:, :, -tail:], k, v, **paper, backend="triton"), one_pass[:, :, -tail:],
                                   atol=1e-5, rtol=1e-5)
    untileable = dict(inv_freq=inv, chunk_size=24, local_window=8, pretraining_length=32)
    assert not dca_triton.takes(24, own_chunk=False) and dca_triton.takes(24, own_chunk=True)
    torch.testing.assert_close(dca_attention(q, k, v, **untileable, backend="triton"),
                               dca_attention(q, k, v, **untileable, backend="math"), atol=1e-5, rtol=1e-5)


# --- the backend choice -------------------------------------------------------------------------


def choice(device, *, block_sparse, needs_grad=False, flash_attn=True):
    return choose_lse_backend(device=device, dtype=torch.bfloat16, needs_grad=needs_grad,
                              capability=(9, 0) if device == "cuda" else None, flash_attn=flash_attn, head_dim=128,
                              block_sparse=block_sparse)


def test_automatic_choice_is_triton_for_a_cuda_prefill(monkeypatch):
    """On CUDA the one-pass kernel where the call has one (DCA's prefill), gradients or not;
    decoding, LongHeads and every CPU call choose as before; without Triton, as before."""
    assert choice("cuda", block_sparse=True) == choice("cuda", block_sparse=True, needs_grad=True) == "triton"
    assert choice("cuda", block_sparse=False) == "flash" and choice("cuda", block_sparse=False, needs_grad=True) == "math"
    assert choice("cpu", block_sparse=True) == choice("cpu", block_sparse=False) == "sdpa"
    case = dict(device="cuda", dtype=torch.bfloat16, needs_grad=False, capability=(9, 0), flash_attn=False, head_dim=128)
    assert "runs no such call" in lse_unsupported("triton", **case)
    monkeypatch.setattr(kernels, "triton_unsupported", lambda *args: "the triton package is not installed")
    assert choice("cuda", block_sparse=True) == "flash"


def test_triton_outside_the_interpreter_is_refused_in_one_line(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q = torch.zeros(1, 2, 4, 16)
    with pytest.raises(ValueError, match=r"^dca: backend='triton' cannot run here: it needs CUDA tensors \(or CPU tensors with "
                                         r"TRITON_INTERPRET=1, for tests\), got device=cpu; allowed here: sdpa, flex, math or "
                                         r"None \(automatic\)$"):
        dca("paper")(q, q, q, backend="triton")


@pytest.mark.skipif(GPU, reason="the interpreter runs CPU tensors")
def test_model_with_backend_triton_equals_the_default():
    """A tiny GQA Llama (one layer, c = 64, chunks of 16 as a recipe's attention.params may
    set them) over 40 tokens with ``backend=triton`` as a recipe or ``--method-arg`` gives it,
    against the automatic backend; then a cached one-token step (the per-chunk path) against
    the prefill's last row."""
    from transformers import DynamicCache

    from sparse_ft import use_attention
    from sparse_ft.modeling.tiny import tiny_llama

    model = tiny_llama(max_position_embeddings=64, num_hidden_layers=1)
    ids = torch.randint(3, 300, (1, 40), generator=torch.Generator().manual_seed(1))
    sizes = dict(chunk_size=16, local_window=8)
    use_attention(model, "dca", **sizes)
    with torch.no_grad():
        expected = model(input_ids=ids).logits
        use_attention(model, "dca", **sizes, backend="triton")
        torch.testing.assert_close(model(input_ids=ids).logits, expected, atol=1e-5, rtol=1e-5)
        cache = DynamicCache(config=model.config)
        model(input_ids=ids[:, :39], past_key_values=cache, use_cache=True)
        step = model(input_ids=ids[:, 39:], past_key_values=cache, use_cache=True).logits
    torch.testing.assert_close(step, expected[:, 39:], atol=1e-5, rtol=1e-5)


# --- on a GPU: the compiled kernels -------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_bf16_at_a_realistic_shape():
    """H=32 on 8 K/V heads, D=128, N=8192 with c=4096 (paper: chunks of 3072, all three
    pieces): the automatic backend is the one-pass kernel, and its bf16 output and q/k/v
    gradients are within 2 % of the largest value and 1 % in norm of the per-chunk math path
    in fp32 on the same rounded inputs."""
    n, c = 8192, 4096
    gen = torch.Generator(device="cuda").manual_seed(0)
    make = lambda h: torch.randn(1, n, h, 128, generator=gen, device="cuda").bfloat16().transpose(1, 2)  # noqa: E731
    q, k, v = make(32), make(8), make(8)
    inv = default_inv_freq(128).cuda()
    pos = torch.arange(n, device="cuda")
    q, k = rotate(q, pos, inv), rotate(k, pos, inv)
    p = attn_patterns.get_algorithm("dca", pretraining_length=c)
    s, w, _ = p.sizes()
    sizes = dict(inv_freq=inv, chunk_size=s, local_window=w, pretraining_length=c, scale=p.scale(n, 128))
    assert kernels.lse_backend(None, q, k, v, owner="dca", block_sparse=True) == "triton"
    ours = [x.detach().requires_grad_() for x in (q, k, v)]
    ref = [x.detach().float().requires_grad_() for x in (q, k, v)]
    out = dca_attention(*ours, **sizes)
    expected = dca_attention(*ref, **sizes, backend="math")
    cot = torch.randn(expected.shape, generator=gen, device="cuda")
    got = (out, *torch.autograd.grad(out, ours, cot.bfloat16()))
    wanted = (expected, *torch.autograd.grad(expected, ref, cot))
    for label, a, b in zip(("out", "dq", "dk", "dv"), got, wanted):
        assert a.dtype == torch.bfloat16, label
        err = a.float() - b
        assert err.abs().max() <= 2e-2 * b.abs().max(), (label, float(err.abs().max()), float(b.abs().max()))
        assert err.norm() <= 1e-2 * b.norm(), (label, float(err.norm() / b.norm()))
