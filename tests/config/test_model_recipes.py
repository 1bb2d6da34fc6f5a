"""The recipes for today's models (recipes/models/): each loads, names its model and the RoPE its
authors extend it with, the planner's shape table holds the model's config.json, and the RoPE the
trainer writes from that config is the one docs/your-model.md states; each has its plan committed.
No hub is reachable here, so the configs are rebuilt from the numbers their repositories state."""

import json

import pytest

from sparse_ft.config import REPO_ROOT, load_recipe
from sparse_ft.modeling import rope
from sparse_ft.plan.geometry import KNOWN
from sparse_ft.train.model_setup import training_method

# config.json of each repository, as docs/your-model.md cites it
CONFIGS = {
    "meta-llama/Llama-3.1-8B": ("LlamaConfig", dict(
        num_hidden_layers=32, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336,
        vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192})),
    "Qwen/Qwen2.5-7B": ("Qwen2Config", dict(
        num_hidden_layers=28, hidden_size=3584, num_attention_heads=28, num_key_value_heads=4, intermediate_size=18944,
        vocab_size=152064, max_position_embeddings=131072, rope_theta=1e6, use_sliding_window=False)),
    "Qwen/Qwen3-8B": ("Qwen3Config", dict(
        num_hidden_layers=36, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        intermediate_size=12288, vocab_size=151936, max_position_embeddings=40960, rope_theta=1e6)),
    "mistralai/Mistral-7B-v0.3": ("MistralConfig", dict(
        num_hidden_layers=32, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336,
        vocab_size=32768, max_position_embeddings=32768, rope_theta=1e6, sliding_window=None)),
}
# recipe stem -> (hub id, RoPE type and factor written at 32k, at 64k, the window they extend from)
MODELS = {
    "llama31_8b": ("meta-llama/Llama-3.1-8B", ("llama3", 8.0), ("llama3", 8.0), 8192),
    "qwen25_7b": ("Qwen/Qwen2.5-7B", ("default", 1.0), ("yarn", 2.0), 32768),
    "qwen3_8b": ("Qwen/Qwen3-8B", ("default", 1.0), ("yarn", 2.0), 32768),
    "mistral_7b_v03": ("mistralai/Mistral-7B-v0.3", ("default", 1.0), ("yarn", 2.0), 32768),
}
RECIPES = [(stem, k) for stem in MODELS for k in (32, 64)]


def _config(hub_id: str):
    import transformers

    cls, fields = CONFIGS[hub_id]
    return getattr(transformers, cls)(**fields)


@pytest.mark.parametrize("hub_id", CONFIGS)
def test_the_planners_table_holds_each_config(hub_id):
    config, shape = _config(hub_id), KNOWN[hub_id]
    assert (shape.layers, shape.hidden, shape.heads, shape.kv_heads, shape.intermediate, shape.vocab, shape.tied) == (
        config.num_hidden_layers, config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
        config.intermediate_size, config.vocab_size, False)
    assert shape.head_dim == (getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)


@pytest.mark.parametrize("stem,k", RECIPES)
def test_each_recipe_extends_its_model_as_its_authors_do(stem, k):
    hub_id, at32, at64, window = MODELS[stem]
    r = load_recipe(f"{stem}_{k}k")
    assert r.model.name_or_path == hub_id and r.model.target_length == k * 1024 == r.data.min_tokens
    assert (r.model.dtype, r.deepspeed, r.train.gpus, r.train.output_dir) == ("bfloat16", "zero3_bf16", 8, f"runs/{stem}_{k}k")
    training_method(r).pattern.check_heads(KNOWN[hub_id].heads)
    config = _config(hub_id)
    params = rope.extend_to(config, r.model.target_length, r.model.rope_method, r.model.native_length)
    assert (params["rope_type"], params["factor"]) == (at32 if k == 32 else at64)
    assert rope.original_context(config) == window and config.max_position_embeddings >= r.model.target_length
    if params["rope_type"] == "yarn":  # Qwen's own setting: factor = length / 32768 over 32768
        assert params["original_max_position_embeddings"] == 32768 and config.max_position_embeddings == 65536


@pytest.mark.parametrize("stem,k", RECIPES)
def test_each_recipe_has_its_plan_committed(stem, k):
    name = f"{stem}_{k}k"
    plan = json.loads((REPO_ROOT / "results" / "plan" / f"{name}.json").read_text())
    assert plan["recipe"] == name and plan["setup"]["shape"]["source"].endswith(f"{MODELS[stem][0]}/config.json")
    assert plan["setup"]["world_size"] == 8 and [b["seq_len"] for b in plan["breakdown"]] == [k * 1024]
    assert max(b["total_gib"] for b in plan["breakdown"]) < 80 * 0.9
    assert (REPO_ROOT / "results" / "plan" / f"{name}.md").read_text().startswith(f"sparse-ft plan: {name} ")


def test_llama3_scaling_is_left_as_it_is_within_its_window():
    """Llama-3.1's llama3 scaling (128k) at 64k: factor 1, nothing to compose, whatever the method."""
    for method in rope.SCALINGS:
        config = _config("meta-llama/Llama-3.1-8B")
        before = rope.rope_parameters(config)
        assert rope.extend_to(config, 65536, method) == before and config.max_position_embeddings == 131072
    with pytest.raises(ValueError, match="cannot compose rope method='yarn' with the model's existing rope_type='llama3'"):
        rope.extend_to(_config("meta-llama/Llama-3.1-8B"), 262144, "yarn")


def test_native_length_is_refused_where_the_config_states_its_own_window():
    with pytest.raises(ValueError, match="native_length=32768 is for a model with plain RoPE; this one has rope_type='llama3'"):
        rope.extend_to(_config("meta-llama/Llama-3.1-8B"), 65536, "yarn", 32768)
