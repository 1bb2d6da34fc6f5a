"""Patterns inside real transformers models, a tiny one of every family in
sparse_ft.modeling.families (Llama, Mistral, Qwen2, with grouped-query attention), against the same
models running a dense masked reference attention."""

import pytest
import torch
import transformers
from transformers import AttentionInterface

import attn_patterns
from attn_patterns.reference import dense_attention
from sparse_ft import methods, use_attention
from sparse_ft.modeling.attention import current_method
from sparse_ft.modeling.families import FAMILIES
from sparse_ft.methods import Method

# Parameters that make each pattern apply to 8 heads and the short test sequences; names not
# listed here run with their defaults, so a newly registered pattern is tested at once.
PARAMS = {
    "sda": {"dilation": 2},
    "mixed": {"parts": [("scca_flow", 0.5), ("sda", 0.5)]},
    "longheads": {"chunk_size": 4, "chunks": 3},
    "dca": {"chunk_size": 12, "local_window": 4, "pretraining_length": 16},
}


# every registered pattern and algorithm
NAMES = [*attn_patterns.names(), *attn_patterns.algorithm_names()]


def pattern_of(name):
    """A pattern as the Pattern object ("causal" too runs through our function); an
    algorithm (DCA, LongHeads) through its method."""
    params = PARAMS.get(name, {})
    return attn_patterns.get(name, **params) if name in attn_patterns.PATTERNS else methods.get(name, **params)


def has_hook(pattern):
    """Methods of their own (DCA, LongHeads) have no fixed mask: their owners test them
    against their own references; here they run forward and backward."""
    return isinstance(pattern, Method)


def _reference_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    mask = module._sparse_ft_method.pattern.mask(query.shape[2], query.shape[1])
    if scaling is not None:  # a family's own softmax scale (patterns take it the same way)
        query = query * (scaling * query.shape[-1] ** 0.5)
    return dense_attention(query, key, value, mask).transpose(1, 2).contiguous(), None


AttentionInterface.register("test_dense_reference", _reference_attention)


def build(kind, seed=0):
    """The tiny model of a listed family (sparse_ft.modeling.families)."""
    return FAMILIES[kind].tiny_model(seed)


def ids_of(shape, seed=1):
    return torch.randint(3, 380, shape, generator=torch.Generator().manual_seed(seed))


def logits_and_grad(model, ids):
    model.zero_grad()
    logits = model(ids).logits
    (logits.float() ** 2).mean().backward()
    return logits.detach(), model.get_input_embeddings().weight.grad.clone()


@pytest.mark.parametrize("kind", list(FAMILIES))
def test_every_pattern_matches_dense_reference_in_model(kind):
    check_patterns_match_dense_reference(build(kind), kind)


def check_patterns_match_dense_reference(model, kind):
    """Every pattern (values and gradients) against the dense masked reference inside ``model``;
    the algorithms (DCA, LongHeads) run forward and backward. A family joins by being listed."""
    ids = ids_of((2, 29))
    for name in NAMES:
        pattern = pattern_of(name)  # a Pattern object: "causal" too runs through our function
        use_attention(model, pattern)
        fast = logits_and_grad(model, ids)
        if has_hook(pattern):
            assert all(torch.isfinite(t).all() for t in fast) and fast[1].abs().sum() > 0, f"{kind}/{name}"
        else:
            model.config._attn_implementation = "test_dense_reference"  # also on transformers 4.5x
            ref = logits_and_grad(model, ids)
            for a, b in zip(fast, ref):
                torch.testing.assert_close(a, b, atol=2e-5, rtol=2e-5, msg=f"{kind}/{name}")
        use_attention(model, "full")
        assert model.config._attn_implementation == "sdpa"


def test_switching_back_restores_original_logits_exactly():
    model = build("llama")
    ids = ids_of((1, 40))
    before = model(ids).logits
    use_attention(model, "s2")
    assert current_method(model) is not None
    assert not torch.equal(model(ids).logits, before)
    use_attention(model, "full")
    assert model.config._attn_implementation == "sdpa" and current_method(model) is None
    assert torch.equal(model(ids).logits, before)


