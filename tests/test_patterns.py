"""Every pattern against the dense masked reference, the rule against hand-checked sets, and
future-token perturbation for leaks."""

import pytest
import torch

import attn_patterns
from attn_patterns.reference import dense_attention

H = 8
PATTERNS = [
    ("full", {}),
    ("s2", {}),
    ("s2", {"chunks": 3}),
    ("scca_fixed", {}),
    ("scca_fixed", {"chunks": 5}),
    ("scca_flow", {}),
    ("scca_flow", {"chunks": 2}),
    ("sda", {"dilation": 2}),
    ("sda", {"dilation": 3}),
    ("longmixed", {}),
    ("mixed", {"parts": [("s2", 0.5), ({"name": "sda", "dilation": 4}, 0.25), ("full", 0.25)]}),
]
IDS = [f"{name}{params or ''}" for name, params in PATTERNS]
# N not divisible by chunks, odd w (N=13 -> w=4, N=9 -> w=3), N < chunks, N = 1.
LENGTHS = [1, 3, 9, 13, 16, 37]


def qkv(n, kv_heads, dtype=torch.float64, batch=2, dim=16, grad=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(batch, H, n, dim), (batch, kv_heads, n, dim), (batch, kv_heads, n, dim)]
    return [torch.randn(s, generator=gen, dtype=dtype).requires_grad_(grad) for s in shapes]


def test_every_registered_pattern_is_covered():
    assert {name for name, _ in PATTERNS} >= {"full", "s2", "scca_fixed", "scca_flow", "sda", "longmixed", "mixed"}


@pytest.mark.parametrize("name,params", PATTERNS, ids=IDS)
@pytest.mark.parametrize("kv_heads", [8, 4, 2])
def test_matches_dense_reference_values_and_gradients(name, params, kv_heads):
    pattern = attn_patterns.get(name, **params)
    for n in LENGTHS:
        q, k, v = qkv(n, kv_heads, grad=True)
        mask = pattern.mask(n, H)
        out, ref = pattern(q, k, v), dense_attention(q, k, v, mask)
        torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)
        cot = torch.randn_like(out)
        got = torch.autograd.grad(out, (q, k, v), cot)
        want = torch.autograd.grad(ref, (q, k, v), cot)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)
        assert pattern.visible_pairs(n, H) == int(mask.sum())


@pytest.mark.parametrize("name,params", PATTERNS, ids=IDS)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2), (torch.float16, 3e-3)])
def test_low_precision_close_to_fp32_reference(name, params, dtype, tol):
    pattern = attn_patterns.get(name, **params)
    q, k, v = qkv(37, 2, dtype=dtype, dim=32)
    out = pattern(q, k, v)
    assert out.dtype == dtype and torch.isfinite(out).all()
    ref = dense_attention(q.float(), k.float(), v.float(), pattern.mask(37, H))
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("name,params", PATTERNS, ids=IDS)
def test_future_tokens_never_leak(name, params):
    """Perturb keys/values after position t: no output at or before t may change, in any head
    (rolled keys wrapping around the sequence end would show up here)."""
    pattern = attn_patterns.get(name, **params)
    n = 37
    q, k, v = qkv(n, 4)
    base = pattern(q, k, v)
    for t in (0, 5, 18, 30, 35):
        k2, v2 = k.clone(), v.clone()
        k2[:, :, t + 1 :] += 3 * torch.randn_like(k2[:, :, t + 1 :])
        v2[:, :, t + 1 :] += 3 * torch.randn_like(v2[:, :, t + 1 :])
        torch.testing.assert_close(pattern(q, k2, v2)[:, :, : t + 1], base[:, :, : t + 1], atol=0, rtol=0)


def visible_sets(name, n, heads=H, **params):
    mask = attn_patterns.get(name, **params).mask(n, heads)
    return [[set(torch.nonzero(mask[h, i]).flatten().tolist()) for i in range(n)] for h in range(heads)]


def test_s2_semantics_by_hand():
    # N=8, chunks=4: w=2, g=1. Unshifted heads: chunks {0,1},{2,3},...
    sets = visible_sets("s2", 8)
    assert sets[0][3] == {2, 3} and sets[0][4] == {4}
    # Shifted heads: chunks {0}, {1,2}, {3,4}, {5,6}, {7}: partial ends, no wrap-around.
    assert sets[4][0] == {0} and sets[4][2] == {1, 2} and sets[4][4] == {3, 4} and sets[4][7] == {7}


def test_scca_fixed_semantics_by_hand():
    # N=16, chunks=4: w=4, g=2. Rolled heads: chunk c sees [4c-2, 4c+2) ∩ j<=i.
    sets = visible_sets("scca_fixed", 16)
    assert sets[0][0] == {0} and sets[0][3] == {0, 1}  # chunk 0: [0, 2), never the wrapped tail
    assert sets[0][4] == {2, 3, 4} and sets[0][7] == {2, 3, 4, 5}
    assert sets[7][7] == {4, 5, 6, 7}  # plain heads: own chunk
    # Odd w (N=9, chunks=3: w=3, g=1): (j+g)//w == c gives the window [3c-1, 3c+2).
    odd = visible_sets("scca_fixed", 9, chunks=3)
    assert odd[0][3] == {2, 3} and odd[0][5] == {2, 3, 4} and odd[0][8] == {5, 6, 7}


