"""Dense where it pays (sparse_ft/methods/dense_layers.py): in a tiny Llama built from its
config, the layers ``attention.dense_layers`` names see every causal key (float64 dense
reference) while the others see the pattern's keys alone, the dense tail's flag makes every
layer dense, no layer sees a future token; and the rules that refuse a layer outside the model
and place the tail's first step."""

from __future__ import annotations

import re

import pytest
import torch

import attn_patterns
from attn_patterns.reference import dense_attention
from sparse_ft import methods
from sparse_ft.modeling.attention import install_method
from sparse_ft.modeling.tiny import tiny_llama_config

N = 64


@pytest.fixture(scope="module")
def model():
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_llama_config(num_hidden_layers=3, hidden_size=64, intermediate_size=96)).double().eval()


def _calls(model, method, ids):
    """Each layer's (q, k, v, output) of one forward through ``method``."""
    seen = {}

    class Spy(methods.Method):
        replaces_attention = True
        name = method.name

        def check_model(self, config):
            method.check_model(config)

        def __call__(self, module, query, key, value, attention_mask, **kwargs):
            out, _ = method(module, query, key, value, attention_mask, **kwargs)
            seen[module.layer_idx] = (query, key, value, out.transpose(1, 2))
            return out, None

    install_method(model, Spy())
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    return seen, logits


def test_dense_layers_see_every_causal_key_and_the_others_the_pattern(model):
    pattern = attn_patterns.get("scca_flow", chunks=4)
    routed = methods.with_dense_layers(methods.as_method(pattern), [0, 2])
    ids = torch.randint(0, model.config.vocab_size, (1, N), generator=torch.Generator().manual_seed(1))
    seen, logits = _calls(model, routed, ids)
    causal = torch.ones(N, N, dtype=torch.bool).tril()
    sparse = pattern.mask(N, 8) & causal
    assert not torch.equal(sparse.expand(8, N, N), causal.expand(8, N, N))  # the test can tell them apart
    for layer, (q, k, v, out) in seen.items():
        expected = dense_attention(q, k, v, causal if layer in (0, 2) else sparse)
        torch.testing.assert_close(out, expected, atol=1e-10, rtol=1e-10)
        if layer == 1:
            assert not torch.allclose(out, dense_attention(q, k, v, causal))
    later = ids.clone()
    later[0, N // 2:] = (later[0, N // 2:] + 7) % model.config.vocab_size  # future tokens changed: no earlier logit moves
    assert torch.equal(_calls(model, routed, later)[1][0, : N // 2], logits[0, : N // 2])
    routed.everywhere = True  # the dense tail
    for q, k, v, out in _calls(model, routed, ids)[0].values():
        torch.testing.assert_close(out, dense_attention(q, k, v, causal), atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("spec, layers, rule", [
    ([0, 31], 32, None), ("last 2", 32, None), ("last32", 32, None), ([], 4, None),
    ([4], 4, r"layer indices in \[0, 3\], each once \(the model has 4 layers\), or 'last n'"),
    ([-1], None, r"layer indices in \[0, the model's layers - 1\], each once, or 'last n'"),
    ([1, 1], 4, "each once"), ("last 0", None, r"'last n' with n in \[1, the model's layers\]"),
    ("last 5", 4, r"'last n' with n in \[1, 4\] \(the model has 4 layers\)"),
    ("first 2", None, r"a list of layer indices \(e.g. \[0, 5\]\) or 'last n'"), (3, None, "a list of layer indices"),
    ([True], None, "a list of layer indices"),
])
def test_a_dense_layer_outside_the_model_is_refused(spec, layers, rule):
    found = methods.dense_layers_rule(spec, layers)
    assert found is None if rule is None else re.search(rule, found)


def test_the_dense_tail_starts_at_the_last_fraction_of_the_steps():
    assert [methods.dense_tail_start(f, 10) for f in (0.0, 0.05, 0.1, 0.3, 0.5, 1.0)] == [10, 10, 9, 7, 5, 0]
    assert methods.dense_layer_indices("last 2", 5) == [3, 4] and methods.dense_layer_indices([3, 0], 5) == [0, 3]
    with pytest.raises(ValueError, match=r"attention.dense_layers=\(5,\): layer indices in \[0, 4\]"):
        methods.dense_layer_indices([5], 5)
