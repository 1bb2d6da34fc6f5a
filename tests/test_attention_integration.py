"""Patterns inside real transformers models (Llama, Mistral, Qwen2 with grouped-query
attention), against the same models running a dense masked reference attention."""

import pytest
import torch
from transformers import AttentionInterface, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

import attn_patterns
from attn_patterns.reference import dense_attention
from sparse_ft import use_attention
from sparse_ft.attention import current_pattern
from sparse_ft.tiny import tiny_llama, tiny_llama_config

SMALL = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=256)
PARAMS = {"sda": {"dilation": 2}, "mixed": {"parts": [("scca_flow", 0.5), ("sda", 0.5)]}}


def _reference_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    pattern = module._sparse_ft_pattern
    mask = pattern.mask(query.shape[2], query.shape[1])
    return dense_attention(query, key, value, mask).transpose(1, 2).contiguous(), None


AttentionInterface.register("test_dense_reference", _reference_attention)


def build(kind):
    torch.manual_seed(0)
    if kind == "llama":
        return tiny_llama()
    if kind == "mistral":
        return MistralForCausalLM(MistralConfig(**SMALL, sliding_window=None)).eval()
    return Qwen2ForCausalLM(Qwen2Config(**SMALL, use_sliding_window=False)).eval()


def logits_and_grad(model, ids):
    model.zero_grad()
    logits = model(ids).logits
    (logits.float() ** 2).mean().backward()
    return logits.detach(), model.get_input_embeddings().weight.grad.clone()


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2"])
def test_every_pattern_matches_dense_reference_in_model(kind):
    model = build(kind)
    ids = torch.randint(3, 380, (2, 29))
    for name in attn_patterns.names():
        if name == "full":
            continue
        use_attention(model, name, **PARAMS.get(name, {}))
        fast = logits_and_grad(model, ids)
        model.set_attn_implementation("test_dense_reference")
        ref = logits_and_grad(model, ids)
        model.set_attn_implementation("sparse_ft")
        for a, b in zip(fast, ref):
            torch.testing.assert_close(a, b, atol=2e-5, rtol=2e-5, msg=f"{kind}/{name}")
        use_attention(model, "full")


def test_switching_back_restores_original_logits_exactly():
    model = build("llama")
    ids = torch.randint(3, 380, (1, 40))
    before = model(ids).logits
    use_attention(model, "s2")
    assert not torch.equal(model(ids).logits, before)
    use_attention(model, "full")
    assert model.config._attn_implementation == "sdpa" and current_pattern(model) is None
    assert torch.equal(model(ids).logits, before)


def test_right_padding_is_never_attended_and_left_padding_is_refused():
    model = use_attention(build("llama"), "scca_fixed")
    ids = torch.randint(3, 380, (2, 32))
    mask = torch.ones_like(ids)
    mask[1, 20:] = 0
    padded = model(ids, attention_mask=mask).logits
    # Chunk size follows the padded length, so compare against the same layout: a sequence
    # whose tail is different garbage must give the same logits on the real tokens.
    ids2 = ids.clone()
    ids2[1, 20:] = torch.randint(3, 380, (12,))
    torch.testing.assert_close(model(ids2, attention_mask=mask).logits[1, :20], padded[1, :20], atol=0, rtol=0)
    left = torch.ones_like(ids)
    left[0, :4] = 0
    with pytest.raises(ValueError, match="right padding only"):
        model(ids, attention_mask=left)


def test_two_models_use_their_own_patterns():
    a, b = use_attention(build("llama"), "s2"), use_attention(build("llama"), "sda", dilation=4)
    ids = torch.randint(3, 380, (1, 24))
    out_a, out_b = a(ids).logits, b(ids).logits
    assert repr(current_pattern(a)).startswith("s2") and repr(current_pattern(b)).startswith("sda")
    assert not torch.allclose(out_a, out_b)
    torch.testing.assert_close(a(ids).logits, out_a)


@pytest.mark.parametrize("name", ["s2", "scca_fixed", "scca_flow", "longmixed"])
def test_future_tokens_do_not_change_earlier_logits(name):
    model = use_attention(build("qwen2"), name)
    ids = torch.randint(3, 380, (1, 33))
    base = model(ids).logits
    for t in (4, 16, 30):
        changed = ids.clone()
        changed[0, t + 1 :] = torch.randint(3, 380, (32 - t,))
        torch.testing.assert_close(model(changed).logits[0, : t + 1], base[0, : t + 1], atol=0, rtol=0)


def test_generation_with_cache_needs_full_attention():
    model = use_attention(build("llama"), "scca_flow")
    with pytest.raises(ValueError, match="generate with sparse_ft.use_attention\\(model, 'full'\\)"):
        model.generate(torch.randint(3, 380, (1, 12)), max_new_tokens=2, do_sample=False)
    use_attention(model, "full")
    assert model.generate(torch.randint(3, 380, (1, 12)), max_new_tokens=2, do_sample=False).shape[1] == 14


def test_peft_wrapped_and_gradient_checkpointed_model_trains():
    from peft import LoraConfig, get_peft_model

    model = build("llama").train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    use_attention(peft_model, "scca_flow")
    ids = torch.randint(3, 380, (2, 32))
    peft_model(input_ids=ids, labels=ids).loss.backward()
    grads = [p.grad for n, p in peft_model.named_parameters() if "lora_" in n]
    assert grads and all(g is not None and torch.isfinite(g).all() for g in grads)
    assert any(g.abs().sum() > 0 for g in grads)


def test_errors_name_the_problem():
    model = build("llama")
    with pytest.raises(ValueError, match="pattern='nope' is unknown; allowed: full"):
        use_attention(model, "nope")
    with pytest.raises(ValueError, match="num_heads=8 gives 2.66667 heads"):
        use_attention(model, "scca_flow", chunks=3)
    with pytest.raises(ValueError, match="no attention layers|PreTrainedModel"):
        use_attention(torch.nn.Linear(2, 2), "s2")
    assert tiny_llama_config().num_attention_heads == 8
