"""Every pattern against the dense masked reference, the rule against hand-checked sets, and
future-token perturbation for leaks."""

import pytest
import torch

import attn_patterns
from attn_patterns.reference import dense_attention

H = 8
PATTERNS = [
    ("causal", {}),
    ("s2", {}),
    ("s2", {"chunks": 3}),
    ("scca_fixed", {}),
    ("scca_fixed", {"chunks": 5}),
    ("scca_flow", {}),
    ("scca_flow", {"chunks": 2}),
    ("sda", {"dilation": 2}),
    ("sda", {"dilation": 3}),
    ("longmixed", {}),
    ("mixed", {"parts": [("s2", 0.5), ({"name": "sda", "dilation": 4}, 0.25), ("causal", 0.25)]}),
    # 3 + 5 heads: on 2 or 4 KV heads the split cuts through a KV group (K/V repeated there)
    ("mixed", {"parts": [({"name": "sda", "dilation": 3}, 0.375), ("causal", 0.625)]}),
    ("sf_attn", {}),  # 4 sink tokens: every backend's sink path, in every test of this list
]
IDS = [f"{name}{params or ''}" for name, params in PATTERNS]
# sink_tokens on every other kind of head (chunked, shifted, rolled, lagged, dilated, a mix whose
# parts bring sinks of their own), including sinks past a chunk (scca_flow at N=13: w=4), which
# the fast path computes exactly though a recipe refuses them
SINKS = [
    ("causal", {"sink_tokens": 2}),
    ("s2", {"chunks": 3, "sink_tokens": 1}),
    ("scca_fixed", {"chunks": 5, "sink_tokens": 2}),
    ("scca_flow", {"sink_tokens": 5}),
    ("sda", {"dilation": 3, "sink_tokens": 2}),
    ("longmixed", {"sink_tokens": 3}),
    ("mixed", {"parts": [("s2", 0.5), ({"name": "sda", "dilation": 4, "sink_tokens": 3}, 0.25), ("causal", 0.25)],
               "sink_tokens": 1}),
    ("sf_attn", {"shifted": 0.25, "shift": 0.25, "sink_tokens": 2}),
]
SINK_IDS = [f"{name}{params}" for name, params in SINKS]
# N not divisible by chunks, odd w (N=13 -> w=4, N=9 -> w=3), N < chunks, N = 1.
LENGTHS = [1, 3, 9, 13, 16, 37]


def qkv(n, kv_heads, dtype=torch.float64, batch=2, dim=16, grad=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(batch, H, n, dim), (batch, kv_heads, n, dim), (batch, kv_heads, n, dim)]
    return [torch.randn(s, generator=gen, dtype=dtype).requires_grad_(grad) for s in shapes]


def test_every_registered_pattern_is_covered():
    """A newly registered pattern fails here until PATTERNS holds it (test_triton_attention.py
    and scripts/sdpa_views.py run this list too)."""
    assert set(attn_patterns.names()) <= {name for name, _ in PATTERNS}


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
@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 3e-2), (torch.float16, 3e-3)])
def test_under_autocast_with_the_inputs_a_half_precision_model_gives(name, params, dtype, tol):
    """Training without DeepSpeed runs the forward under autocast over fp32 masters: RoPE hands
    q and k over in fp32 (the hidden states are), v comes from a projection in half precision,
    and the kernel answers in half precision. (sda once scattered that answer into a tensor of
    q's dtype and crashed; so did longmixed, which holds sda heads.)"""
    pattern = attn_patterns.get(name, **params)
    q, k, v = qkv(37, 2, dtype=torch.float32, dim=32)
    v = v.to(dtype)
    with torch.autocast("cpu", dtype=dtype):
        out = pattern(q, k, v)
    assert torch.isfinite(out).all()
    ref = dense_attention(q.to(dtype).float(), k.to(dtype).float(), v.float(), pattern.mask(37, H))
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("name,params", SINKS, ids=SINK_IDS)
def test_sink_tokens_match_dense_reference_values_and_gradients(name, params):
    """Every query also sees the first k keys, intersected with causality, and no key twice
    (grouped K/V; a length inside the sinks, one with partial chunks)."""
    pattern = attn_patterns.get(name, **params)
    for n in (3, 37):
        q, k, v = qkv(n, 2, grad=True)
        mask = pattern.mask(n, H)
        out, ref = pattern(q, k, v), dense_attention(q, k, v, mask)
        torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)
        cot = torch.randn_like(out)
        for a, b in zip(torch.autograd.grad(out, (q, k, v), cot), torch.autograd.grad(ref, (q, k, v), cot)):
            torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)
        assert pattern.visible_pairs(n, H) == int(mask.sum())
    for h, sink in enumerate(pattern.sinks(torch.arange(H), H).tolist()):
        assert sink and mask[h, :, :sink].equal(torch.ones(37, sink, dtype=torch.bool).tril())


