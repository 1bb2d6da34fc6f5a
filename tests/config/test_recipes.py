"""The shipped recipes and DeepSpeed configs: every one loads, validates and resolves, and the
Llama-2-7B ones carry the SCCA paper's settings."""

import json

import pytest

from sparse_ft.config import DS_CONFIG_DIR, REPO_ROOT, load_recipe, recipe_names
from sparse_ft.train.deepspeed import resolve_deepspeed_config
from sparse_ft.train.model_setup import training_method

PAPER = ("scca_flow_8k", "scca_fixed_8k", "longmixed_8k", "s2_8k", "full_8k")
# the pattern a recipe named after it trains: the full-attention baselines train causal
# attention on the same kernels and backend as the sparse patterns
TRAINS = {"full": "causal"}
DS_CONFIGS = sorted(p.stem for p in DS_CONFIG_DIR.glob("*.json"))


@pytest.mark.parametrize("name", recipe_names())
def test_every_shipped_recipe_validates_and_resolves(name):
    recipe = load_recipe(name)
    assert recipe.name == name and 2 <= recipe.seq_len <= recipe.model.target_length
    if recipe.deepspeed:
        config = resolve_deepspeed_config(recipe, world_size=8, on_cuda=True)
        assert config["optimizer"] == {"type": "AdamW", "params": {
            "lr": recipe.train.lr, "weight_decay": recipe.train.weight_decay, "betas": recipe.train.betas,
            "eps": 1e-8, "torch_adam": False}}
        assert "scheduler" not in config  # the schedule is the recipe's, built by the trainer
        data_parallel = 8 // recipe.train.sequence_parallel_size
        assert config["train_batch_size"] == data_parallel * recipe.train.per_device_batch_size * recipe.train.gradient_accumulation_steps
        assert not any(isinstance(v, str) and v.startswith("auto") for v in config.values())


def test_paper_recipes_carry_the_paper_settings():
    for name in PAPER:
        r = load_recipe(name)
        assert r.model.name_or_path == "meta-llama/Llama-2-7b-hf" and r.model.target_length == 8192
        assert (r.model.dtype, r.model.rope_method, r.attention.backend, r.deepspeed) == ("float16", "linear", "sdpa", "zero3_fp16")
        assert (r.lora.r, r.lora.alpha, r.lora.dropout) == (8, 16, 0.0)  # LongLoRA fine-tune.py
        assert r.lora.target_modules == ["q_proj", "k_proj", "v_proj", "o_proj"]
        assert r.lora.extra_trainable == ["embed_tokens", "norm"]
        t = r.train
        assert (t.lr, t.weight_decay, t.warmup_steps, t.scheduler, t.per_device_batch_size) == (2e-5, 0.0, 20, "constant", 1)
        assert (t.gradient_accumulation_steps, t.max_steps, t.num_epochs) == (1, -1, 1)  # global batch 8 on 8 GPUs
        assert r.data.min_tokens == 8192 and "RedPajama-Data-1T-Sample" in r.data.source
        assert r.attention.pattern == TRAINS.get(name.rsplit("_", 1)[0], name.rsplit("_", 1)[0])
        assert r.train.output_dir == f"runs/{name}"


@pytest.mark.parametrize("length", [16384, 32768])
def test_long_variants_extend_further_on_a100(length):
    for pattern in ("scca_flow", "scca_fixed", "longmixed", "s2", "full"):
        r = load_recipe(f"{pattern}_{length // 1024}k_a100")
        assert r.model.target_length == length == r.data.min_tokens and r.model.dtype == "bfloat16"
        assert r.attention.pattern == TRAINS.get(pattern, pattern) and r.attention.backend == "auto"
        training_method(r)
        assert r.attention.backend in ("sdpa", "flash")  # "auto", resolved by the trainer on this machine
        assert r.deepspeed.endswith("bf16")
    assert load_recipe("scca_flow_16k").deepspeed == "zero3_offload_fp16"  # V100 16k: offload


@pytest.mark.parametrize("name,length", [("scca_flow_64k_a100", 65536), ("longmixed_128k_a100", 131072)])
def test_ulysses_recipes_split_each_sequence_over_8_a100(name, length):
    from sparse_ft.config.schema import check_sequence_parallel

    r = load_recipe(name)
    assert r.seq_len == length == r.data.min_tokens and r.train.sequence_parallel_size == 8
    assert r.model.name_or_path == "meta-llama/Llama-2-7b-hf" and r.train.gradient_checkpointing
    config = resolve_deepspeed_config(r, world_size=8, on_cuda=True)
    assert config["zero_optimization"]["stage"] == 3 and config["sequence_parallel_size"] == 8
    assert config["train_batch_size"] == 8  # one data-parallel group of 8 ranks, 8 accumulation steps
    check_sequence_parallel(8, 8, heads=32, kv_heads=32)  # Llama-2-7B
    training_method(r).pattern.check_heads(32)


