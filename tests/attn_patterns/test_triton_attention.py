"""backend="triton", the block-sparse kernel, and the block layouts it runs from: every
registered pattern against the float64 dense reference (values, dQ, dK, dV) with grouped K/V,
lengths that are not a multiple of the block, shorter than one block and of one token; a
future-perturbation leak test; sequence-parallel head slices; the refusals.

Without a GPU, Triton's interpreter runs the kernel on CPU tensors (tests/conftest.py sets
TRITON_INTERPRET=1 before anything imports Triton), with 16×16 tiles and D=16 so that the
file stays fast; bf16 is checked on a GPU only (the interpreter's bf16 ``tl.dot`` is wrong)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import attn_patterns
from attn_patterns.blocks import block_layout
from attn_patterns.kernels import triton_interpreted
from attn_patterns.reference import dense_attention

from tests.attn_patterns.test_patterns import IDS, PATTERNS, SINKS, qkv

H = 8
GPU = torch.cuda.is_available() and not triton_interpreted()
DEVICE = "cuda" if GPU else "cpu"
# fp32 on the GPU runs IEEE dots (no TF32), so both devices hold fp32 to the float64 reference
FP32_TOL = 2e-5


def run(pattern, n, kv_heads, dtype, *, batch=1, seed=0, grad=True):
    """The kernel's output and gradients, and the float64 dense reference's on the same
    (dtype-rounded) inputs."""
    q, k, v = (x.to(dtype) for x in qkv(n, kv_heads, batch=batch, seed=seed))
    cot = torch.randn(q.shape, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    ours = [x.to(DEVICE).requires_grad_(grad) for x in (q, k, v)]
    ref = [x.double().requires_grad_(grad) for x in (q, k, v)]
    out = pattern(*ours, backend="triton")
    want = dense_attention(*ref, pattern.mask(n, q.shape[1]))
    got_grads = torch.autograd.grad(out, ours, cot.to(DEVICE, dtype)) if grad else ()
    want_grads = torch.autograd.grad(want, ref, cot) if grad else ()
    return (out, *got_grads), (want, *want_grads)


def assert_all_close(got, want, tol):
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert a.dtype != torch.float64 and a.shape == b.shape, name
        torch.testing.assert_close(a.cpu().double(), b, atol=tol, rtol=tol, msg=lambda m: f"{name}: {m}")


# Each pattern on one K/V grouping (1, 2 and 4 query heads per K/V head in turn), and the mixes
# whose head splits meet K/V groups (the dK/dV kernel's units) on all three. The interpreter
# runs a tile in ~8 ms, so the whole product would cost minutes for no new path.
GROUPED = [(name, params, kv_heads) for i, (name, params) in enumerate(PATTERNS) for kv_heads in (8, 4, 2)
           if kv_heads == (8, 4, 2)[i % 3] or name in ("longmixed", "mixed")]
GROUPED.append((*SINKS[5], 2))  # sink tokens on rolled and dilated heads (never compressed); sf_attn's chunked ones above


@pytest.mark.parametrize("name,params,kv_heads", GROUPED, ids=[f"{n}{p or ''}-kv{kv}" for n, p, kv in GROUPED])
def test_matches_float64_reference(name, params, kv_heads):
    """fp32 values and gradients; 37 tokens is 2 blocks and 5 rows, 9 less than one block."""
    pattern = attn_patterns.get(name, **params)
    for n in (37, 9, 1):
        got, want = run(pattern, n, kv_heads, torch.float32)
        assert_all_close(got, want, FP32_TOL)


def test_every_grouping_is_tested_on_every_kind_of_head():
    assert {kv for *_, kv in GROUPED} == {8, 4, 2} and {n for n, *_ in GROUPED} == {n for n, _ in PATTERNS}


@pytest.mark.parametrize("name,params", PATTERNS, ids=IDS)
def test_half_precision(name, params):
    pattern = attn_patterns.get(name, **params)
    got, want = run(pattern, 37, 2, torch.float16)
    assert got[0].dtype == torch.float16
    assert_all_close(got, want, 5e-3)


@pytest.mark.parametrize("name,params", PATTERNS, ids=IDS)
def test_future_tokens_never_leak(name, params):
    """Perturbing every query, key and value after t leaves outputs up to t bit-identical."""
    pattern = attn_patterns.get(name, **params)
    q, k, v = (x.float().to(DEVICE) for x in qkv(37, 4, batch=1))
    base = pattern(q, k, v, backend="triton")
    for t in (4, 17, 33):
        moved = [x.clone() for x in (q, k, v)]
        for x in moved:
            x[:, :, t + 1 :] += 3 * torch.randn_like(x[:, :, t + 1 :])
        torch.testing.assert_close(pattern(*moved, backend="triton")[:, :, : t + 1], base[:, :, : t + 1], atol=0, rtol=0)


def assert_fp32_equals_reference(pattern, q, k, v, mask):
    """The kernel in fp32 on float64 inputs' values against the float64 dense reference with
    ``mask``: output and the three gradients."""
    ours = [x.float().to(DEVICE).requires_grad_() for x in (q, k, v)]
    ref = [x.requires_grad_() for x in (q, k, v)]
    out, want = pattern(*ours, backend="triton"), dense_attention(*ref, mask)
    cot = torch.randn_like(want)
    got = (out, *torch.autograd.grad(out, ours, cot.to(DEVICE, torch.float32)))
    assert_all_close(got, (want, *torch.autograd.grad(want, ref, cot)), FP32_TOL)


def test_head_dim_that_is_no_power_of_two():
    """D=12 is zero-padded to the 16 ``tl.dot`` takes: same values and gradients."""
    pattern = attn_patterns.get("s2")
    q, k, v = (x[..., :12] for x in qkv(29, 4))
    assert_fp32_equals_reference(pattern, q, k, v, pattern.mask(29, H))


def test_transformers_layout():
    """(B, N, H, D) tensors handed over transposed (strided rows) give the contiguous result,
    and the output keeps that layout."""
    pattern = attn_patterns.get("longmixed")
    q, k, v = (x.float().to(DEVICE) for x in qkv(29, 4))
    as_hf = [x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v)]
    out = pattern(*as_hf, backend="triton")
    assert out.stride() == as_hf[0].stride()
    torch.testing.assert_close(out, pattern(q, k, v, backend="triton"), atol=0, rtol=0)


@pytest.mark.parametrize("name,offset,heads", [("longmixed", 2, 4), ("scca_flow", 4, 2), ("sda", 1, 3)])
def test_head_slices_equal_those_heads_of_the_whole_call(name, offset, heads):
    """A sequence-parallel rank's heads [offset, offset + heads) of 8 through the layout of
    pattern.heads(offset, 8), values and gradients (one K/V head per query head: a slice
    need not respect K/V groups)."""
    part = attn_patterns.get(name).heads(offset, H)
    q, k, v = (x[:, offset : offset + heads] for x in qkv(37, H))
    assert_fp32_equals_reference(part, q, k, v, part.mask(37, heads))


# --- the layout -------------------------------------------------------------------------------


def layout_mask(layout):
    """The dense visible set the layout's rows describe, and the one its block lists cover,
    in positions (tests only)."""
    heads, n = layout.num_heads, layout.n
    rows_seen = torch.zeros(heads, n, n, dtype=torch.bool)
    listed = torch.zeros(heads, n, n, dtype=torch.bool)
    full = torch.zeros(heads, n, n, dtype=torch.bool)
    bq, bk = layout.block_q, layout.block_k
    for h in range(heads):
        stride, start, rows = (int(x[h]) for x in (layout.stride, layout.start, layout.rows))
        at = lambda m: start + stride * m  # noqa: E731
        lo, hi, step = (x[h, :rows, None].long() for x in (layout.lo, layout.hi, layout.step))
        t = torch.arange(rows)[None, :]
        rows_seen[h, at(torch.arange(rows))[:, None], at(t)] = (t >= lo) & (t <= hi) & ((t - lo) % step == 0)
        rows_seen[h, :, : int(layout.sinks[h])] |= torch.ones(n, n, dtype=torch.bool).tril()[:, : int(layout.sinks[h])]
        for qb in range(-(-rows // bq)):
            m = torch.arange(qb * bq, min(rows, (qb + 1) * bq))
            for counts, indices, into in ((layout.full_counts, layout.full_indices, (listed, full)),
                                          (layout.partial_counts, layout.partial_indices, (listed,))):
                for kb in indices[h, qb, : counts[h, qb]].tolist():
                    t = torch.arange(kb * bk, min(rows, (kb + 1) * bk))
                    for grid in into:
                        grid[h, at(m)[:, None], at(t)[None, :]] = True
    return rows_seen, listed, full


def transposed(counts, indices):
    """{(head, block): sorted blocks} of one list, expanded from its runs."""
    return {(h, b): sorted(indices[h, b, : counts[h, b]].tolist())
            for h in range(counts.shape[0]) for b in range(counts.shape[1]) if counts[h, b]}


@pytest.mark.parametrize("name,params", PATTERNS, ids=IDS)
def test_layout_describes_the_mask_exactly(name, params):
    """Rows give exactly the pattern's mask and pair count; full blocks are wholly visible to
    every row, partial ones hold a visible pair, nothing visible is left out, and the
    transposed lists are the forward lists transposed. Dilated heads compress only when asked."""
    pattern = attn_patterns.get(name, **params)
    for n in (1, 13, 37, 70):
        mask = pattern.mask(n, H)
        for strided in (False, True):
            layout = block_layout(pattern, n, H, block_q=16, block_k=8, strided=strided)
            assert layout.pairs == pattern.visible_pairs(n, H) == int(mask.sum())
            rows_seen, listed, full = layout_mask(layout)
            assert torch.equal(rows_seen, mask)
            assert not (mask & ~listed).any() and not (full & ~mask).any()
            for h in range(H):
                for (qb, kb) in [(qb, kb) for (hh, qb), kbs in transposed(layout.partial_counts, layout.partial_indices).items()
                                 if hh == h for kb in kbs]:
                    m = torch.arange(qb * 16, min(int(layout.rows[h]), qb * 16 + 16))
                    t = torch.arange(kb * 8, kb * 8 + 8)
                    lo, hi, step = (x[h, m][:, None].long() for x in (layout.lo, layout.hi, layout.step))
                    sunk = t < torch.minimum(layout.sinks[h].long(), m[:, None] + 1)  # the head's sinks (uncompressed)
                    assert ((t >= lo) & (t <= hi) & ((t - lo) % step == 0) | sunk).any(), (h, qb, kb)
            for kind in ("full", "partial"):
                forward = transposed(getattr(layout, f"{kind}_counts"), getattr(layout, f"{kind}_indices"))
                backward = transposed(getattr(layout, f"{kind}_q_counts"), getattr(layout, f"{kind}_q_indices"))
                assert sorted((h, qb, kb) for (h, qb), kbs in forward.items() for kb in kbs) == \
                    sorted((h, qb, kb) for (h, kb), qbs in backward.items() for qb in qbs)
            if not strided:
                assert layout.stride.eq(1).all() and layout.start.eq(0).all() and layout.rows.eq(n).all()
    assert layout.compressed == (name in ("sda", "longmixed", "mixed"))  # each mix here holds sda heads


def test_layout_is_cached_per_pattern_and_dilated_heads_compress():
    pattern = attn_patterns.get("sda", dilation=4)
    layout = block_layout(pattern, 4096, 8, block_q=64, block_k=64, strided=True)
    assert layout is block_layout(pattern, 4096, 8, block_q=64, block_k=64, strided=True)
    assert layout.stride.tolist() == [4] * 8 and layout.start.tolist() == [0, 1, 2, 3] * 2
    assert layout.rows.tolist() == [1024] * 8 and layout.lo.shape == (8, 1024)
    # dense causal on the strided view: 16 query blocks, block b sees b full blocks and its diagonal
    assert layout.full_counts[0].tolist() == list(range(16)) and layout.partial_counts.eq(1).all()
    flat = block_layout(pattern, 4096, 8, block_q=64, block_k=64, strided=False)
    assert flat.stride.eq(1).all() and flat.stepped and flat.full_counts.sum() == 0


def test_layout_is_runs_not_blocks():
    """Causal at 16k in 16×16 blocks lists ~4M blocks per head, but one run of full blocks and
    one partial block per query block, and per key block one run of each kind: the layout
    holds O(H·N/block) numbers however dense the pattern."""
    layout = block_layout(attn_patterns.get("causal"), 16384, 2, block_q=16, block_k=16, strided=True)
    for name in ("full_runs", "partial_runs", "full_q_runs", "partial_q_runs"):
        assert getattr(layout, name).shape == (2, 1024, 1, 2), name
    assert layout.full_run_counts[0, 5] == 1 and layout.full_runs[0, 5, 0].tolist() == [0, 4]
    assert layout.partial_runs[0, 5, 0].tolist() == [5, 5] and layout.full_q_runs[0, 5, 0].tolist() == [6, 1023]
    assert layout.entries() == 2 * 1024 * 1025 // 2


# --- refusals ---------------------------------------------------------------------------------


@pytest.mark.parametrize("interpret,dtype,dim,message", [
    (None, torch.float32, 16, r"^backend='triton' cannot run here: it needs CUDA tensors \(or CPU tensors with TRITON_INTERPRET=1, "
                              r"for tests\), got device=cpu; use backend='sdpa'$"),
    ("1", torch.bfloat16, 16, r"^backend='triton' cannot run here: on cpu it takes float16, float32, got dtype=bfloat16; "),
    ("1", torch.float64, 16, r"^backend='triton' cannot run here: on cpu it takes float16, float32, got dtype=float64; "),
    ("1", torch.float32, 512, r"^backend='triton' cannot run here: it takes head dims 1..256, got 512; use backend='sdpa'$"),
])
def test_refusals_are_one_line(monkeypatch, interpret, dtype, dim, message):
    if interpret is None:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    else:
        monkeypatch.setenv("TRITON_INTERPRET", interpret)
    q = torch.zeros(1, 2, 4, dim, dtype=dtype)
    with pytest.raises(ValueError, match=message):
        attn_patterns.get("s2")(q, q, q, backend="triton")


@pytest.mark.skipif(GPU, reason="the interpreter's refusal of bf16")
def test_autocast_to_bf16_under_the_interpreter_is_refused():
    q = torch.zeros(1, 2, 4, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(ValueError, match=r"under autocast: on cpu it takes float16"):
        attn_patterns.get("causal")(q, q, q, backend="triton")


def test_rule_only_pattern_is_refused_in_one_line():
    class RuleOnly(attn_patterns.Pattern):
        name = "rule_only"

        def rule(self, h, i, j, *, n, num_heads):
            return j == 0

    with pytest.raises(ValueError, match=r"^rule_only\(\): a block layout is read from the pattern's keys progression .*flex"):
        block_layout(RuleOnly(), 8, 2, block_q=16, block_k=16, strided=True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="refused only where no GPU is")
def test_recipe_backend_triton_is_refused_before_the_model_loads(monkeypatch):
    from sparse_ft.config import load_recipe
    from sparse_ft.config.bad_input import BadInput
    from sparse_ft.train.model_setup import training_method
    from sparse_ft.train.preflight import check_model

    recipe = load_recipe("tiny", ["attention.backend=triton"])
    method = training_method(recipe)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(BadInput, match=r"^recipe key attention.backend='triton' is invalid: the block-sparse Triton kernel cannot "
                                       r"run here: it needs CUDA tensors .*; use sdpa, or auto$"):
        check_model(recipe, method)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    check_model(recipe, method)  # the interpreter takes the tiny model's float32


# --- on a GPU: the compiled kernels ---------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("name,params,kv_heads", GROUPED, ids=[f"{n}{p or ''}-kv{kv}" for n, p, kv in GROUPED])
def test_gpu_fp32_exact_at_small_and_ragged_lengths(name, params, kv_heads):
    """The compiled kernels (IEEE fp32 dots) against float64 at lengths of one token, less
    than one tile, and several ragged tiles; the K/V groupings of the CPU test, which reach
    the dK/dV kernel's summed units (a mix cutting a K/V group)."""
    pattern = attn_patterns.get(name, **params)
    for n in (1, 37, 300):
        got, want = run(pattern, n, kv_heads, torch.float32)
        assert_all_close(got, want, FP32_TOL)


