"""Dual Chunk Attention: positions as the paper's eqs. 2–8 and the published code's, the
three-piece kernel of every variant against a dense reference built from those positions and
its logit factor, the transformers path (prefill, KV-cache decoding, padding, GQA, RoPE
scaling) against the same reference inside a tiny Llama, and a tiny Qwen2 whose
``dual_chunk_attention_config`` is read and run as the serving engines' formulas say."""

from __future__ import annotations

import importlib.util
import logging
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import attn_patterns
from attn_patterns import Algorithm
from attn_patterns.dca import dca_attention
from attn_patterns.rotary import default_inv_freq, rotate
from sparse_ft import methods, use_attention
from sparse_ft.modeling.attention import current_method
from sparse_ft.methods import Method
from sparse_ft.methods.dca import SPARSE_KEYS, model_dca_config, params_from_config
from sparse_ft.modeling.tiny import tiny_llama

VARIANTS = attn_patterns.dca.VARIANTS


def _load_bench(name: str):
    path = Path(__file__).resolve().parents[2] / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SOURCES = _load_bench("dca_sources")  # the published code's formulas, written densely

# --- reference ------------------------------------------------------------------------------


def rotate_at(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """x (..., D) rotated by RoPE at ``positions`` (broadcastable to x.shape[:-1]), fp64."""
    angle = positions.double()[..., None] * inv_freq.double()
    cos, sin = torch.cat((angle.cos(),) * 2, -1), torch.cat((angle.sin(),) * 2, -1)
    x = x.double()
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin


def reference(q, k, v, rel: torch.Tensor, inv_freq: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Dense DCA from the relative-position matrix: logit(i, j) = <R(M[i][j]) q_i, k_j> for
    RoPE-free q (B,H,N,D), k/v (B,Hkv,N,D); fp64; causal, and M = -1 hides a key."""
    groups = q.shape[1] // k.shape[1]
    k, v = (x.repeat_interleave(groups, dim=1).double() for x in (k, v))
    n = q.shape[2]
    q_pairs = rotate_at(q[:, :, :, None, :], rel.clamp(min=0), inv_freq)  # (B,H,N,N,D)
    scores = (q_pairs * k[:, :, None, :, :]).sum(-1) * (scale or 1 / math.sqrt(q.shape[-1]))
    seen = (rel >= 0) & torch.ones(n, n, dtype=torch.bool).tril()
    weights = torch.softmax(scores.masked_fill(~seen, float("-inf")), -1)
    return weights @ v


def factor(variant: str, n: int, c: int) -> float:
    """The logit factor of the sources over n tokens: ChunkLlama's (1 + 0.05 ln(n/c))² (q and
    k each), the engines' max(1, 0.1 ln(n/c) + 1)² (keys and softmax scale)."""
    if variant == "paper" or n <= c:
        return 1.0
    return (1 + {"chunkllama": 0.05, "qwen": 0.1}[variant] * math.log(n / c)) ** 2


def want(p: Algorithm, q, k, v) -> torch.Tensor:
    n, d = q.shape[2], q.shape[-1]
    c = p.sizes()[2]
    return reference(q, k, v, p.relative_positions(n), default_inv_freq(d), factor(p.variant, n, c) / math.sqrt(d))


def qkv(b=2, h=4, hkv=2, n=23, d=16, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, x, n, d, generator=g).to(dtype) for x in (h, hkv, hkv)]


# --- positions --------------------------------------------------------------------------------


def test_relative_positions_figure_2():
    """The paper's Figure 2: s = 6, c = 10, w = 4, 12 tokens."""
    rel = attn_patterns.get_algorithm("dca", chunk_size=6, local_window=4, pretraining_length=10).relative_positions(12)
    assert rel[:6, :6].tolist() == torch.tensor([[i - j if j <= i else -1 for j in range(6)] for i in range(6)]).tolist()
    assert rel[6:10, :].max() <= 9
    assert rel[6].tolist()[:7] == [6, 5, 4, 3, 2, 1, 0]  # a = 0 < w: true distances
    assert rel[10].tolist()[:6] == [9, 8, 7, 6, 5, 4]  # a = 4 >= w: query at c - 1
    assert rel[11].tolist() == [9, 8, 7, 6, 5, 4, 5, 4, 3, 2, 1, 0]
    above = torch.ones(12, 12, dtype=torch.bool).triu(1)
    assert (rel[above] == -1).all() and rel.max() == 9


