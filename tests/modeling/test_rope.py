"""RoPE scaling written into transformers' config (``sparse_ft.modeling.rope``): linear
extension composes with a model's own scaling, a no-op within context, YaRN and dynamic NTK
as transformers reads them, a scaled model round-trips through save; bad values named; one
table names the methods."""

import pytest
import torch

from sparse_ft.modeling import rope
from sparse_ft.modeling.tiny import tiny_llama, tiny_llama_config


def _inv_freq(model):
    return model.model.rotary_emb.inv_freq.clone()


def test_linear_extension_composes_with_existing_scaling():
    model = tiny_llama()
    base = _inv_freq(model)
    rope.extend_to(model.config, 512, "linear")
    assert rope.refresh_rotary(model) == 1
    assert model.config.max_position_embeddings == 512
    torch.testing.assert_close(_inv_freq(model), base / 2)
    # A second extension multiplies the factor instead of replacing it (LongLoRA's bug).
    params = rope.extend_to(model.config, 2048, "linear")
    rope.refresh_rotary(model)
    assert params["factor"] == 8.0
    assert rope.original_context(model.config) == 256
    torch.testing.assert_close(_inv_freq(model), base / 8)


def test_within_context_is_a_no_op():
    config = tiny_llama_config()
    before = rope.rope_parameters(config)
    assert rope.extend_to(config, 200, "yarn") == before
    assert config.max_position_embeddings == 256


def test_yarn_and_dynamic_write_transformers_config():
    model = tiny_llama()
    base = _inv_freq(model)
    params = rope.extend_to(model.config, 1024, "yarn")
    rope.refresh_rotary(model)
    assert params["rope_type"] == "yarn" and params["factor"] == 4.0
    assert params["original_max_position_embeddings"] == 256
    assert model.model.rotary_emb.attention_scaling > 1.0  # YaRN's temperature
    assert not torch.equal(_inv_freq(model), base)
    # Dynamic NTK must keep max_position_embeddings: transformers reads it as the threshold.
    config = tiny_llama_config()
    rope.extend_to(config, 1024, "dynamic")
    assert config.max_position_embeddings == 256
    assert rope.rope_parameters(config)["factor"] == 4.0


def test_scaled_model_round_trips_through_save(tmp_path):
    model = tiny_llama()
    rope.extend_to(model.config, 1024, "linear")
    rope.refresh_rotary(model)
    model.save_pretrained(tmp_path)
    from transformers import AutoModelForCausalLM

    again = AutoModelForCausalLM.from_pretrained(tmp_path)
    torch.testing.assert_close(_inv_freq(again), _inv_freq(model))
    ids = torch.randint(3, 300, (1, 40))
    torch.testing.assert_close(again(ids).logits, model(ids).logits)


def test_bad_values_name_the_problem():
    config = tiny_llama_config()
    with pytest.raises(ValueError, match="method='ntk'.*linear, dynamic, yarn"):
        rope.extend_to(config, 512, "ntk")
    rope.extend_to(config, 512, "yarn")
    with pytest.raises(ValueError, match="rope_type='yarn'"):
        rope.extend_to(config, 2048, "linear")
    with pytest.raises(ValueError, match="factor=0.5"):
        rope.scale_rope(config, 0.5)
    with pytest.raises(ValueError, match="no rotary-embedding"):
        rope.refresh_rotary(torch.nn.Linear(2, 2))


def test_one_table_names_the_rope_methods():
    """Recipes, the experiment's --rope-method and the training-free pi / ntk / yarn all read
    rope.SCALINGS: together the training-free methods write every kind in it, and none else."""
    from sparse_ft import methods
    from sparse_ft.config.schema import CHOICES
    from sparse_ft.methods.rope_scaling import RopeScaling

    free = map(methods.get, methods.names(lambda supports: not supports.training))
    scalings = [m for m in free if isinstance(m, RopeScaling)]
    assert sorted(m.kind for m in scalings) == sorted(rope.SCALINGS)
    assert CHOICES["model.rope_method"] == tuple(rope.SCALINGS)
