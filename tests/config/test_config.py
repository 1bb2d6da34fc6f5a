"""Recipe loading: overrides, inherit, validation messages, the resolved round trip, and the
DeepSpeed config filled from the recipe. (The shipped recipes: tests/config/test_recipes.py.)"""

import json

import pytest

from sparse_ft import config as cfg
from sparse_ft.config import find_recipe, format_recipe, load_recipe, parse_overrides, save_resolved
from sparse_ft.train.deepspeed import resolve_deepspeed_config
from sparse_ft.train.model_setup import training_method


def test_overrides_reach_any_dotted_key_with_yaml_types():
    recipe = load_recipe("tiny", ["train.lr=2e-4", "attention.params.chunks=8", "deepspeed=null", "train.max_steps=3",
                                  "lora.target_modules=[q_proj,v_proj]", "train.report_to=none", "data.seq_len=256",
                                  "train.gradient_checkpointing=true", "model.tiny.num_hidden_layers=1"])
    assert recipe.train.lr == 2e-4 and isinstance(recipe.train.lr, float)  # YAML 1.1 reads 2e-4 as a string
    assert recipe.attention.params == {"chunks": 8} and recipe.deepspeed is None and recipe.train.max_steps == 3
    assert recipe.lora.target_modules == ["q_proj", "v_proj"] and recipe.train.report_to == ["none"]
    assert recipe.seq_len == 256 and recipe.train.gradient_checkpointing is True
    assert recipe.model.tiny == {"num_hidden_layers": 1}
    assert parse_overrides(["a.b.c=1", "a.d=x", "e="]) == {"a": {"b": {"c": 1}, "d": "x"}, "e": ""}