@pytest.mark.parametrize("name,params", SINKS[5:6], ids=SINK_IDS[5:6])
def test_sink_tokens_never_leak_future_tokens(name, params):
    """Rolled and dilated heads with sinks (sf_attn's chunked and shifted ones are in PATTERNS)."""
    test_future_tokens_never_leak(name, params)


@pytest.mark.parametrize("name,params", PATTERNS, ids=IDS)
def test_future_tokens_never_leak(name, params):
    """Perturb keys/values after position t: no output at or before t may change, in any head
    (rolled keys wrapping around the sequence end would show up here)."""
    pattern = attn_patterns.get(name, **params)
    n = 37
    q, k, v = qkv(n, 4)
    base = pattern(q, k, v)
    for t in (0, 5, 18, 30, 35):
        q2, k2, v2 = q.clone(), k.clone(), v.clone()
        for x in (q2, k2, v2):  # future queries too: padded or folded rows must not mix in
            x[:, :, t + 1 :] += 3 * torch.randn_like(x[:, :, t + 1 :])
        torch.testing.assert_close(pattern(q2, k2, v2)[:, :, : t + 1], base[:, :, : t + 1], atol=0, rtol=0)


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


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_backend_inference_equals_sdpa():
    q, k, v = qkv(37, 2, dtype=torch.float32)
    one_per_name = {name: params for name, params in reversed(PATTERNS)}  # flex on CPU is slow to set up
    for name, params in one_per_name.items():
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
        (lambda: attn_patterns.get("scca"), r"pattern='scca' is unknown; allowed: causal, .*scca_flow"),
        (lambda: attn_patterns.get("s2", chunks=0), r"chunks=0 must be an integer >= 1"),
        (lambda: attn_patterns.get("sda", dilation=0), r"dilation=0 must be an integer >= 1"),
        (lambda: attn_patterns.get("s2", backend="cuda"), r"s2: backend='cuda' is unknown; allowed: sdpa, flash, flex"),
        (lambda: attn_patterns.get("s2", dilation=2), r"dilation unknown; allowed: chunks, backend"),
        (lambda: attn_patterns.get("mixed", parts=[("s2", 0.5)]), r"shares=\[0.5\] must sum to 1"),
        (lambda: attn_patterns.get("s2").mask(8, 7), r"s2: num_heads=7 must be divisible by 2 \(half the heads"),
        (lambda: attn_patterns.get("scca_flow", chunks=3).mask(8, 8), r"scca_flow: num_heads=8 must be divisible by 3 \(one group"),
        (lambda: attn_patterns.get("longmixed").mask(8, 4), r"longmixed: num_heads=4 must be divisible by 8 \(heads split"),
        (lambda: attn_patterns.get("mixed", parts=[("sda", 0.25), ("s2", 0.75)]).mask(8, 6), r"num_heads=6 gives 1.5 heads to sda"),
        (lambda: attn_patterns.get("mixed", parts=[("sda", 0.25), ("s2", 0.75)]).mask(8, 4),
         r"num_heads=4 gives 3 heads to s2: num_heads=3 must be divisible by 2"),
        (lambda: attn_patterns.get("mixed", parts=[("sda", 1.5)]), r"share=1.5 of 'sda' must be a number in \(0, 1\]"),
        (lambda: attn_patterns.get("mixed", parts=[("nope", 1.0)]), r"pattern='nope' is unknown"),
        (lambda: attn_patterns.get("mixed"), r"mixed: parameter\(s\) parts required \(it has no default\)"),
        (lambda: attn_patterns.get("sda", sink_tokens=1.5), r"^sda: sink_tokens=1.5 must be an integer >= 0$"),
        (lambda: attn_patterns.get("s2", sink_tokens=4).check_length(16),
         r"^s2\(chunks=4, sink_tokens=4\): sink_tokens=4 must be in \[0, 4\) at sequence length 16 \(below the chunk width 4\)"),
        (lambda: attn_patterns.get("sf_attn", shifted=1), r"^sf_attn: shifted=1 must be a number in \(0, 1\)$"),
        (lambda: attn_patterns.get("sf_attn", shift=0), r"^sf_attn: shift=0 must be a number in \(0, 1\)$"),
    ],
)
def test_bad_parameters_name_the_rule(call, message):
    with pytest.raises(ValueError, match=message):
        call()