def test_multinode_example_names_an_existing_hostfile():
    recipe = load_recipe("scca_flow_8k_2x8_a100")
    text = (REPO_ROOT / "recipes" / "multinode" / "scca_flow_8k_2x8_a100.yaml").read_text()
    assert "deepspeed --hostfile recipes/multinode/hostfile.example train.py recipe=scca_flow_8k_2x8_a100" in text
    hosts = [line for line in (REPO_ROOT / "recipes/multinode/hostfile.example").read_text().splitlines()
             if line and not line.startswith("#")]
    assert len(hosts) == 2 and all("slots=8" in h for h in hosts)
    assert recipe.deepspeed == "zero3_bf16" and resolve_deepspeed_config(recipe, 16, True)["train_batch_size"] == 16


def test_tiny_recipe_is_a_quick_cpu_run():
    r = load_recipe("tiny")
    assert r.model.name_or_path == "tiny" and r.model.dtype == "float32" and r.model.target_length == 512
    assert r.attention.pattern == "scca_flow" and r.deepspeed == "zero3_cpu_fp32"
    assert 0 < r.train.max_steps <= 10 and (REPO_ROOT / r.data.source).is_file()
    config = resolve_deepspeed_config(r, 2, on_cuda=False)
    assert config["optimizer"]["params"]["torch_adam"] is True and config["zero_optimization"]["stage"] == 3
    assert "fp16" not in config and "bf16" not in config


@pytest.mark.parametrize("name", DS_CONFIGS)
def test_deepspeed_configs_leave_recipe_values_auto(name):
    config = json.loads((DS_CONFIG_DIR / f"{name}.json").read_text())
    for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size", "gradient_clipping", "optimizer"):
        assert str(config[key]).startswith("auto"), key
    assert "scheduler" not in config
    zero = config["zero_optimization"]
    assert zero["stage"] == int(name[4])
    if zero["stage"] == 3:
        # adapters are gathered by the trainer; a 16-bit copy of all 7B weights on save is not needed
        assert zero["stage3_gather_16bit_weights_on_model_save"] is False
    assert ("fp16" in name) == bool(config.get("fp16", {}).get("enabled"))
    assert ("bf16" in name) == bool(config.get("bf16", {}).get("enabled"))
    assert ("offload" in name) == ("offload_optimizer" in zero)


def test_all_variants_exist():
    names = set(recipe_names())
    for stage in ("zero2", "zero3", "zero3_offload"):
        for precision in ("fp16", "bf16"):
            assert f"{stage}_{precision}" in DS_CONFIGS
    for pattern in ("scca_flow", "scca_fixed", "longmixed", "s2", "full"):
        assert {f"{pattern}_8k", f"{pattern}_8k_a100", f"{pattern}_16k_a100", f"{pattern}_32k_a100"} <= names


def test_paths_resolve_against_the_recipe_not_the_working_directory(tmp_path, monkeypatch):
    home, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    (home / "corpus").mkdir(parents=True)
    elsewhere.mkdir()
    (home / "corpus" / "train.jsonl").write_text('{"text": "x"}\n')
    (home / "ds.json").write_text((DS_CONFIG_DIR / "zero3_cpu_fp32.json").read_text())
    (home / "mine.yaml").write_text("inherit: tiny\ndata: {source: corpus/train.jsonl}\ndeepspeed: ds.json\n"
                                    "train: {output_dir: runs/mine}\n")
    monkeypatch.chdir(elsewhere)
    r = load_recipe(str(home / "mine.yaml"))
    assert r.data.source == str(home / "corpus" / "train.jsonl") and r.deepspeed == str(home / "ds.json")
    assert r.train.output_dir == "runs/mine" and r.data.cache_dir == ".cache/sparse-ft/data"  # outputs: where it runs
    # what a command line types is relative to the current directory; names stay names
    r = load_recipe(str(home / "mine.yaml"), ["data.source=here.jsonl", "deepspeed=zero3_cpu_fp32"])
    assert r.data.source == str(elsewhere / "here.jsonl") and r.deepspeed == "zero3_cpu_fp32"
    for source in ("hf://datasets/a/b/*.jsonl", "togethercomputer/RedPajama-Data-1T-Sample"):
        assert load_recipe("tiny", [f"data.source={source}"]).data.source == source
    # a shipped recipe's paths are the repository's (an installed package's own copy)
    tiny = load_recipe("tiny")
    assert tiny.data.source == str(REPO_ROOT / "data" / "tiny" / "train.jsonl") and tiny.model.name_or_path == "tiny"
    assert load_recipe("tiny_4x").model.name_or_path == str(REPO_ROOT / "assets" / "tiny-base-bpe")
    # a parent named by path sits beside the child; its paths stay its own
    (home / "sub").mkdir()
    (home / "sub" / "child.yaml").write_text("inherit: ../mine.yaml\n")
    assert load_recipe(str(home / "sub" / "child.yaml")).data.source == str(home / "corpus" / "train.jsonl")