def test_relative_positions_equations():
    s, w, c, n = 5, 3, 9, 31
    rel = attn_patterns.get_algorithm("dca", chunk_size=s, local_window=w, pretraining_length=c).relative_positions(n)
    for i in range(n):
        for j in range(n):
            d, a, b = i // s - j // s, i % s, j % s
            want = -1 if j > i else a - b if d == 0 else ((s + a if a < w else c - 1) - b) if d == 1 else c - 1 - b
            assert rel[i, j] == want, (i, j)
    assert rel.max() < c


def test_defaults_follow_the_paper():
    p = attn_patterns.get_algorithm("dca", pretraining_length=4096)
    assert p.sizes() == (3072, 1024, 4096) and p.logit_scale == "none"
    assert attn_patterns.get_algorithm("dca").sizes(256) == (192, 64, 256)


def test_variant_defaults_follow_their_code():
    """ChunkLlama's replace_with_chunkllama: s = 3c/4, w = c/8, its mscale; qwen: the same
    sizes without a model config, the engines' scale, and chunk_size = c allowed (Qwen's
    configs set chunk_size = original_max_position_embeddings)."""
    chunkllama = attn_patterns.get_algorithm("dca", pretraining_length=4096, variant="chunkllama")
    assert chunkllama.sizes() == (3072, 512, 4096) and chunkllama.logit_scale == "chunkllama"
    qwen = attn_patterns.get_algorithm("dca", pretraining_length=4096, variant="qwen")
    assert qwen.sizes() == (3072, 512, 4096) and qwen.logit_scale == "qwen"
    assert attn_patterns.get_algorithm("dca", chunk_size=262144, local_window=8192, pretraining_length=262144,
                             variant="qwen").sizes() == (262144, 8192, 262144)
    assert attn_patterns.get_algorithm("dca", pretraining_length=64, variant="qwen", logit_scale="none").logit_scale == "none"


def test_logit_factor_is_the_sources_formula():
    """Per call from the whole length: 1 up to c, then ChunkLlama's (1 + 0.05 ln 4)² = 1.1434
    and the engines' (1 + 0.1 ln 4)² = 1.2965 at 4c."""
    from attn_patterns.dca import logit_factor

    assert logit_factor("chunkllama", 64, 64) == logit_factor("qwen", 10, 64) == logit_factor("none", 1000, 64) == 1.0
    assert logit_factor("chunkllama", 256, 64) == pytest.approx(1.143434, abs=1e-6)
    assert logit_factor("qwen", 256, 64) == pytest.approx(1.296477, abs=1e-6)
    p = attn_patterns.get_algorithm("dca", pretraining_length=64, variant="qwen")
    assert p.scale(256, 16) == pytest.approx(1.296477 / 4, abs=1e-6)
    assert p.scale(256, 16, base=0.5) == pytest.approx(1.296477 / 2, abs=1e-6)


@pytest.mark.parametrize(
    "params, words",
    [
        (dict(chunk_size=0, pretraining_length=8), "chunk_size=0"),
        (dict(chunk_size=8, pretraining_length=8), "chunk_size=8"),
        (dict(chunk_size=6, local_window=3, pretraining_length=8), "local_window=3"),
        (dict(local_window=-1), "local_window=-1"),
        (dict(pretraining_length=1.5), "pretraining_length=1.5"),
        (dict(variant="chunky"), "variant='chunky'"),
        (dict(variant="chunkllama", chunk_size=4, local_window=4, pretraining_length=8), "local_window=4"),
        (dict(pieces="inter"), "pieces='inter'"),
        (dict(logit_scale="yarn"), "logit_scale='yarn'"),
        (dict(variant="qwen", chunk_size=16, local_window=16, pretraining_length=64), "local_window=16"),
    ],
)
def test_parameters_are_validated(params, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(".", r"\.")):
        attn_patterns.get_algorithm("dca", **params)