def test_params_merge_and_a_new_pattern_starts_from_its_defaults():
    assert load_recipe("tiny", ["attention.params.backend=sdpa"]).attention.params == {"chunks": 4, "backend": "sdpa"}
    # scca_flow's chunks mean nothing to sda: switching the pattern drops them ...
    assert load_recipe("tiny", ["attention.pattern=sda"]).attention.params == {}
    # ... unless the same layer gives the new pattern its own
    assert load_recipe("tiny", ["attention.pattern=sda", "attention.params.dilation=4"]).attention.params == {"dilation": 4}
    assert load_recipe("tiny", ["attention.pattern=scca_flow"]).attention.params == {"chunks": 4}  # unchanged pattern


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["train.lrr=1"], r"unknown recipe key train.lrr \(did you mean train.lr\?\); allowed in train: output_dir, max_steps"),
        (["model.dtyp=float16"], r"unknown recipe key model.dtyp \(did you mean model.dtype\?\)"),
        (["bogus=1"], r"unknown recipe key bogus; allowed in the recipe: model, attention, lora, data, train, validation, deepspeed"),
        (["model.dtype=fp8"], r"model.dtype='fp8' is invalid: allowed: float32, float16, bfloat16"),
        (["model.rope_method=ntk"], r"model.rope_method='ntk' is invalid: allowed: linear, dynamic, yarn"),
        (["attention.backend=xla"], r"attention.backend='xla' is invalid: allowed: None, auto, sdpa, flash, flex, triton"),
        (["train.scheduler=step"], r"train.scheduler='step' is invalid: allowed: constant, linear, cosine"),
        (["train.weight_decay_on=norms"], r"train.weight_decay_on='norms' is invalid: allowed: all, matrices"),
        (["train.min_lr_ratio=1.5"], r"train.min_lr_ratio=1.5 is invalid: must be in \[0, 1\]"),
        (["train.min_lr_ratio=0.1", "train.scheduler=constant"],
         r"train.min_lr_ratio=0.1 is invalid: only applies with train.scheduler linear or cosine"),
        (["train.per_device_batch_size=0"], r"train.per_device_batch_size=0 is invalid: must be >= 1"),
        (["train.max_steps=abc"], r"train.max_steps='abc' is invalid: expected int, got str"),
        (["train.max_steps=true"], r"train.max_steps=True is invalid: expected int, got bool"),
        (["train.max_steps=0"], r"train.max_steps=0 is invalid: must be >= 1, or -1 to run train.num_epochs"),
        (["lora.dropout=1.5"], r"lora.dropout=1.5 is invalid: must be in \[0, 1\)"),
        (["lora.target_modules=[q_proj,3]"], r"lora.target_modules\[1\]=3 is invalid: expected str, got int"),
        (["lora.target_modules=[]"], r"lora.target_modules=\[\] is invalid: at least one module name"),
        (["data.seq_len=1024"], r"data.seq_len=1024 is invalid: must be in \[2, model.target_length=512\]"),
        (["train.report_to=[mlflow]"], r"train.report_to=\['mlflow'\] is invalid: entries allowed: tensorboard, wandb, none"),
        (["train.max_grad_norm=0"], r"train.max_grad_norm=0.0 is invalid: must be > 0"),
        (["train.betas=[0.9]"], r"train.betas=\[0.9\] is invalid: two numbers in \[0, 1\)"),
        (["model=llama"], r"recipe key model='llama' is invalid: expected a mapping with keys name_or_path, dtype"),
        (["attention.pattern=scca"], r"attention.pattern / attention.params: pattern='scca' is unknown; allowed: .*scca_flow"),
        (["attention.params.chunk=8"], r"attention.params: scca_flow: parameter\(s\) chunk unknown; allowed: chunks, backend"),
        (["attention.params.chunks=0"], r"chunks=0 must be an integer >= 1"),
        (["deepspeed=zero9"], r"deepspeed='zero9': no such file; known configs: zero2_bf16, zero2_fp16"),
        (["model.dtype=bfloat16"], r"model.dtype='bfloat16' is invalid: deepspeed config zero3_cpu_fp32 trains in float32"),
        (["model.tiny.hidden_size=32", "model.name_or_path=gpt2"], r"model.tiny=.* only applies with model.name_or_path=tiny"),
        (["noequals"], r"must look like dotted.key=value"),
    ],
)
def test_bad_values_name_key_value_and_allowed(overrides, message):
    with pytest.raises(ValueError, match=message):
        load_recipe("tiny", overrides)


def test_values_at_the_edges_are_accepted(tmp_path):
    checkpoint = tmp_path / "checkpoint-4"
    checkpoint.mkdir()
    (checkpoint / "meta.json").write_text("{}")
    recipe = load_recipe("tiny", ["train.save_total_limit=0", f"train.resume={checkpoint}",  # 0: keep every checkpoint
                                  "model.tiny={rope_theta: 500000.0, num_key_value_heads: 8, vocab_size: 512}"])
    assert recipe.train.save_total_limit == 0 and recipe.train.resume == str(checkpoint)
    assert recipe.model.tiny["vocab_size"] == 512


def test_matching_overrides_together_are_fine():
    recipe = load_recipe("tiny", ["model.dtype=bfloat16", "deepspeed=zero3_bf16"])
    assert resolve_deepspeed_config(recipe, 1, on_cuda=False)["bf16"] == {"enabled": True}


def test_unknown_recipe_suggests(tmp_path):
    with pytest.raises(ValueError, match=r"recipe='scca_flow_8' not found under recipes/ \(did you mean scca_flow_8k"):
        find_recipe("scca_flow_8")
    with pytest.raises(FileNotFoundError):
        find_recipe(str(tmp_path / "missing.yaml"))


