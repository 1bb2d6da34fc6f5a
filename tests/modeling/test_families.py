"""Adding a model family is one entry (docs/architecture.md, "How to add a model family"): once
listed, its tiny model runs the integration checks with no other edit."""

import pytest
import torch

from attn_patterns.rotary import default_inv_freq
from sparse_ft.modeling.families import FAMILIES, Family, add_family, geometry, remove_family
from sparse_ft.modeling.rope import rope_inv_freq, rope_parameters

from tests.modeling.test_attention_integration import check_no_future_leak, check_patterns_match_dense_reference

# Qwen3: normalised queries and keys, and a head width (16) apart from hidden_size / heads (8)
QWEN3 = Family("qwen3", "Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16, "use_sliding_window": False})


@pytest.fixture
def qwen3():
    add_family(QWEN3)
    yield QWEN3
    remove_family(QWEN3.name)


def test_a_listed_family_joins_the_integration_checks(qwen3):
    model = qwen3.tiny_model()
    assert type(model).__name__ == "Qwen3ForCausalLM" and geometry(model.config) == (8, 2, 16)
    # the same checks test_attention_integration runs over every family listed when it is collected
    check_patterns_match_dense_reference(model, "qwen3")
    check_no_future_leak(model)
    # the re-positioning methods rotate with the family's own head width
    theta = rope_parameters(model.config).get("rope_theta", getattr(model.config, "rope_theta", None))
    torch.testing.assert_close(rope_inv_freq(model.config), default_inv_freq(16, theta))


def test_families_are_listed_once_and_read_one_way():
    assert list(FAMILIES)[:3] == ["llama", "mistral", "qwen2"]
    with pytest.raises(ValueError, match="model family 'llama' is already listed"):
        add_family(Family("llama", "LlamaConfig", "LlamaForCausalLM"))
    assert FAMILIES["llama"].settings == {}
    mistral = FAMILIES["mistral"].tiny_config()
    assert mistral.sliding_window is None and geometry(mistral) == (8, 2, 8)
    assert geometry(FAMILIES["llama"].tiny_config(num_key_value_heads=None)) == (8, 8, 8)  # no K/V grouping