@pytest.mark.parametrize("name, params", PATTERNS, ids=IDS)
def test_degenerate_lengths_are_refused_and_the_rest_kept(name, params):
    """A length at which some head lets no query see 2 keys is refused (chunks of one token
    would run as attention to each token alone); every length where the dense mask shows a
    query with 2 keys on every head passes. The check agrees with the mask it guards."""
    pattern = attn_patterns.get(name, **params)
    heads = pattern.fewest_heads()
    for n in range(1, 40):
        widest = pattern.mask(n, heads).sum(dim=-1).amax(dim=-1)  # per head, its best-seeing query
        try:
            pattern.check_sinks(n)
        except ValueError as err:  # sink tokens as wide as a chunk: refused first, by name
            assert f"sink_tokens={pattern.sink_tokens} must be in [0, " in str(err)
            continue
        if bool((widest >= 2).all()):
            pattern.check_length(n)
        else:
            with pytest.raises(ValueError, match=r"fewer than 2 keys per chunk"):
                pattern.check_length(n)


@pytest.mark.parametrize("name, params", PATTERNS + SINKS[3:6], ids=IDS + SINK_IDS[3:6])
def test_the_widest_query_is_arithmetic_and_equals_the_mask(name, params, monkeypatch):
    """Issue 31: ``widest`` (what check_length reads) equals the dense mask's per-head widest
    query, by each pattern's closed form and by the progression of the base class, and a
    length is checked without a tensor the length's size (``model.target_length=1e12`` was an
    allocator traceback): at the longest length allowed, no torch call runs at all."""
    from attn_patterns.base import Pattern
    from attn_patterns.checks import MAX_LENGTH

    pattern = attn_patterns.get(name, **params)
    for heads in (pattern.fewest_heads(), 2 * pattern.fewest_heads()):
        for n in range(1, 40):
            dense = pattern.mask(n, heads).sum(dim=-1).amax(dim=-1).tolist()
            assert pattern.widest(n, heads) == Pattern.widest(pattern, n, heads) == dense, (heads, n)
    monkeypatch.setattr(torch, "arange", None)
    pattern.check_length(MAX_LENGTH)
    with pytest.raises(ValueError, match=r"seq_len=16777217 must be an integer <= 16,777,216 \(RoPE positions are float32"):
        pattern.check_length(MAX_LENGTH + 1)


def test_sizes_are_bounded_before_anything_is_built():
    """A 400-digit ``chunks`` or ``dilation`` is refused by the parameter check, not by an
    OverflowError of whatever it would have built (scca_flow: one head group per chunk)."""
    huge = int("1" * 400)
    for name, key in (("s2", "chunks"), ("sda", "dilation"), ("scca_fixed", "chunks")):  # named by the part that takes it
        with pytest.raises(ValueError, match=rf"^\w+: {key}=111111\.\.\. \(400 digits\) must be an integer <= 16,777,216"):
            attn_patterns.get(name, **{key: huge})
    with pytest.raises(ValueError, match=r"^scca_flow: chunks=2048 must be an integer <= 1,024 \(one head group each"):
        attn_patterns.get("scca_flow", chunks=2048)