def test_broken_recipe_files(tmp_path):
    (tmp_path / "a.yaml").write_text(f"inherit: {tmp_path / 'b.yaml'}\n")
    (tmp_path / "b.yaml").write_text(f"inherit: {tmp_path / 'a.yaml'}\n")
    with pytest.raises(ValueError, match="recipe inherit cycle"):
        load_recipe(str(tmp_path / "a.yaml"))
    (tmp_path / "c.yaml").write_text("model: [unclosed\n")
    with pytest.raises(ValueError, match="is not valid YAML"):
        load_recipe(str(tmp_path / "c.yaml"))
    (tmp_path / "d.yaml").write_text("- a list\n")
    with pytest.raises(ValueError, match="must be a YAML mapping"):
        load_recipe(str(tmp_path / "d.yaml"))


def test_inherit_deep_merges_and_resolved_round_trips(tmp_path):
    child = tmp_path / "child.yaml"
    child.write_text("inherit: tiny\ntrain:\n  max_steps: 2\nattention:\n  pattern: s2\n")
    recipe = load_recipe(str(child))
    tiny = load_recipe("tiny")
    assert recipe.train.max_steps == 2 and recipe.train.lr == tiny.train.lr and recipe.data == tiny.data
    assert recipe.attention.pattern == "s2" and recipe.attention.params == {}
    assert recipe.name == "child"
    path = save_resolved(recipe, tmp_path / "out")
    again = load_recipe(str(path))
    assert again.to_dict() == recipe.to_dict() and again.name == "child"  # the name travels in the file
    assert format_recipe(recipe) == path.read_text() and not list(path.parent.glob("*.tmp*"))


def trained_through(name, overrides=()):
    """The recipe as the trainer runs it: its method built, ``auto`` resolved on this machine."""
    recipe = load_recipe(name, list(overrides))
    training_method(recipe)
    return recipe


def test_auto_backend_resolves_on_the_training_machine(monkeypatch):
    import attn_patterns.kernels as kernels

    monkeypatch.setattr(kernels, "flash_available", lambda: True)
    assert load_recipe("scca_flow_8k_a100").attention.backend == "auto"  # the recipe stays data
    assert trained_through("scca_flow_8k_a100").attention.backend == "flash"
    assert trained_through("tiny", ["attention.backend=auto"]).attention.backend == "sdpa"  # fp32: flash cannot run
    monkeypatch.setattr(kernels, "flash_available", lambda: False)
    assert trained_through("scca_flow_8k_a100").attention.backend == "sdpa"


def test_a_recipe_holds_data_only_and_checks_deepspeed_once(monkeypatch):
    import dataclasses

    from sparse_ft.config import schema

    recipe = load_recipe("tiny")
    assert [f.name for f in dataclasses.fields(recipe.attention)] == ["pattern", "params", "backend", "dense_layers"]
    assert vars(recipe.attention) == {"pattern": "scca_flow", "params": {"chunks": 4}, "backend": None, "dense_layers": []}
    calls = []
    monkeypatch.setattr(schema, "_check_deepspeed", lambda *args: calls.append(args))
    resolve_deepspeed_config(load_recipe("tiny"), 2, on_cuda=False)  # a run: the recipe loads, its config resolves
    assert len(calls) == 1