def test_mask_is_causal():
    mask = attn_patterns.get_algorithm("dca", pretraining_length=8).mask(10, 2)
    assert torch.equal(mask, torch.ones(2, 10, 10, dtype=torch.bool).tril().expand(2, 10, 10))
    assert torch.equal(attn_patterns.get_algorithm("dca", pretraining_length=8, pieces="intra+inter").mask(10, 2), mask)


def test_ablation_positions_and_mask():
    """The paper's Figure 4 ablation: intra-chunk alone sees its own chunk only; intra + inter
    sees every key, the previous chunk from c - 1 like the others."""
    s, w, c, n = 5, 3, 9, 23
    intra = attn_patterns.get_algorithm("dca", chunk_size=s, local_window=w, pretraining_length=c, pieces="intra")
    same_chunk = (torch.arange(n)[:, None] // s == torch.arange(n)[None, :] // s) & torch.ones(n, n, dtype=torch.bool).tril()
    assert torch.equal(intra.mask(n, 1)[0], same_chunk)
    assert torch.equal(intra.relative_positions(n) >= 0, same_chunk)
    rel = attn_patterns.get_algorithm("dca", chunk_size=s, local_window=w, pretraining_length=c, pieces="intra+inter").relative_positions(n)
    for i in range(n):
        for j in range(i + 1):
            want = i % s - j % s if i // s == j // s else c - 1 - j % s
            assert rel[i, j] == want, (i, j)


# --- the kernel -------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("backend", ["sdpa", "math"])
@pytest.mark.parametrize("n", [5, 12, 23, 40])
def test_kernel_matches_reference(variant, backend, n):
    """GQA (4 heads on 2), lengths inside one chunk, at a boundary and over many chunks; the
    logit factor of the variant from 10 tokens on."""
    s, w, c = 6, 3, 10
    q, k, v = qkv(n=n)
    p = attn_patterns.get_algorithm("dca", chunk_size=s, local_window=w, pretraining_length=c, variant=variant)
    torch.testing.assert_close(p(q, k, v, backend=backend).double(), want(p, q, k, v), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("backend", ["sdpa", "math"])
@pytest.mark.parametrize("variant", ["paper", "chunkllama"])
@pytest.mark.parametrize("pieces", ["intra", "intra+inter"])
def test_ablation_kernel_matches_reference(backend, variant, pieces):
    q, k, v = qkv(n=31)
    p = attn_patterns.get_algorithm("dca", chunk_size=6, local_window=3, pretraining_length=10, variant=variant, pieces=pieces)
    torch.testing.assert_close(p(q, k, v, backend=backend).double(), want(p, q, k, v), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("w", [2, 4])
def test_chunkllama_variant_matches_its_positions(w):
    """The authors' code: chunks of L = s - w tokens, successive queries at min(a + L, s),
    inter-chunk queries at min(2L - 1, s) (w = 4: L = 2, inter-chunk differs from successive)."""
    s, n = 6, 30
    L = s - w
    p = attn_patterns.get_algorithm("dca", chunk_size=s, local_window=w, pretraining_length=10, variant="chunkllama")
    rel = p.relative_positions(n)
    assert rel.max() <= s  # the authors' code clamps at the chunk size
    i = 4 * L + L - 1  # last row of chunk 4
    assert rel[i, 3 * L] == min(i % L + L, s) and rel[i, 0] == min(2 * L - 1, s)
    q, k, v = qkv(n=30)
    torch.testing.assert_close(p(q, k, v).double(), want(p, q, k, v), atol=2e-5, rtol=1e-4)
    qwen = attn_patterns.get_algorithm("dca", chunk_size=s, local_window=w, pretraining_length=10, variant="qwen")
    assert torch.equal(qwen.relative_positions(n), rel)  # the engines' tables are ChunkLlama's


@pytest.mark.parametrize("variant", VARIANTS)
def test_kernel_on_rotated_inputs_and_decoding(variant):
    """q/k rotated at their true positions (what transformers passes) give the reference,
    and the last rows computed alone against the full cache equal the prefill's rows."""
    s, w, c, n = 6, 3, 10, 29
    q, k, v = qkv(n=n)
    inv = default_inv_freq(16)
    pos = torch.arange(n)
    q_rot, k_rot = rotate(q, pos, inv), rotate(k, pos, inv)
    p = attn_patterns.get_algorithm("dca", chunk_size=s, local_window=w, pretraining_length=c, variant=variant)
    scale = p.scale(n, 16)
    sizes = dict(inv_freq=inv, chunk_size=s, local_window=w, pretraining_length=c, scale=scale, variant=variant)
    full = dca_attention(q_rot, k_rot, v, **sizes)
    torch.testing.assert_close(full.double(), want(p, q, k, v), atol=2e-5, rtol=1e-4)
    for tail in (1, 4, 13):
        for backend in ("sdpa", "math"):
            part = dca_attention(q_rot[:, :, -tail:], k_rot, v, **sizes, backend=backend)
            torch.testing.assert_close(part, full[:, :, -tail:], atol=2e-5, rtol=1e-4)


def test_rotate_is_exact_at_long_distances():
    x = torch.randn(1, 1, 3, 16, dtype=torch.float64)
    shift = torch.tensor([0, 40_000, -123_457])
    inv = default_inv_freq(16)
    torch.testing.assert_close(rotate(x.float(), shift, inv).double(), rotate_at(x, shift.view(1, 1, 3), inv), atol=1e-5, rtol=0)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("pieces", attn_patterns.dca.PIECES)
def test_future_tokens_never_leak(pieces, variant):
    """Perturbed later tokens change no earlier row (the logit factor depends on the length
    N only, as in the sources, not on what the tokens are)."""
    q, k, v = qkv(n=30)
    p = attn_patterns.get_algorithm("dca", chunk_size=6, local_window=3, pretraining_length=10, pieces=pieces, variant=variant)
    before = p(q, k, v)
    t = 17
    for x in (q, k, v):
        x[:, :, t + 1 :] = torch.randn_like(x[:, :, t + 1 :]) * 3
    after = p(q, k, v)
    torch.testing.assert_close(after[:, :, : t + 1], before[:, :, : t + 1], atol=1e-6, rtol=0)


def test_gradients_flow_through_the_math_path():
    q, k, v = (x.requires_grad_() for x in qkv(n=14))
    p = attn_patterns.get_algorithm("dca", chunk_size=4, local_window=2, pretraining_length=7)
    p(q, k, v).square().sum().backward()
    want_q = torch.autograd.grad(reference(q, k, v, p.relative_positions(14), default_inv_freq(16)).square().sum(), q)[0]
    torch.testing.assert_close(q.grad.double(), want_q.double(), atol=1e-4, rtol=1e-3)


# --- inside a transformers model -------------------------------------------------------------


class DenseDCA(Method):
    """Reference attention function for a model: un-rotates q, k with the model's OWN rotary
    module (not DCA's frequency lookup), then dense attention from ``relative_positions``."""

    name = "dense_dca"

    def __init__(self, dca: Algorithm, rotary: torch.nn.Module) -> None:
        self.dca, self.rotary = dca, rotary

    def __call__(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        nk = key.shape[2]
        start = nk - query.shape[2]
        cos, sin = (x[0].double() for x in self.rotary(key, torch.arange(nk)[None]))  # (Nk, D), carries YaRN's factor
        factor = float(self.rotary.attention_scaling)

        def unrotate(x, rows):
            x = x.double()
            half = x.shape[-1] // 2
            back = torch.cat((x[..., half:], -x[..., :half]), -1)  # rotate_half inverse
            return (x * cos[rows] + back * sin[rows]) / factor**2

        q_raw, k_raw = unrotate(query, slice(start, nk)), unrotate(key, slice(0, nk))
        rel = self.dca.relative_positions(nk, module.config.max_position_embeddings)[start:]
        positions = rel.clamp(min=0)
        cos_p, sin_p = (x.double().view(*positions.shape, -1) for x in self.rotary(key, positions.reshape(1, -1)))
        groups = query.shape[1] // key.shape[1]
        k_raw, v = k_raw.repeat_interleave(groups, 1), value.double().repeat_interleave(groups, 1)
        half = q_raw.shape[-1] // 2
        qp = q_raw[:, :, :, None, :]
        q_pairs = qp * cos_p + torch.cat((-qp[..., half:], qp[..., :half]), -1) * sin_p
        scores = (q_pairs * k_raw[:, :, None, :, :]).sum(-1) * scaling * factor  # k at position 0 keeps one factor
        seen = (torch.arange(nk)[None, :] <= torch.arange(start, nk)[:, None]) & (rel >= 0)
        weights = torch.softmax(scores.masked_fill(~seen, float("-inf")), -1)
        return (weights @ v).to(query.dtype).transpose(1, 2).contiguous(), None


ROPES = {
    "default": {},
    "linear": {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}},
    "yarn": {"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 10000.0,
                                 "original_max_position_embeddings": 128}},
}


def _logits(model, ids, **kw):
    with torch.no_grad():
        return model(input_ids=ids, **kw).logits.double()


@pytest.mark.parametrize("rope, pieces", [(r, attn_patterns.dca.PIECES[-1]) for r in sorted(ROPES)]
                         + [("default", "intra"), ("default", "intra+inter")])
def test_model_matches_dense_reference(rope, pieces):
    """A tiny GQA Llama (c = 64 -> s = 48, w = 16) over 150 tokens: 4 chunks, on top of
    the model's own RoPE scaling."""
    model = tiny_llama(max_position_embeddings=64, **ROPES[rope])
    ids = torch.randint(3, 300, (1, 150), generator=torch.Generator().manual_seed(1))
    dca = methods.get("dca", pieces=pieces)
    use_attention(model, DenseDCA(dca.algorithm, model.model.rotary_emb))
    want = _logits(model, ids)
    use_attention(model, dca)
    torch.testing.assert_close(_logits(model, ids), want, atol=1e-4, rtol=1e-4)


def test_within_pretraining_length_equals_full_attention():
    """With w = c - s and s >= c/2 (the defaults), every distance up to c - 1 is the true
    one: DCA is exactly causal attention for n <= c, and differs from token c + 1 on."""
    model = tiny_llama(max_position_embeddings=64)
    ids = torch.randint(3, 300, (2, 70), generator=torch.Generator().manual_seed(2))
    full = _logits(model, ids)
    use_attention(model, "dca")
    torch.testing.assert_close(_logits(model, ids[:, :64]), full[:, :64], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(_logits(model, ids)[:, 64:], full[:, 64:], atol=1e-3)


def _dca_model(variant: str, c: int = 32):
    """A tiny model running ``variant``: the Llama with c = 32 (paper: s = 24, w = 8), or the
    tiny Qwen2 whose dual_chunk_attention_config gives the qwen variant its values."""
    if variant == "qwen":
        model = SOURCES.tiny_qwen()
        use_attention(model, "dca")
        return model
    model = tiny_llama(max_position_embeddings=c)
    use_attention(model, "dca", variant=variant)
    return model


@pytest.mark.parametrize("variant", VARIANTS)
def test_cached_decoding_equals_reprefill(variant):
    """Every cached call (prefill, chunked prefill, one-token steps) gives the logits a
    prefill of the sequence so far gives for those tokens: the logit factor of a call is the
    one of its whole length, as in the sources (without a factor, one full prefill)."""
    from transformers import DynamicCache

    model = _dca_model(variant)
    n = 150 if variant == "qwen" else 76  # qwen: chunks of 64 - 16 = 48, factor from 64 tokens on
    ids = torch.randint(3, 300, (1, n), generator=torch.Generator().manual_seed(3))
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        for lo, hi in [(0, 40), (40, 47), (47, 48), (48, 49)] + [(t, t + 1) for t in range(n - 3, n)]:
            if lo > cache.get_seq_length():  # the tokens in between, as one more chunk
                model(input_ids=ids[:, cache.get_seq_length() : lo], past_key_values=cache, use_cache=True)
            step = model(input_ids=ids[:, lo:hi], past_key_values=cache, use_cache=True).logits.double()
            torch.testing.assert_close(step, _logits(model, ids[:, :hi])[:, lo:hi], atol=5e-5, rtol=1e-4)


@pytest.mark.parametrize("variant", ["paper", "qwen"])
def test_generate_with_dca_matches_greedy_prefill(variant):
    model = _dca_model(variant)
    ids = torch.randint(3, 300, (1, 70), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False, pad_token_id=0)
    seq = out[:, :70]
    for _ in range(6):  # re-prefill every step
        seq = torch.cat((seq, _logits(model, seq)[:, -1:].argmax(-1)), 1)
    assert torch.equal(out, seq)


def test_padded_batch_equals_single_sequences():
    model = tiny_llama(max_position_embeddings=32)
    use_attention(model, "dca")
    g = torch.Generator().manual_seed(5)
    a, b = torch.randint(3, 300, (1, 80), generator=g), torch.randint(3, 300, (1, 57), generator=g)
    batch = torch.zeros(2, 80, dtype=torch.long)
    batch[0], batch[1, :57] = a[0], b[0]
    mask = (torch.arange(80)[None] < torch.tensor([[80], [57]])).long()
    out = _logits(model, batch, attention_mask=mask)
    torch.testing.assert_close(out[0], _logits(model, a)[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[1, :57], _logits(model, b)[0], atol=1e-5, rtol=1e-5)
    left = torch.stack((a[0], torch.cat((torch.zeros(23, dtype=torch.long), b[0]))))  # as generate pads
    positions = (mask.flip(-1).cumsum(-1) - 1).clamp(min=0)
    out = _logits(model, left, attention_mask=mask.flip(-1), position_ids=positions)
    torch.testing.assert_close(out[1, 23:], _logits(model, b)[0], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match=r"position_ids\[1, 23\]=23 but that token is number 0 of its sequence"):
        _logits(model, left, attention_mask=mask.flip(-1))


def test_length_dependent_rope_is_refused():
    model = tiny_llama(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    use_attention(model, "dca")
    with pytest.raises(ValueError, match="rope_type='dynamic'"):
        _logits(model, torch.randint(3, 300, (1, 10)))


def test_bf16_follows_fp32():
    q, k, v = qkv(n=40)
    p = attn_patterns.get_algorithm("dca", chunk_size=6, local_window=3, pretraining_length=10)
    out = p(q.bfloat16(), k.bfloat16(), v.bfloat16())
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), p(q, k, v), atol=3e-2, rtol=3e-2)


def test_positions_not_counted_from_the_first_token_are_refused():
    """DCA moves keys from their index to other positions: a sequence rotated elsewhere would
    be computed wrong, silently. (Packed documents, restarting at 0: tests/data/test_packed_sequences.py.)"""
    model = tiny_llama(max_position_embeddings=32)
    use_attention(model, "dca")
    with pytest.raises(ValueError, match=r"position_ids\[0, 0\]=5 but that token is number 0 of its sequence"):
        _logits(model, torch.randint(3, 300, (1, 20)), position_ids=torch.arange(5, 25)[None])


# --- a model that ships DCA: Qwen's dual_chunk_attention_config -------------------------------


@pytest.mark.parametrize("variant, n", [("paper", 200), ("chunkllama", 200), ("qwen", 200), ("qwen", 64)])
def test_variants_equal_their_sources_formulas(variant, n):
    """Logits of our DCA against each source's formulas written densely (scripts/dca_sources.py:
    the paper's eqs.; ChunkLlama's q_t/qc_t/k_t tables and mscale; the engines' tables, key and
    softmax scaling, from the tiny Qwen2's own dual_chunk_attention_config) over 200 tokens."""
    assert SOURCES.agreement(variant, n) < 1e-5


def test_leaving_out_the_logit_scale_is_measurable():
    assert SOURCES.agreement("qwen", 200, logit_scale="none") > 1e-4


def test_qwen_config_is_read_and_said(caplog):
    model = SOURCES.tiny_qwen()
    with caplog.at_level(logging.INFO, logger="sparse_ft.methods.dca"):
        use_attention(model, "dca")
    p = current_method(model).algorithm_for(model.config)
    assert (p.variant, p.sizes(1024), p.logit_scale) == ("qwen", (64, 16, 64), "qwen")
    said = "dca: variant=qwen chunk_size=64 local_window=16 pretraining_length=64 logit_scale=qwen"
    assert said in caplog.text and "original_max_position_embeddings=64" in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]  # no sparse keys: no warning


def test_explicit_parameters_override_the_config():
    config = SOURCES.tiny_qwen().config
    assert methods.get("dca", local_window=8).algorithm_for(config).sizes(1024) == (64, 8, 64)
    assert methods.get("dca", logit_scale="none").algorithm_for(config).logit_scale == "none"
    paper = methods.get("dca", variant="paper")
    assert paper.algorithm_for(config).sizes(1024) == (768, 256, 1024)  # the config is for the qwen variant only
    assert "not used with variant='paper'" in paper.describe(config)
    assert "no dual_chunk_attention_config" in methods.get("dca").describe(tiny_llama().config)


def test_config_forms_and_engine_fallbacks():
    """A dict (how transformers 4.x and 5.x keep the unknown key) or an object; keys the
    config lacks take the engines' fallbacks; original_max_position_embeddings 0 turns the
    scale off as in the engines."""
    as_dict = {"chunk_size": 64, "local_size": 16, "original_max_position_embeddings": 64}
    v4 = SimpleNamespace(rope_scaling=None, rope_theta=1e7, dual_chunk_attention_config=as_dict)
    obj = SimpleNamespace(dual_chunk_attention_config=SimpleNamespace(**as_dict))
    want_params = {"variant": "qwen", "chunk_size": 64, "local_window": 16, "pretraining_length": 64}
    assert params_from_config(model_dca_config(v4)) == params_from_config(model_dca_config(obj)) == want_params
    assert params_from_config({}) == {"variant": "qwen", "chunk_size": 8192, "local_window": 1024, "logit_scale": "none"}
    assert model_dca_config(SimpleNamespace()) is None


@pytest.mark.parametrize("sparse", [{"sparse_attention_enabled": True}, {"sparse_attention_config": [{}]}])
def test_sparse_prefill_keys_are_said_to_be_ignored(sparse, caplog):
    model = SOURCES.tiny_qwen(dca=SOURCES.QWEN_DCA | sparse)
    with caplog.at_level(logging.WARNING, logger="sparse_ft.methods.dca"):
        use_attention(model, "dca")
    assert "does not implement it" in caplog.text and all(key in caplog.text for key in SPARSE_KEYS)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="sparse_ft.methods.dca"):
        use_attention(SOURCES.tiny_qwen(dca=SOURCES.QWEN_DCA | sparse | {"sparse_attention_enabled": False}), "dca")
    assert not caplog.text


def test_cli_says_the_values_it_read(tmp_path, capsys):
    import numpy as np

    from sparse_ft.cli import main
    from sparse_ft.data.token_files import write_token_file

    SOURCES.tiny_qwen().save_pretrained(tmp_path / "qwen")
    tokens = write_token_file(np.arange(3, 303) % 380, tmp_path / "t.bin", 384, "byt5")
    assert main(["eval", "ppl", "--model", str(tmp_path / "qwen"), "--data", str(tokens), "--lengths", "160",
                 "--stride", "160", "--method", "dca"]) == 0
    assert "dca: variant=qwen chunk_size=64 local_window=16 pretraining_length=64 logit_scale=qwen" in capsys.readouterr().out


def test_experiment_has_a_qwen_row():
    from sparse_ft.experiment.run import free_methods

    assert free_methods()["dca_qwen"] == ("dca", {"variant": "qwen"})