def test_degenerate_parameters_by_hand():
    attn_patterns.get("s2", chunks=511).check_length(512)  # chunks of 2 tokens: sparse, not off
    with pytest.raises(ValueError, match=r"^s2\(chunks=512\) at sequence length 512: no query of head 0 \(of 2\) sees more than 1 key"):
        attn_patterns.get("s2", chunks=512).check_length(512)
    with pytest.raises(ValueError, match=r"^sda\(dilation=512\) at sequence length 512: "):
        attn_patterns.get("sda", dilation=512).check_length(512)
    attn_patterns.get("sda", dilation=511).check_length(512)


def test_shape_errors():
    q, k, v = qkv(8, 3)
    with pytest.raises(ValueError, match="num_heads=8 must be a multiple of kv_heads=3"):
        attn_patterns.get("causal")(q, k, v)
    with pytest.raises(ValueError, match="must be 4-D"):
        attn_patterns.get("causal")(q[0], k[0], v[0])


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


def test_backend_none_is_sdpa_and_flash_explains_itself():
    from attn_patterns.kernels import resolve_backend

    q = torch.zeros(1, 1, 4, 8)
    assert resolve_backend(None, q) == "sdpa"
    assert resolve_backend("flex", q) == "flex"
    flash = attn_patterns.get("s2", backend="flash")
    with pytest.raises(ValueError, match="flash-attn package and CUDA"):
        flash(*qkv(8, 8, dtype=torch.float32))


# What a fast path may not do: gather or scatter rows (sda once gathered q/k/v per head and
# scattered into a θ-times zero tensor, with an index_put_ backward), concatenate parts
# (every part is written into one output), or build a mask.
GATHERS = {"index", "index_put", "index_put_", "_index_put_impl_", "index_add", "index_add_", "index_select", "gather",
           "scatter", "scatter_", "scatter_add", "scatter_add_", "masked_fill", "masked_scatter", "where", "cat",
           "stack"}


@pytest.mark.parametrize("name,params", PATTERNS + SINKS[5:6], ids=IDS + SINK_IDS[5:6])
@pytest.mark.parametrize("kv_heads", [8, 2])
def test_fast_path_is_maskless_calls_on_views(name, params, kv_heads, monkeypatch):
    """Every SDPA call of every pattern, forward and backward, takes no mask and is causal
    only when square (the two forms fused kernels run at full speed); no op builds a boolean
    tensor, gathers, scatters or concatenates. A batch of two, and a length that leaves
    partial chunks."""
    from torch.utils._python_dispatch import TorchDispatchMode

    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def checked(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kwargs):
        calls.append((attn_mask, is_causal, q.shape[-2], k.shape[-2]))
        return sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, **kwargs)

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            outs = out if isinstance(out, (tuple, list)) else (out,)
            self.seen.add((func.overloadpacket.__name__, any(isinstance(o, torch.Tensor) and o.dtype == torch.bool for o in outs)))
            return out

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", checked)
    pattern = attn_patterns.get(name, **params)
    q, k, v = qkv(37, kv_heads, dtype=torch.float32, grad=True)
    sunk = bool(pattern.sinks(torch.arange(H), H).any())
    if sunk:  # the sinks' pieces are planned once, outside the calls
        pattern(q, k, v)
        calls.clear()
    with Ops() as ops:
        pattern(q, k, v).sum().backward()
    assert calls and all(mask is None and (not causal or lq == lk) for mask, causal, lq, lk in calls), calls
    # with sink tokens a call's keys are its sinks and its own block, concatenated (strided.Piece.prefix)
    assert not {op for op, _ in ops.seen} & (GATHERS - {"cat"} if sunk else GATHERS)
    assert not [op for op, boolean in ops.seen if boolean]