def test_deepspeed_config_is_filled_from_the_recipe(tmp_path):
    recipe = load_recipe("tiny", ["train.lr=3e-4", "train.weight_decay=0.1", "train.per_device_batch_size=2",
                                  "train.gradient_accumulation_steps=4", "train.max_grad_norm=0.5"])
    config = resolve_deepspeed_config(recipe, 3, on_cuda=False)
    assert (config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"], config["train_batch_size"]) == (2, 4, 24)
    assert config["gradient_clipping"] == 0.5
    assert config["optimizer"]["type"] == "AdamW"
    assert config["optimizer"]["params"] | {} == {"lr": 3e-4, "weight_decay": 0.1, "betas": [0.9, 0.999], "eps": 1e-8, "torch_adam": True}
    assert json.loads(json.dumps(config)) == config  # plain JSON, as DeepSpeed wants
    assert resolve_deepspeed_config(load_recipe("scca_flow_8k"), 8, on_cuda=True)["optimizer"]["params"]["torch_adam"] is False
    assert resolve_deepspeed_config(load_recipe("scca_flow_16k"), 8, on_cuda=True)["optimizer"]["params"]["torch_adam"] is False
    with pytest.raises(ValueError, match="trains without DeepSpeed"):
        resolve_deepspeed_config(load_recipe("tiny", ["deepspeed=null"]), 1)


@pytest.mark.parametrize(
    "change,message",
    [
        ({"scheduler": {"type": "WarmupDecayLR", "params": {}}}, r"sets 'scheduler': the scheduler is the recipe's"),
        ({"optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}, r"sets 'optimizer': the optimizer is the recipe's \(AdamW with train.lr"),
        ({"gradient_accumulation_steps": 8}, r"sets gradient_accumulation_steps=8 but the recipe says 2; write \"auto\""),
        ({"train_batch_size": 64},
         r"sets train_batch_size=64 but per_device_batch_size 1 × gradient_accumulation_steps 2 × 2 data-parallel processes = 4"),
        ({"fp16": {"enabled": True}}, r"model.dtype='float32' is invalid: deepspeed config .* trains in float16"),
    ],
)
def test_deepspeed_config_never_silently_overrides_the_recipe(tmp_path, change, message):
    config = json.loads((cfg.DS_CONFIG_DIR / "zero3_cpu_fp32.json").read_text()) | change
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        recipe = load_recipe("tiny", [f"deepspeed={path}"])  # load-time checks ...
        resolve_deepspeed_config(recipe, 2, on_cuda=False)  # ... and the world-size one
    ok = json.loads((cfg.DS_CONFIG_DIR / "zero3_cpu_fp32.json").read_text()) | {"gradient_accumulation_steps": 2, "train_batch_size": 4}
    path.write_text(json.dumps(ok))  # values equal to the recipe's are fine
    assert resolve_deepspeed_config(load_recipe("tiny", [f"deepspeed={path}"]), 2, on_cuda=False)["train_batch_size"] == 4


@pytest.mark.parametrize(
    "sp,world,heads,kv_heads,message",
    [
        (4, 8, 32, 8, None),  # KV heads split among the ranks
        (8, 8, 32, 4, None),  # more ranks than KV heads: each KV head replicated
        (3, 6, 32, 32, r"must divide the model's num_attention_heads=32"),
        (4, 8, 12, 6, r"must divide the model's num_key_value_heads=6 or be a multiple of it"),
        (4, 6, 32, 8, r"must divide the number of processes, 6"),
    ],
)
def test_sequence_parallel_follows_deepspeeds_rules(sp, world, heads, kv_heads, message):
    from sparse_ft.config.schema import check_sequence_parallel

    if message is None:
        check_sequence_parallel(sp, world, heads, kv_heads)
    else:
        with pytest.raises(ValueError, match=rf"recipe key train.sequence_parallel_size={sp} is invalid: {message}"):
            check_sequence_parallel(sp, world, heads, kv_heads)


def test_an_arch_specific_cuda_arch_list_is_refused_before_deepspeed_builds_its_ops():
    """9.0a (NVIDIA's Hopper images) broke DeepSpeed 0.19's op build on an H200, after the weights."""
    from sparse_ft.config.deepspeed_file import check_cuda_arch_list

    for fine in (None, "", "8.0;9.0", "8.6 9.0+PTX"):
        check_cuda_arch_list(fine, {})
    check_cuda_arch_list("9.0a", {"fused_adam": True, "cpu_adam": True})  # prebuilt: nothing to build
    with pytest.raises(ValueError, match=r"^environment variable TORCH_CUDA_ARCH_LIST='8.0;9.0a' is refused under "
                                         r"DeepSpeed: its entry '9.0a' .* N.N or N.N\+PTX .*TORCH_CUDA_ARCH_LIST='8.0;9.0'$"):
        check_cuda_arch_list("8.0;9.0a", {"fused_adam": True, "cpu_adam": False})