@pytest.mark.parametrize("name", ["scca_fixed", "s2", "sda"])
def test_padded_rows_equal_their_unpadded_runs(name):
    """Right padding (and left padding) of one row leaves its real-token logits as they are
    alone: the pattern's chunks follow the row's own length, and padding is never attended."""
    model = use_attention(build("llama"), name, **PARAMS.get(name, {}))
    ids = ids_of((3, 32))
    mask = torch.ones_like(ids)
    mask[1, 21:] = 0  # right padding: 21 real tokens (chunk 6, not the padded batch's 8)
    mask[2, :7] = 0  # left padding: 25 real tokens, positions from 0 as generate() gives them
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    padded = model(ids, attention_mask=mask, position_ids=positions).logits
    torch.testing.assert_close(padded[0], model(ids[:1]).logits[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(padded[1, :21], model(ids[1:2, :21]).logits[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(padded[2, 7:], model(ids[2:3, 7:]).logits[0], atol=1e-5, rtol=1e-5)
    # Whatever sits in the padding changes nothing.
    garbage = ids.clone()
    garbage[1, 21:], garbage[2, :7] = ids_of((11,), 5), ids_of((7,), 6)
    again = model(garbage, attention_mask=mask, position_ids=positions).logits
    torch.testing.assert_close(again[1, :21], padded[1, :21], atol=0, rtol=0)
    torch.testing.assert_close(again[2, 7:], padded[2, 7:], atol=0, rtol=0)


def test_a_4d_causal_padding_mask_is_read_like_the_2d_one_and_others_are_refused():
    """transformers < 4.53 hands attention functions a 4-D mask; so can a user."""
    model = use_attention(build("llama"), "scca_flow")
    ids = ids_of((2, 24))
    mask = torch.ones_like(ids)
    mask[1, 17:] = 0
    causal = torch.ones(24, 24, dtype=torch.bool).tril()
    visible = causal & mask.bool()[:, None, None, :]
    additive = torch.zeros(2, 1, 24, 24).masked_fill(~visible, torch.finfo(torch.float32).min)
    expected = model(ids, attention_mask=mask).logits
    torch.testing.assert_close(model(ids, attention_mask=additive).logits, expected, atol=1e-6, rtol=1e-6)
    documents = visible.clone()
    documents[:, :, 12:, :12] = False  # two packed documents: not expressible as padding
    with pytest.raises(ValueError, match="not causal attention over a padded batch"):
        model(ids, attention_mask=documents)


def test_two_models_use_their_own_patterns():
    a, b = use_attention(build("llama"), "s2"), use_attention(build("llama"), "sda", dilation=4)
    ids = ids_of((1, 24))
    out_a, out_b = a(ids).logits, b(ids).logits
    assert repr(current_method(a)).startswith("s2") and repr(current_method(b)).startswith("sda")
    assert not torch.allclose(out_a, out_b)
    torch.testing.assert_close(a(ids).logits, out_a, atol=0, rtol=0)
    use_attention(b, "full")
    assert a.config._attn_implementation == "sparse_ft" and b.config._attn_implementation == "sdpa"
    torch.testing.assert_close(a(ids).logits, out_a, atol=0, rtol=0)


def test_future_tokens_do_not_change_earlier_logits():
    check_no_future_leak(build("qwen2"))


def check_no_future_leak(model):
    """Changing the tokens after position t leaves the logits up to t bit-identical, for every
    pattern and algorithm."""
    ids = ids_of((1, 33))
    for name in NAMES:
        use_attention(model, pattern_of(name))
        base = model(ids).logits
        for t in (4, 16, 30):
            changed = ids.clone()
            changed[0, t + 1 :] = ids_of((32 - t,), t)
            torch.testing.assert_close(model(changed).logits[0, : t + 1], base[0, : t + 1], atol=0, rtol=0,
                                       msg=f"{name}: a token after {t} changed logits up to {t}")
        use_attention(model, "full")


def test_generation_with_cache_needs_full_attention():
    model = use_attention(build("llama"), "scca_flow")
    prompt = ids_of((1, 12))
    with pytest.raises(ValueError, match=r"scca_flow.*use_attention\(model, 'full'\)"):
        model.generate(prompt, max_new_tokens=2, do_sample=False)
    use_attention(model, "full")
    assert model.generate(prompt, max_new_tokens=2, do_sample=False).shape[1] == 14


class CausalHook(Method):
    """The smallest method: causal attention over the cache with the padding mask,
    recording what transformers hands over."""

    name = "causal_hook"

    def __init__(self):
        self.calls = []

    def __call__(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        nq, nk = query.shape[2], key.shape[2]
        self.calls.append((module.layer_idx, nq, nk, None if attention_mask is None else attention_mask.dim(),
                           kwargs.get("position_ids")))
        visible = torch.ones(nq, nk, dtype=torch.bool).tril(nk - nq)
        if attention_mask is not None:
            visible = visible & attention_mask[:, None, None, -nk:].bool()
        groups = query.shape[1] // key.shape[1]
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1), attn_mask=visible, scale=scaling)
        return out.transpose(1, 2).contiguous(), None


@pytest.mark.skipif(not hasattr(transformers, "AttentionMaskInterface"), reason="transformers < 4.53 builds 4-D masks")
def test_hook_gets_positions_the_2d_mask_and_decodes_like_full_attention():
    model = build("llama")
    prompt = ids_of((2, 10))
    mask = torch.ones_like(prompt)
    mask[1, 7:] = 0  # right padding: generate() then appends after the padding, as with "full"
    expected = model.generate(prompt, attention_mask=mask, max_new_tokens=4, do_sample=False)
    hook = CausalHook()
    use_attention(model, hook)
    assert current_method(model) is hook
    got = model.generate(prompt, attention_mask=mask, max_new_tokens=4, do_sample=False)
    assert torch.equal(got, expected)
    prefill, step = hook.calls[0], hook.calls[-1]
    assert prefill[:4] == (0, 10, 10, 2) and step[:4] == (1, 1, 13, 2)  # never an N×N mask
    assert step[4] is not None and int(step[4][0, -1]) == 12
    use_attention(model, "full")
    assert torch.equal(model.generate(prompt, attention_mask=mask, max_new_tokens=4, do_sample=False), expected)


def test_peft_wrapped_and_gradient_checkpointed_model_trains():
    from peft import LoraConfig, get_peft_model

    model = build("llama").train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    use_attention(peft_model, "scca_flow")
    assert model.config._attn_implementation == "sparse_ft"
    ids = ids_of((2, 32))
    peft_model(input_ids=ids, labels=ids).loss.backward()
    grads = [p.grad for n, p in peft_model.named_parameters() if "lora_" in n]
    assert grads and all(g is not None and torch.isfinite(g).all() for g in grads)
    assert any(g.abs().sum() > 0 for g in grads)
    use_attention(peft_model, "full")
    assert model.config._attn_implementation == "sdpa"


def test_full_is_the_models_own_attention_and_causal_the_toolkits():
    """One name, one meaning: ``full`` leaves attention to the model and takes no backend;
    causal attention on the toolkit's kernels, with a backend, is the pattern ``causal``."""
    assert not methods.get("full").replaces_attention
    with pytest.raises(ValueError, match="--method full takes no --method-arg; got backend"):
        methods.get("full", backend="sdpa")
    assert methods.for_training("full", {}, "auto", "bfloat16")[1] is None  # the model picks its kernel
    causal = methods.get("causal", backend="sdpa")
    assert causal.replaces_attention and causal.pattern.backend == "sdpa"
    model = build("llama")
    ids = ids_of((1, 24))
    own = model(ids).logits
    torch.testing.assert_close(use_attention(model, causal)(ids).logits, own, atol=1e-5, rtol=1e-5)


def test_evaluating_through_full_drops_a_pattern_installed_before():
    """An evaluation that scores a pattern and then ``full`` on one model (the experiment's own
    pattern column, validation) measures the model's own attention the second time."""
    model = build("llama")
    ids = ids_of((1, 24))
    own = model(ids).logits
    use_attention(model, "s2")
    assert not torch.equal(model(ids).logits, own)
    methods.get("full").apply(model, 24)
    assert current_method(model) is None and torch.equal(model(ids).logits, own)


def test_the_installer_takes_ready_methods_and_names_resolve_with_the_methods():
    """sparse_ft.modeling.attention knows no names (the one-way seam); an algorithm object needs its
    method, which knows what the model must supply."""
    from sparse_ft.modeling import attention

    model = build("llama")
    with pytest.raises(ValueError, match=r"installs a ready method.*sparse_ft.use_attention\(model, name, \*\*params\)"):
        attention.install_method(model, "s2")
    with pytest.raises(ValueError, match=r"use its method: sparse_ft.methods.get\('dca', ...\)"):
        use_attention(model, attn_patterns.get_algorithm("dca"))
    assert current_method(attention.install_method(model, methods.get("s2"))).name == "s2"


def test_errors_name_the_problem():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = build("llama")
    with pytest.raises(ValueError, match="pattern='nope' is unknown; allowed: .*full"):
        use_attention(model, "nope")
    with pytest.raises(ValueError, match="num_heads=8"):
        use_attention(model, "scca_flow", chunks=3)
    assert model.config._attn_implementation == "sdpa"  # a refused switch changes nothing
    with pytest.raises(ValueError, match="PreTrainedModel"):
        use_attention(torch.nn.Linear(2, 2), "s2")
    gpt2 = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=4, vocab_size=64, n_positions=32))
    with pytest.raises(ValueError, match="no rotary embedding"):
        use_attention(gpt2, "s2")
    mistral = FAMILIES["mistral"].tiny_model(sliding_window=16)
    use_attention(mistral, "s2")
    with pytest.raises(ValueError, match="sliding_window=16"):
        mistral(ids_of((1, 24)))