@pytest.mark.parametrize("name", ["causal", "s2", "scca_fixed", "scca_flow", "sda", "longmixed"])
def test_grouped_query_kv_is_not_repeated(name):
    """K/V with fewer heads go to the kernel as they are (SDPA enable_gqa, views) whenever the
    head split respects KV groups: here 8 query heads on 4 KV heads. (On CPU only where batch
    × KV heads fill the threads evenly, so one thread here: see kernels._gqa_native.)"""
    from torch.profiler import profile

    q, k, v = qkv(37, 4, dtype=torch.float32, grad=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with profile() as prof:
            attn_patterns.get(name)(q, k, v).sum().backward()
    finally:
        torch.set_num_threads(threads)
    assert "aten::repeat_interleave" not in {e.key for e in prof.key_averages()}


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_registered_rule_only_pattern_gets_mask_pairs_and_flex():
    """A new pattern may state its rule as a mask_mod only (``rule``): mask, visible_pairs
    (row blocks, no N×N tensor), the flex backend and mixes all follow from it, causal."""

    class Sink(attn_patterns.Pattern):
        name = "test_sink"

        def __init__(self, window=3, backend=None):
            super().__init__(backend, window=window)
            self.window = window

        def rule(self, h, i, j, *, n, num_heads):  # causality is the base class's to add
            return (j == 0) | (i - j < self.window + h)

    @attn_patterns.register("test_sink")
    def sink(window: int = 3, backend=None):
        return Sink(window, backend)

    try:
        pattern = attn_patterns.get("test_sink", window=2)
        mask = pattern.mask(9, 2)
        assert mask[0, 8].nonzero().flatten().tolist() == [0, 7, 8]
        assert mask[1, 8].nonzero().flatten().tolist() == [0, 6, 7, 8]
        assert pattern.visible_pairs(9, 2) == int(mask.sum())
        q, k, v = qkv(9, 1, dtype=torch.float32)
        with torch.no_grad():
            torch.testing.assert_close(pattern(q[:, :2], k, v, backend="flex"), dense_attention(q[:, :2], k, v, mask))
        assert not mask.triu(1).any()
        mix = attn_patterns.get("mixed", parts=[({"name": "test_sink", "window": 2}, 0.5), ("s2", 0.5)])
        assert torch.equal(mix.mask(9, 4)[:2], mask)
        assert torch.equal(mix.mask(9, 4)[2:], attn_patterns.get("s2").mask(9, 2))
        assert mix.visible_pairs(9, 4) == int(mix.mask(9, 4).sum())
        with pytest.raises(ValueError, match="windw unknown; allowed: window, backend"):
            attn_patterns.get("test_sink", windw=2)
    finally:
        attn_patterns.PATTERNS.remove("test_sink")


def test_mix_with_a_pattern_registered_from_outside():
    """A part with no pieces of its own (a pattern from outside, one K/V head per query head)
    runs its own forward on its heads, K/V repeated where its heads cut through a KV group, and
    lands in the mix's one output beside the built-in parts' pieces: values and gradients
    equal the dense reference."""

    class Window(attn_patterns.Pattern):
        name = "test_window"

        def __init__(self, backend=None):
            super().__init__(backend)

        def rule(self, h, i, j, *, n, num_heads):
            return i - j < 3

        def forward(self, q, k, v, backend):
            return dense_attention(q, k, v, self.mask(q.shape[2], q.shape[1]))

    attn_patterns.register("test_window")(Window)
    try:
        pattern = attn_patterns.get("mixed", parts=[({"name": "sda", "dilation": 2}, 0.25), ("test_window", 0.375),
                                                    ("causal", 0.375)])
        for kv_heads in (8, 2):
            q, k, v = qkv(13, kv_heads, grad=True)
            out, ref = pattern(q, k, v), dense_attention(q, k, v, pattern.mask(13, H))
            torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)
            cot = torch.randn_like(out)
            for a, b in zip(torch.autograd.grad(out, (q, k, v), cot), torch.autograd.grad(ref, (q, k, v), cot)):
                torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)
        with pytest.raises(ValueError, match=r"^mixed: sink_tokens=2 needs parts of attn_patterns' own patterns; test_window"):
            attn_patterns.get("mixed", parts=[("test_window", 0.5), ("causal", 0.5)], sink_tokens=2)
    finally:
        attn_patterns.PATTERNS.remove("test_window")


