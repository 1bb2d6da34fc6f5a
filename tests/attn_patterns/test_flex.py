"""The FlexAttention backend: masks read off the block layout (never ``create_block_mask``),
its forward against the float64 dense reference for every registered pattern, no leak from
future tokens, one compile for every pattern and length, and on a GPU bf16 values and
gradients at a model's shape. On CPU flex runs unfused (torch's eager path), forward only."""

from __future__ import annotations

import pytest
import torch
import torch.nn.attention.flex_attention as fa

import attn_patterns
from attn_patterns import flex
from attn_patterns.reference import dense_attention

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

H = 8
# What a registered name needs besides its defaults; every other name is built as it is.
PARAMS = {"mixed": {"parts": [("s2", 0.5), ({"name": "sda", "dilation": 4}, 0.25), ("causal", 0.25)]}}
NAMES = attn_patterns.names()
# Smaller than one block (1, 37), several blocks not a multiple of it (300: chunks of 75, so
# some key blocks are skipped whole, some seen whole, some in part).
LENGTHS = [1, 37, 300]


def pattern_of(name: str) -> attn_patterns.Pattern:
    return attn_patterns.get(name, **PARAMS.get(name, {}))


def qkv(n: int, kv_heads: int, *, dtype=torch.float64, heads: int = H, dim: int = 16, seed: int = 0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(1, heads, n, dim), (1, kv_heads, n, dim), (1, kv_heads, n, dim)]
    return [torch.randn(s, generator=gen, dtype=dtype).to(device) for s in shapes]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("kv_heads", [8, 4, 2])
def test_forward_matches_dense_reference(name, kv_heads):
    pattern = pattern_of(name)
    for n in LENGTHS:
        q, k, v = qkv(n, kv_heads)
        with torch.no_grad():
            out = pattern(q, k, v, backend="flex")
        torch.testing.assert_close(out, dense_attention(q, k, v, pattern.mask(n, H)), atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("name", NAMES)
def test_future_tokens_do_not_leak(name):
    pattern, n, cut = pattern_of(name), 300, 170
    q, k, v = qkv(n, 2)
    later = [x.clone() for x in (q, k, v)]
    for x in later:
        x[:, :, cut:] = torch.randn_like(x[:, :, cut:])
    with torch.no_grad():
        before, after = pattern(q, k, v, backend="flex"), pattern(*later, backend="flex")
    torch.testing.assert_close(before[:, :, :cut], after[:, :, :cut], atol=0, rtol=0)
    assert not torch.equal(before[:, :, cut:], after[:, :, cut:])


def test_masks_come_from_the_layout_without_create_block_mask(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("create_block_mask called")

    monkeypatch.setattr(fa, "create_block_mask", refuse)
    for name in NAMES:
        pattern, n = pattern_of(name), 520
        mask = flex.block_mask(pattern, n, H, torch.device("cpu"))
        assert flex.block_mask(pattern, n, H, torch.device("cpu")) is mask  # kept for every layer
        layout = attn_patterns.blocks.block_layout(pattern, n, H, block_q=flex.BLOCK, block_k=flex.BLOCK, strided=False)
        assert int(mask.kv_num_blocks.sum() + mask.full_kv_num_blocks.sum()) == layout.entries()
        if name != "causal":
            assert mask.sparsity() > 0  # key blocks no row sees are skipped


@pytest.fixture
def counted_compiles(monkeypatch):
    """``compiled_flex`` built with a counting backend (dynamo's guards and recompiles as in
    production, the graph run eagerly: inductor's CPU compile would take a minute here)."""
    from torch._dynamo.testing import CompileCounter

    counter, compile_ = CompileCounter(), torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **options: compile_(fn, **{**options, "backend": counter}))
    torch._dynamo.reset()
    flex.compiled_flex.cache_clear()
    yield counter
    flex.compiled_flex.cache_clear()
    torch._dynamo.reset()


def test_one_compile_serves_every_pattern_and_length(counted_compiles):
    kernel = flex.compiled_flex()
    for name, n in [("s2", 300), ("s2", 520), ("longmixed", 300), ("sda", 700), ("scca_flow", 1000)]:
        pattern = pattern_of(name)
        q, k, v = qkv(n, 2, dtype=torch.float32)
        mask = flex.block_mask(pattern, n, H, q.device)
        with torch.no_grad():
            out = flex.compiled_flex()(q, k, v, block_mask=mask, scale=0.25, enable_gqa=True)
        torch.testing.assert_close(out, dense_attention(q, k, v, pattern.mask(n, H)), atol=1e-5, rtol=1e-5)
    assert flex.compiled_flex() is kernel
    assert counted_compiles.frame_count == 1


@pytest.mark.gpu
def test_bf16_forward_and_backward_at_model_shape():
    """H = 32, Hkv = 8, D = 128, N = 4096: every pattern's values and gradients against the
    dense reference (fp32 inside), through the compiled kernel (35 s on an H200, compile included)."""
    n, heads, kv_heads, dim = 4096, 32, 8, 128
    for name in NAMES:
        pattern = pattern_of(name)
        q, k, v = qkv(n, kv_heads, dtype=torch.bfloat16, heads=heads, dim=dim, device="cuda")
        q, k, v = (x.requires_grad_() for x in (q, k, v))
        out = pattern(q, k, v, backend="flex")
        ref = dense_attention(q, k, v, pattern.mask(n, heads).cuda())
        torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
        cot = torch.randn_like(out)
        for got, want in zip(torch.autograd.grad(out, (q, k, v), cot), torch.autograd.grad(ref, (q, k, v), cot)):
            torch.testing.assert_close(got.float(), want.float(), atol=5e-2, rtol=5e-2)
