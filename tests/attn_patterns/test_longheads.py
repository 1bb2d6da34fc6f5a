"""LongHeads: dense per-query reference, equality with full attention within k·l, cached
decoding = re-prefill, no leak from future tokens, validation."""

import math

import pytest
import torch

import attn_patterns
from attn_patterns.longheads import LongHeads, rerotate
from sparse_ft import use_attention
from sparse_ft.modeling.rope import rope_inv_freq
from sparse_ft.modeling.tiny import tiny_llama

INV_FREQ = 1.0 / (10000.0 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))


def _rot(x, pos):
    return rerotate(x, pos, INV_FREQ)


def reference(q_raw, k_raw, v, l, k_chunks, keep_previous=False):
    """Straight from the paper, one (batch, head, query) at a time: chunk representations
    with chunk-local RoPE, selection by q·c, keys re-positioned contiguously."""
    b, h, n, d = q_raw.shape
    groups = h // k_raw.shape[1]
    out = torch.zeros_like(q_raw)
    local = torch.arange(l)
    for bi in range(b):
        for hi in range(h):
            qh, kh, vh = q_raw[bi, hi], k_raw[bi, hi // groups], v[bi, hi // groups]
            reps = []
            for c in range(n // l):
                part = slice(c * l, (c + 1) * l)
                ql, kl = _rot(qh[part], local), _rot(kh[part], local)
                o = torch.softmax(ql @ kl.T / math.sqrt(d), -1) @ vh[part]
                qc = o.mean(0)
                reps.append(torch.softmax(kl @ qc / math.sqrt(d), -1) @ kl)
            for p in range(n):
                m = p // l
                forced = ([0] if m > 0 else []) + ([m - 1] if keep_previous and m >= 2 else [])
                others = [c for c in range(1, m) if c not in forced]
                free = k_chunks - 1 - len(forced)
                if len(others) > free:
                    scores = torch.stack([qh[p] @ reps[c] for c in others])
                    others = [others[i] for i in scores.topk(free).indices.tolist()]
                chosen = sorted(forced + others)
                keys = [c * l + j for c in chosen for j in range(l)] + list(range(m * l, p + 1))
                new_pos = torch.arange(len(keys))
                kk = _rot(kh[keys], new_pos)
                qq = _rot(qh[p : p + 1], new_pos[-1:])
                w = torch.softmax(qq @ kk.T / math.sqrt(d), -1)
                out[bi, hi, p] = (w @ vh[keys])[0]
    return out


def _qkv(n, b=2, h=4, hkv=2, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, n, d, generator=g)
    k = torch.randn(b, hkv, n, d, generator=g)
    v = torch.randn(b, hkv, n, d, generator=g)
    return q, k, v


@pytest.mark.parametrize("keep_previous", [False, True])
def test_matches_dense_reference_beyond_window(keep_previous):
    l, k_chunks, n = 4, 4, 37  # 9 complete chunks + a partial one; window 16 < 37
    q_raw, k_raw, v = _qkv(n)
    pos = torch.arange(n)
    algorithm = LongHeads(chunk_size=l, chunks=k_chunks, keep_previous=keep_previous)
    out = algorithm.attend(_rot(q_raw, pos), _rot(k_raw, pos), v, inv_freq=INV_FREQ)
    torch.testing.assert_close(out, reference(q_raw, k_raw, v, l, k_chunks, keep_previous), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("keep_previous", [False, True])
@pytest.mark.parametrize("l, hkv, budget, sizes", [(4, 4, None, [21]), (5, 2, 13000, [3] * 5 + [2]), (4, 1, 1, [1] * 21)])
def test_attend_call_rows_and_small_steps_match_reference(keep_previous, l, hkv, budget, sizes, monkeypatch):
    """The vectorised attention against the per-query reference for a call's last Nq rows
    (chunked prefill, decoding), with and without GQA, in one step and in steps of 3 rows and
    of 1 row (steps that start and end inside chunks)."""
    from attn_patterns import longheads

    if budget:
        monkeypatch.setattr(longheads, "_BLOCK_ELEMENTS", budget)
    k_chunks, n = 4, 37
    steps = longheads._plan(start=0, nk=n, chunk_size=l, chunks=k_chunks, batch_heads=8, head_dim=16)
    assert steps[0][0] == k_chunks * l and [b - a for a, b in steps] == sizes
    assert all(a == b for (_, a), (b, _) in zip(steps, steps[1:]))
    q_raw, k_raw, v = _qkv(n, hkv=hkv, seed=7)
    pos = torch.arange(n)
    q, k = _rot(q_raw, pos), _rot(k_raw, pos)
    whole = n // l * l
    reps = longheads.chunk_representations(q[:, :, :whole], k[:, :, :whole], v[:, :, :whole], chunk_size=l, first_chunk=0,
                                           inv_freq=INV_FREQ)
    expected = reference(q_raw, k_raw, v, l, k_chunks, keep_previous)
    for nq in (n, 23, 13, 1):
        out = longheads.longheads_attention(q[:, :, n - nq :], k, v, reps=reps, chunk_size=l, chunks=k_chunks, inv_freq=INV_FREQ,
                                            scale=0.25, keep_previous=keep_previous)
        torch.testing.assert_close(out, expected[:, :, n - nq :], atol=2e-5, rtol=1e-4)


def test_many_chunks_and_tiles_match_reference():
    """Beyond the window for most rows (k·l = 12 of 150 tokens, 4 query heads on 1 KV head),
    so pairs share chunks across heads and rows and are cut into several tiles per chunk."""
    l, k_chunks, n = 4, 3, 150
    q_raw, k_raw, v = _qkv(n, b=1, hkv=1, seed=11)
    pos = torch.arange(n)
    out = LongHeads(chunk_size=l, chunks=k_chunks).attend(_rot(q_raw, pos), _rot(k_raw, pos), v, inv_freq=INV_FREQ)
    torch.testing.assert_close(out, reference(q_raw, k_raw, v, l, k_chunks, keep_previous=True), atol=2e-5, rtol=1e-4)


def test_gradients_match_reference():
    """With gradients (the math kernels, fresh tensors instead of the reused buffers) the
    output and the gradients of q, k and v equal the per-query reference's; the selection
    is piecewise constant, so neither passes a gradient through it."""
    l, k_chunks, n = 4, 3, 23
    q_raw, k_raw, v = (x.requires_grad_() for x in _qkv(n, b=1, seed=3))
    pos = torch.arange(n)
    out = LongHeads(chunk_size=l, chunks=k_chunks).attend(_rot(q_raw, pos), _rot(k_raw, pos), v, inv_freq=INV_FREQ)
    expected = reference(q_raw, k_raw, v, l, k_chunks, keep_previous=True)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(4))
    got = torch.autograd.grad((out * weights).sum(), (q_raw, k_raw, v))
    want = torch.autograd.grad((expected * weights).sum(), (q_raw, k_raw, v))
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-4)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)


