"""A pattern run on heads [a, b) of H (what one rank computes under DeepSpeed Ulysses) equals
heads [a, b) of the whole-head call, for every registered static pattern, with no process
group: the rank's K/V heads sliced (or the one replicated KV head when the ranks outnumber
the KV heads) as Ulysses hands them over."""

import pytest
import torch

import attn_patterns

H = 16
PATTERNS = [
    ("causal", {}),
    ("s2", {}),
    ("scca_fixed", {"chunks": 3}),
    ("scca_flow", {}),
    ("sda", {"dilation": 3}),
    ("longmixed", {}),
    ("sf_attn", {"shifted": 0.25}),  # 4 + 12 heads, each with 4 sink tokens
    # 5 + 11 heads: ranks' slices cut through the split and give sda odd head offsets
    ("mixed", {"parts": [("causal", 0.3125), ({"name": "sda", "dilation": 2}, 0.6875)]}),
]
IDS = [f"{name}{params or ''}" for name, params in PATTERNS]


def rank_slices(sp: int, kv_heads: int):
    """(q heads, kv heads) of each Ulysses rank: KV heads split when there are at least as
    many as ranks, otherwise the rank's one KV head, replicated."""
    local, groups = H // sp, H // kv_heads
    for rank in range(sp):
        a = rank * local
        kv = slice(a // groups, (a + local) // groups) if kv_heads >= sp else slice(a // groups, a // groups + 1)
        yield slice(a, a + local), kv


def test_every_registered_static_pattern_is_covered():
    assert {name for name, _ in PATTERNS} == set(attn_patterns.names())


@pytest.mark.parametrize("name,params", PATTERNS, ids=IDS)
@pytest.mark.parametrize("kv_heads,sps", [(16, (4,)), (4, (2, 8)), (2, (4,))])
def test_rank_heads_equal_the_whole_call(name, params, kv_heads, sps):
    """Multi-head, GQA with KV heads split among ranks, and ranks outnumbering KV heads."""
    pattern = attn_patterns.get(name, **params)
    n = 22  # partial last chunks (w = 6 or 8) and a partial last dilation row for θ = 3, 4
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, H, n, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(1, kv_heads, n, 8, generator=gen, dtype=torch.float64, requires_grad=True) for _ in "kv")
    whole, mask = pattern(q, k, v), pattern.mask(n, H)
    for sp in sps:
        pairs = 0
        for heads, kv in rank_slices(sp, kv_heads):
            view = pattern.heads(heads.start, H)
            local = tuple(x.detach().requires_grad_() for x in (q[:, heads], k[:, kv], v[:, kv]))
            out = view(*local)
            torch.testing.assert_close(out, whole[:, heads], atol=1e-12, rtol=1e-12)
            assert torch.equal(view.mask(n, H // sp), mask[heads])
            cot = torch.randn_like(out)
            got = torch.autograd.grad(out, local, cot)
            gq, gk, gv = torch.autograd.grad(whole[:, heads], (q, k, v), cot, retain_graph=True)
            for a, b in zip(got, (gq[:, heads], gk[:, kv], gv[:, kv])):
                torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)
            pairs += view.visible_pairs(n, H // sp)
        assert pairs == pattern.visible_pairs(n, H)


def test_flex_backend_on_a_slice_cut_through_the_split():
    """Ranks [4, 8) and [8, 12) of 16: full | sda from head 5, sda at offsets 0 and 3 (flex
    is unfused on CPU, ~1 s a call, so two ranks only)."""
    name, params = PATTERNS[-1]
    pattern = attn_patterns.get(name, **params)
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, H, 19, 8, generator=gen, dtype=torch.float64) for _ in "qkv")
    whole = pattern(q, k, v)
    for a in (4, 8):
        out = pattern.heads(a, H)(q[:, a : a + 4], k[:, a : a + 4], v[:, a : a + 4], backend="flex")
        torch.testing.assert_close(out, whole[:, a : a + 4], atol=1e-10, rtol=1e-10)


def test_head_views_are_kept_and_checked():
    pattern = attn_patterns.get("longmixed")
    assert pattern.heads(4, 16) is pattern.heads(4, 16)
    assert repr(pattern.heads(4, 16)) == "longmixed(chunks=4).heads(4, 16)"
    with pytest.raises(ValueError, match=r"longmixed: num_heads=12 must be divisible by 8"):
        pattern.heads(0, 12)
    with pytest.raises(ValueError, match=r"head offset=16 must be an integer in \[0, total=16\)"):
        pattern.heads(16, 16)
    q = torch.zeros(1, 8, 4, 2)
    with pytest.raises(ValueError, match=r"heads \[12, 20\) reach past the pattern's total=16 heads"):
        pattern.heads(12, 16)(q, q, q)


def test_a_pattern_reading_the_head_index_without_forward_heads_is_refused():
    class PerHead(attn_patterns.Pattern):
        name = "per_head"

        def keys(self, h, i, n, num_heads):
            return torch.zeros_like(i), i - h % 2, torch.ones_like(i)

        def forward(self, q, k, v, backend):
            raise AssertionError("never reached")

    q = torch.zeros(1, 2, 4, 2)
    with pytest.raises(ValueError, match=r"per_head: its rule reads the head index .* heads \[2, 4\) of 4 alone"):
        PerHead().heads(2, 4)(q, q, q)