def gpu_case(name, params, dtype, n=4096, heads=32, kv_heads=8, dim=128):
    """Inputs in transformers' (B, N, H, D) layout, transposed; the reference in fp32 from the
    same rounded values, its mask built on the GPU."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    make = lambda h: torch.randn(1, n, h, dim, generator=gen, device="cuda").to(dtype).transpose(1, 2)  # noqa: E731
    q, k, v = make(heads), make(kv_heads), make(kv_heads)
    pattern = attn_patterns.get(name, **params)
    ours = [x.detach().requires_grad_() for x in (q, k, v)]
    ref = [x.detach().float().requires_grad_() for x in (q, k, v)]
    out = pattern(*ours, backend="triton")
    index = [torch.arange(x, device="cuda") for x in (heads, n, n)]
    mask = pattern.visible(index[0][:, None, None], index[1][None, :, None], index[2][None, None, :], n=n, num_heads=heads)
    want = dense_attention(*ref, mask.expand(heads, n, n))
    cot = torch.randn(want.shape, generator=gen, device="cuda")
    got = (out, *torch.autograd.grad(out, ours, cot.to(dtype)))
    return got, (want, *torch.autograd.grad(want, ref, cot))


@pytest.mark.gpu
@pytest.mark.parametrize("name,params,dtype", [(n, p, torch.bfloat16) for n, p in PATTERNS] + [("longmixed", {}, torch.float16)],
                         ids=[f"{n}{p or ''}-bf16" for n, p in PATTERNS] + ["longmixed-fp16"])
def test_gpu_half_precision_at_a_realistic_shape(name, params, dtype):
    """H=32 on 8 K/V heads, D=128, N=4096, bf16 for every pattern (and fp16 once): within 2 %
    of the largest reference value anywhere (a wrong block or row would be far off) and 1 %
    in norm, for the output and the three gradients."""
    got, want = gpu_case(name, params, dtype)
    for label, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert a.dtype == dtype, label
        err = a.float() - b
        assert err.abs().max() <= 2e-2 * b.abs().max(), (label, float(err.abs().max()), float(b.abs().max()))
        assert err.norm() <= 1e-2 * b.norm(), (label, float(err.norm() / b.norm()))


@pytest.mark.parametrize("method", [["s2"], ["dca", "--method-arg", "pretraining_length=64"]])
def test_eval_refuses_triton_off_cuda_before_the_model_loads(method, tmp_path, monkeypatch, capsys):
    """A CPU user who asks for backend=triton (a pattern or DCA) hears why in one line, before
    any weights load, not at the first forward."""
    from sparse_ft.cli import main
    from sparse_ft.evaluation import loading

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(loading, "load", lambda *a, **k: pytest.fail("the model loaded before the refusal"))
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 20)
    argv = ["eval", "ppl", "--model", "tiny", "--data", str(text), "--lengths", "64", "--device", "cpu",
            "--method", *method, "--method-arg", "backend=triton"]
    assert main(argv) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]  # after the data's progress bar
    assert "backend='triton' cannot run here: it needs CUDA tensors" in last and last.endswith("or use sdpa")


def test_kernels_compile_to_ptx_as_launched():
    """The compiled form, which the interpreter never builds: every kernel launch the wrappers
    make (patterns, stepped rows, DCA's query copies, LongHeads; forward and backward; the GPU's tiles)
    compiles to sm_90 PTX (tests/attn_patterns/triton_ptx.py, in a process without the interpreter)."""
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    script = Path(__file__).with_name("triton_ptx.py")
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert ({"_fwd_kernel", "_delta_kernel", "_dq_kernel", "_dkv_kernel", "_chosen_kernel"}
            <= {line.split()[0] for line in done.stdout.splitlines()})