def test_scca_flow_semantics_by_hand():
    # N=16, chunks=4, 8 heads: groups of 2 heads look back 0, 1, 2, 3 chunks.
    sets = visible_sets("scca_flow", 16)
    assert sets[0][13] == {12, 13}
    assert sets[2][13] == {8, 9, 10, 11} and sets[2][2] == {0, 1, 2}  # chunk 0 < lag: own chunk
    assert sets[4][13] == {4, 5, 6, 7} and sets[4][6] == {4, 5, 6}
    assert sets[6][13] == {0, 1, 2, 3} and sets[6][10] == {8, 9, 10}
    # Across the heads, a query reaches every earlier token within `chunks` chunks.
    union = set().union(*(sets[h][15] for h in range(H)))
    assert union == set(range(16))


def test_sda_semantics_by_hand():
    sets = visible_sets("sda", 9, dilation=3)
    assert sets[0][6] == {0, 3, 6} and sets[1][7] == {1, 4, 7} and sets[5][8] == {2, 5, 8}
    assert sets[0][7] == set()  # offset 0 head: query 7 ≢ 0 (mod 3) gets nothing...
    q, k, v = qkv(9, 8)
    out = attn_patterns.get("sda", dilation=3)(q, k, v)
    assert out[:, 0, 7].abs().max() == 0  # ...and outputs exactly 0


def test_longmixed_head_layout():
    sets = visible_sets("longmixed", 16)
    rolled, plain, sda2, sda4 = sets[0], sets[1], sets[2], sets[4]
    assert rolled[7] == {2, 3, 4, 5} and plain[7] == {4, 5, 6, 7}
    assert sda2[6] == {0, 2, 4, 6} and sets[3][7] == {1, 3, 5, 7}
    assert sda4[12] == {0, 4, 8, 12} and sets[7][15] == {3, 7, 11, 15}


def test_flex_backend_inference_equals_sdpa():
    q, k, v = qkv(37, 2, dtype=torch.float32)
    for name, params in PATTERNS:
        pattern = attn_patterns.get(name, **params)
        with torch.no_grad():
            torch.testing.assert_close(pattern(q, k, v, backend="flex"), pattern(q, k, v), atol=1e-5, rtol=1e-5)


def test_flex_refuses_cpu_training_and_flash_needs_cuda():
    q, k, v = qkv(8, 8, dtype=torch.float32, grad=True)
    with pytest.raises(ValueError, match="no backward on CPU"):
        attn_patterns.get("s2")(q, k, v, backend="flex")
    with pytest.raises(ValueError, match="flash-attn package and CUDA"):
        attn_patterns.get("s2")(q, k, v, backend="flash")
    with pytest.raises(ValueError, match="backend='xla' is unknown"):
        attn_patterns.get("s2")(q, k, v, backend="xla")


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda: attn_patterns.get("scca"), r"pattern='scca' is unknown; allowed: full, .*scca_flow"),
        (lambda: attn_patterns.get("s2", chunks=0), r"chunks=0 must be an integer >= 1"),
        (lambda: attn_patterns.get("sda", dilation=0), r"dilation=0 must be an integer >= 1"),
        (lambda: attn_patterns.get("s2", dilation=2), r"dilation unknown; allowed: chunks, backend"),
        (lambda: attn_patterns.get("mixed", parts=[("s2", 0.5)]), r"shares=\[0.5\] must sum to 1"),
        (lambda: attn_patterns.get("s2").mask(8, 7), r"num_heads=7 gives 3.5 heads"),
        (lambda: attn_patterns.get("scca_flow", chunks=3).mask(8, 8), r"num_heads=8 gives 2.66667 heads"),
        (lambda: attn_patterns.get("longmixed").mask(8, 4), r"longmixed: num_heads=4 gives 1 heads to scca_fixed"),
    ],
)
def test_bad_parameters_name_the_rule(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_shape_errors():
    q, k, v = qkv(8, 3)
    with pytest.raises(ValueError, match="num_heads=8 must be a multiple of kv_heads=3"):
        attn_patterns.get("full")(q, k, v)
    with pytest.raises(ValueError, match="must be 4-D"):
        attn_patterns.get("full")(q[0], k[0], v[0])


def test_long_sequence_memory_is_linear():
    """The sparse path never allocates an N×N tensor: at N=4096 an fp32 N×N score matrix per
    head would be 64 MiB; the pattern's largest allocation stays far below it."""
    n = 4096
    q, k, v = qkv(n, 8, dtype=torch.float32, batch=1, dim=32)
    pattern = attn_patterns.get("scca_flow", chunks=8)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        pattern(q, k, v)
    biggest = max(e.cpu_memory_usage for e in prof.key_averages())
    assert biggest < n * n * 4, biggest
