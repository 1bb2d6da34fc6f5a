import json

import pytest

from sparse_ft.config import RECIPE_DIRS, find_recipe, load_recipe, parse_overrides, resolve_deepspeed_config, save_resolved

ALL = sorted(p.stem for p in RECIPE_DIRS[0].rglob("*.yaml"))


@pytest.mark.parametrize("name", ALL)
def test_every_shipped_recipe_validates(name):
    recipe = load_recipe(name)
    assert recipe.name == name and recipe.seq_len >= 2
    if recipe.deepspeed:
        config = resolve_deepspeed_config(recipe, world_size=8, on_cuda=True)
        assert config["optimizer"]["params"]["lr"] == recipe.train.lr
        assert "scheduler" not in config  # the schedule is the recipe's, built by the trainer
        assert config["train_batch_size"] == 8 * recipe.train.per_device_batch_size * recipe.train.gradient_accumulation_steps


def test_paper_recipes_exist_with_paper_settings():
    for name in ("scca_flow_8k", "scca_fixed_8k", "longmixed_8k", "s2_8k", "full_8k"):
        recipe = load_recipe(name)
        assert recipe.model.name_or_path == "meta-llama/Llama-2-7b-hf" and recipe.model.target_length == 8192
        assert recipe.train.lr == 2e-5 and recipe.train.warmup_steps == 20 and recipe.train.per_device_batch_size == 1
        assert recipe.data.min_tokens == 8192 and recipe.model.dtype == "float16"
        assert load_recipe(name).deepspeed == "zero3_fp16"
    assert load_recipe("scca_flow_8k").attention.pattern == "scca_flow"
    assert load_recipe("scca_flow_32k_a100").model.target_length == 32768
    assert load_recipe("scca_flow_8k_a100").model.dtype == "bfloat16"


def test_overrides_reach_any_dotted_key():
    recipe = load_recipe("tiny", ["train.lr=2e-4", "attention.params.chunks=8", "deepspeed=null",
                                  "lora.target_modules=[q_proj,v_proj]", "train.max_steps=3"])
    assert recipe.train.lr == 2e-4 and recipe.attention.params == {"chunks": 8}
    assert recipe.deepspeed is None and recipe.lora.target_modules == ["q_proj", "v_proj"]
    assert parse_overrides(["a.b.c=1", "a.d=x"]) == {"a": {"b": {"c": 1}, "d": "x"}}


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["train.lrr=1"], r"unknown recipe key train.lrr \(did you mean train.lr\?\); allowed in train: output_dir"),
        (["bogus=1"], r"unknown recipe key bogus"),
        (["model.dtype=fp8"], r"model.dtype='fp8' is invalid: allowed: float32, float16, bfloat16"),
        (["train.scheduler=step"], r"train.scheduler='step' is invalid: allowed: constant, linear, cosine"),
        (["train.per_device_batch_size=0"], r"train.per_device_batch_size=0 is invalid: must be >= 1"),
        (["train.max_steps=abc"], r"train.max_steps='abc' is invalid: expected int, got str"),
        (["attention.pattern=scca"], r"attention.pattern / attention.params: pattern='scca' is unknown"),
        (["attention.params.chunks=0"], r"chunks=0 must be an integer >= 1"),
        (["deepspeed=zero9"], r"deepspeed='zero9': no such file; known configs: zero2_bf16"),
        (["train.report_to=[mlflow]"], r"train.report_to=\['mlflow'\] is invalid: entries allowed"),
        (["model.dtype=bfloat16"], None),  # valid alone; clashes with the fp32 DeepSpeed config below
        (["noequals"], r"must look like dotted.key=value"),
    ],
)
def test_bad_values_name_key_value_and_allowed(overrides, message):
    if message is None:
        recipe = load_recipe("tiny", overrides)
        with pytest.raises(ValueError, match=r"model.dtype='bfloat16' is invalid: deepspeed config zero3_cpu_fp32 trains in float32"):
            resolve_deepspeed_config(recipe, 2, on_cuda=False)
        return
    with pytest.raises(ValueError, match=message):
        load_recipe("tiny", overrides)


def test_unknown_recipe_suggests(tmp_path):
    with pytest.raises(ValueError, match=r"recipe='scca_flow_8' not found under recipes/ \(did you mean scca_flow_8k"):
        find_recipe("scca_flow_8")
    with pytest.raises(FileNotFoundError):
        find_recipe(str(tmp_path / "missing.yaml"))


def test_inherit_and_resolved_round_trip(tmp_path):
    child = tmp_path / "child.yaml"
    child.write_text("inherit: tiny\ntrain:\n  max_steps: 2\nattention:\n  pattern: s2\n  params: {}\n")
    recipe = load_recipe(str(child))
    assert recipe.train.max_steps == 2 and recipe.train.lr == load_recipe("tiny").train.lr
    assert recipe.attention.pattern == "s2" and recipe.attention.params == {}
    path = save_resolved(recipe, tmp_path / "out")
    again = load_recipe(str(path))
    assert again.to_dict() | {"name": ""} == recipe.to_dict() | {"name": ""}


def test_cpu_deepspeed_config_uses_torch_adamw():
    config = resolve_deepspeed_config(load_recipe("tiny"), 2, on_cuda=False)
    assert config["optimizer"]["params"]["torch_adam"] is True
    assert json.dumps(config)  # serialisable as DeepSpeed needs