@pytest.mark.parametrize("name", ["s2", "scca_fixed", "scca_flow", "sda", "longmixed"])
def test_transformers_layout_input(name):
    """transformers hands over (B, N, H, D) transposed to (B, H, N, D): a strided view."""
    pattern = attn_patterns.get(name)
    q, k, v = qkv(29, 4)
    as_hf = [x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v)]
    assert not as_hf[0].is_contiguous()
    torch.testing.assert_close(pattern(*as_hf), pattern(q, k, v), atol=1e-12, rtol=1e-12)


def _flash_attn_func_as_documented(q, k, v, causal=False, window_size=(-1, -1), softmax_scale=None):
    """flash-attn's flash_attn_func semantics from its README: (batch, seq, heads, dim), fewer
    K/V heads allowed; query i sees keys in [i + Lk - Lq - left, i + Lk - Lq + right], -1 = no
    limit; causal means right = 0."""
    lq, lk, d = q.shape[1], k.shape[1], q.shape[-1]
    groups = q.shape[2] // k.shape[2]
    k, v = (x.repeat_interleave(groups, dim=2) for x in (k, v))
    left, right = window_size
    right = 0 if causal else right
    diagonal = torch.arange(lq)[:, None] + lk - lq
    t = torch.arange(lk)[None, :]
    ok = torch.ones(lq, lk, dtype=torch.bool)
    if right >= 0:
        ok &= t <= diagonal + right
    if left >= 0:
        ok &= t >= diagonal - left
    scores = torch.einsum("bihd,bjhd->bhij", q, k) * (softmax_scale or d**-0.5)
    weights = scores.masked_fill(~ok, float("-inf")).softmax(-1).nan_to_num(0.0)
    return torch.einsum("bhij,bjhd->bihd", weights, v)


@pytest.mark.parametrize("name,params", PATTERNS, ids=IDS)
def test_flash_window_arithmetic(name, params, monkeypatch):
    """The flash backend cannot run without CUDA; its calls on views can, against
    a stand-in with flash-attn's documented semantics."""
    import sys
    import types

    monkeypatch.setitem(sys.modules, "flash_attn", types.SimpleNamespace(flash_attn_func=_flash_attn_func_as_documented))
    pattern = attn_patterns.get(name, **params)
    for n in (1, 13, 37):
        q, k, v = qkv(n, 2)
        torch.testing.assert_close(pattern.forward(q, k, v, "flash"), dense_attention(q, k, v, pattern.mask(n, H)))


def test_attn_patterns_is_pure_torch():
    """attn_patterns imports neither transformers, flash-attn nor the application (sparse_ft):
    each is blocked, and every pattern, DCA and LongHeads included, still runs."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "for blocked in ('transformers', 'flash_attn', 'sparse_ft'): sys.modules[blocked] = None\n"
        "import torch, attn_patterns\n"
        "from attn_patterns.longheads import LongHeads\n"
        "q = torch.randn(1, 8, 40, 4)\n"
        "assert attn_patterns.get('longmixed')(q, q[:, :2], q[:, :2]).shape == q.shape\n"
        "assert attn_patterns.get_algorithm('dca', pretraining_length=16)(q, q[:, :2], q[:, :2]).shape == q.shape\n"
        "assert LongHeads(chunk_size=4, chunks=3)(q, q[:, :2], q[:, :2]).shape == q.shape\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_pieces_never_run_cudnn_on_cuda():
    """On CUDA the pieces' SDPA calls run with cuDNN left out of whatever is enabled (it returned
    wrong gradients and read out of bounds on such views); a pin to cuDNN alone is refused as
    SDPA refuses a call it has no kernel for. On a CPU nothing changes."""
    from torch.backends import cuda
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from attn_patterns.kernels import piece_kernels

    with piece_kernels("cuda"):
        assert not cuda.cudnn_sdp_enabled() and cuda.flash_sdp_enabled() and cuda.mem_efficient_sdp_enabled()
    assert cuda.cudnn_sdp_enabled()  # restored
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]), piece_kernels("cuda"):
        assert not cuda.cudnn_sdp_enabled() and not cuda.flash_sdp_enabled() and cuda.mem_efficient_sdp_enabled()
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION), pytest.raises(RuntimeError, match="No available kernel.*cuDNN"):
        piece_kernels("cuda")
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION), piece_kernels("cpu"):
        assert cuda.cudnn_sdp_enabled()