def test_steps_stay_few_and_whole_chunks_on_a_gpu_budget():
    """32k tokens, 32 heads of 128 on the GPU budget: 14 steps of 2,048 rows (8 chunks each),
    where the step planner that counted each block's own gather of K/V made 2,713 steps of 8
    rows. Rows within the window are one causal call, no step; a call that starts inside a
    chunk (chunked prefill) gets one step up to the next chunk boundary."""
    from attn_patterns import longheads

    def plan(start, nk):
        return longheads._plan(start=start, nk=nk, chunk_size=256, chunks=16, batch_heads=32, head_dim=128,
                               budget=longheads._CUDA_BLOCK_ELEMENTS)

    steps = plan(0, 32768)
    assert len(steps) == 14 and steps[0] == (4096, 6144) and steps[-1][1] == 32768
    assert plan(0, 4096) == [] and plan(32767, 32768) == [(32767, 32768)]
    assert plan(5000, 9000) == [(5000, 5120), (5120, 7168), (7168, 9000)]


def test_tiles_bound_padding():
    from attn_patterns.longheads import _tiles

    def rows(counts):
        size, tiles, total = _tiles(torch.tensor(counts))
        assert tiles.tolist() == [-(-c // size) for c in counts] and total == sum(tiles.tolist())
        return size

    assert rows([4, 4, 0]) == 4  # decoding: a tile per group, no padding
    assert rows([5, 0, 3]) == 8  # padding 8 pairs to 16 costs less than a tile more
    assert rows([640, 512, 1024]) == 512  # 5 tiles of 512 beat 9 of 256 and 3 of 1024 (a third padding)
    assert rows([40000, 9]) == 1024  # the cap


def test_selection_is_per_head_and_keeps_first_and_previous():
    from attn_patterns.longheads import select_chunks

    def ids(mask):
        return [row.nonzero().flatten().tolist() for row in mask]

    scores = torch.tensor([[0.0, 5.0, 1.0, 4.0, 3.0, -1.0], [0.0, 1.0, 5.0, 2.0, 4.0, -1.0]])  # 2 heads, m = 6
    assert ids(select_chunks(scores, 6, 4)) == [[0, 1, 3], [0, 2, 4]]
    assert ids(select_chunks(scores, 6, 4, keep_previous=True)) == [[0, 1, 5], [0, 2, 5]]
    assert ids(select_chunks(scores, 2, 4)) == [[0, 1], [0, 1]]  # fewer chunks than k: all
    assert ids(select_chunks(scores, 0, 4)) == [[], []]
    # one call for rows of different chunks (m per row), as attend selects a whole step
    assert ids(select_chunks(scores, torch.tensor([6, 3]), 4, keep_previous=True)) == [[0, 1, 5], [0, 1, 2]]


def test_equals_causal_attention_within_window():
    l, k_chunks, n = 4, 5, 19  # n <= k·l: every chunk selected, no shift
    q_raw, k_raw, v = _qkv(n, seed=1)
    pos = torch.arange(n)
    q, k = _rot(q_raw, pos), _rot(k_raw, pos)
    out = LongHeads(chunk_size=l, chunks=k_chunks).attend(q, k, v, inv_freq=INV_FREQ)
    dense = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True)
    torch.testing.assert_close(out, dense, atol=1e-5, rtol=1e-5)


def test_validation_names_both_values():
    with pytest.raises(ValueError, match=r"chunks=8 × chunk_size=64 = 512 must be <= pretraining_length=256"):
        attn_patterns.get_algorithm("longheads", chunk_size=64, chunks=8, pretraining_length=256)
    with pytest.raises(ValueError, match="chunks=1"):
        LongHeads(chunk_size=4, chunks=1)


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def test_model_within_pretraining_length_equals_full():
    model = tiny_llama()
    ids = torch.randint(3, 259, (2, 120), generator=torch.Generator().manual_seed(0))
    full = _logits(model, ids)
    use_attention(model, "longheads", chunk_size=32, chunks=4)  # 4·32 = 128 >= 120
    torch.testing.assert_close(_logits(model, ids), full, atol=1e-5, rtol=1e-5)
    use_attention(model, "full")


def test_default_chunks_fill_pretraining_length_and_reject_too_big():
    model = tiny_llama()
    ids = torch.randint(3, 259, (1, 40))
    use_attention(model, "longheads", chunk_size=512)
    with pytest.raises(ValueError, match="pretraining_length=256"):
        _logits(model, ids)
    use_attention(model, "full")


@pytest.mark.parametrize("method", [None, "linear", "yarn"])
def test_inv_freq_from_config_matches_model(method):
    from sparse_ft.modeling import rope

    model = tiny_llama()
    if method:
        rope.scale_rope(model.config, 2.0, method)
        rope.refresh_rotary(model)
    torch.testing.assert_close(rope_inv_freq(model.config), model.model.rotary_emb.inv_freq.float())


@pytest.fixture(scope="module")
def long_model():
    """Window k·l = 32 tokens, sequences of 70: selection and remapping are active."""
    model = tiny_llama(seed=1)
    use_attention(model, "longheads", chunk_size=8, chunks=4)
    return model


def test_cached_decoding_equals_reprefill(long_model):
    ids = torch.randint(3, 259, (2, 62), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        out = long_model(ids[:, :50], use_cache=True)
        cache, steps = out.past_key_values, [out.logits[:, -1]]
        for t in range(50, 62):  # crosses the chunk boundary at 56
            out = long_model(ids[:, t : t + 1], past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            steps.append(out.logits[:, -1])
        full = long_model(ids).logits
    torch.testing.assert_close(torch.stack(steps, 1), full[:, 49:62], atol=1e-4, rtol=1e-4)


def test_generate_runs_and_matches_greedy_reprefill(long_model):
    ids = torch.randint(3, 259, (1, 45), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        gen = long_model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
        seq = ids
        for _ in range(4):
            nxt = long_model(seq).logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat((seq, nxt), 1)
    assert torch.equal(gen, seq)


def test_future_tokens_do_not_change_earlier_outputs(long_model):
    ids = torch.randint(3, 259, (1, 70), generator=torch.Generator().manual_seed(4))
    changed = ids.clone()
    changed[:, 41:] = torch.randint(3, 259, (1, 29), generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(_logits(long_model, changed)[:, :41], _logits(long_model, ids)[:, :41], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(_logits(long_model, changed)[:, 41:], _logits(long_model, ids)[:, 41:])


def test_out_of_sync_cache_is_an_error(long_model):
    ids = torch.randint(3, 259, (1, 20))
    with torch.no_grad():
        cache = long_model(ids, use_cache=True).past_key_values
        long_model(ids[:, :5])  # another sequence resets the layers' state
        with pytest.raises(ValueError, match="cache holds 20 tokens"):
            long_model(ids[:, :1], past_key_values=cache, use_cache=True)


def test_passkey_through_evaluation_path():
    from sparse_ft import methods
    from sparse_ft.evaluation.tasks.passkey import Passkey
    from sparse_ft.modeling.tiny import tiny_tokenizer

    method = methods.get("longheads", chunk_size=32, chunks=4)
    model = tiny_llama()
    cells = Passkey([400], [0.5], trials=1).evaluate(model, tiny_tokenizer(), method)
    assert cells[0]["prompt_tokens"] > 256  # beyond the tiny model's pretraining length


def test_padded_batch_equals_unpadded(long_model):
    g = torch.Generator().manual_seed(6)
    a, b = torch.randint(3, 259, (1, 66), generator=g), torch.randint(3, 259, (1, 45), generator=g)
    batch = torch.cat((a, torch.cat((b, torch.zeros(1, 21, dtype=torch.long)), 1)))
    mask = torch.ones_like(batch)
    mask[1, 45:] = 0
    with torch.no_grad():
        padded = long_model(batch, attention_mask=mask).logits
        alone = long_model(b).logits
    torch.testing.assert_close(padded[1, :45], alone[0], atol=1e-5, rtol=1e-5)
    left = torch.stack((a[0], torch.cat((torch.zeros(21, dtype=torch.long), b[0]))))  # as generate pads
    positions = (mask.flip(1).cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        padded = long_model(left, attention_mask=mask.flip(1), position_ids=positions).logits
    torch.testing.assert_close(padded[1, 21:], alone[0], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="positions must count from each sequence's first real token"):
        long_model(left, attention_mask=mask.flip(1))


def test_previous_chunk_is_kept_by_default_as_the_authors_do():
    """The authors' code forces chunks m-1 and m (and 0); the paper-only selection stays as
    keep_previous=False."""
    assert LongHeads().keep_previous and not LongHeads(keep_previous=False).keep_previous
    with pytest.raises(ValueError, match="chunks=2 must be >= 3"):
        LongHeads(chunk_size=4, chunks=2)
    assert LongHeads(chunk_size=4, chunks=2, keep_previous=False).chunks == 2
