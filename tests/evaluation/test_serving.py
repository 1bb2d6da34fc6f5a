"""Adapters and merged models that load outside sparse-ft (docs/serving.md): the adapter's
model card gives plain transformers + PEFT lines that reproduce ``load_adapter_model``; a
merged config loads in transformers without a warning and keeps its RoPE; ``merge --method
dca`` writes the keys vLLM and SGLang read."""

import json
import logging
import re
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.train.helpers_train import BASE_ROPE, overrides
from sparse_ft.modeling import rope
from sparse_ft.modeling.model_io import load_adapter_model


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Two steps of the tiny recipe over a base with linear RoPE x2, extended to x4."""
    from sparse_ft.config import load_recipe
    from sparse_ft.train.trainer import train

    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("run")
    train(load_recipe("tiny", [*overrides(out, tmp_path_factory.mktemp("cache")), "deepspeed=null", "train.max_steps=2",
                               "train.gradient_accumulation_steps=1", BASE_ROPE]))
    return out


def _no_transformers_warnings(load):
    """``load()``'s result, failing on any warning transformers logs or raises meanwhile."""
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            result = load()
    finally:
        logger.removeHandler(handler)
    assert not [r.getMessage() for r in records if r.levelno >= logging.WARNING]
    return result


def test_the_cards_plain_peft_lines_give_load_adapter_models_logits(trained):
    from sparse_ft.train.model_card import ADAPTER_PLACEHOLDER

    adapter = trained / "adapter"
    card = (adapter / "README.md").read_text()
    assert "linear" in card and "factor 4.0" in card and "target length | 512" in card and "[More Information" not in card
    code = re.search(r"```python\n(.*?)```", card, re.S).group(1)
    assert "sparse_ft" not in code  # the documented path needs no sparse-ft
    namespace: dict = {}
    exec(code.replace(ADAPTER_PLACEHOLDER, str(adapter)), namespace)
    plain = namespace["model"].eval()
    assert plain.config.rope_parameters == {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}
    ids = load_file(str(trained / "adapter_probe.safetensors"))["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(plain(input_ids=ids).logits, load_adapter_model(adapter).eval()(input_ids=ids).logits,
                                   rtol=0, atol=0)


def test_a_merged_config_loads_in_transformers_without_a_warning(trained, tmp_path, capsys):
    from transformers import AutoConfig

    from sparse_ft.cli import main

    assert main(["merge", "--adapter", str(trained / "adapter"), "--output", str(tmp_path / "merged")]) == 0
    written = json.loads((tmp_path / "merged" / "config.json").read_text())
    assert written["rope_parameters"] == {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}
    config = _no_transformers_warnings(lambda: AutoConfig.from_pretrained(tmp_path / "merged"))
    assert rope.rope_parameters(config)["factor"] == 4.0 and config.max_position_embeddings == 512
    # vLLM and SGLang multiply a linear config's max_position_embeddings by its factor: merge says what to pass
    assert "--max-model-len 512" in capsys.readouterr().err


@pytest.mark.parametrize("kind", sorted(rope.TRANSFORMERS_KEYS))
def test_the_key_table_is_what_transformers_takes(kind):
    """Every key rope.TRANSFORMERS_KEYS allows passes transformers' own validation silently."""
    from transformers import LlamaConfig

    values = {"factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 10000.0, "attention_factor": 1.0,
              "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0, "truncate": True,
              "short_factor": [1.0] * 4, "long_factor": [1.0] * 4, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    params = {k: values.get(k, kind) for k in rope.TRANSFORMERS_KEYS[kind]}
    _no_transformers_warnings(lambda: LlamaConfig(hidden_size=64, num_attention_heads=8, max_position_embeddings=256,
                                                  rope_parameters=params))
    assert rope.portable({**params, "original_max_position_embeddings": 64}).keys() == params.keys() | (
        {"original_max_position_embeddings"} & rope.TRANSFORMERS_KEYS[kind])


def _tiny_qwen2_adapter(tmp_path: Path, rope_parameters: dict) -> Path:
    """An untrained LoRA adapter over a random tiny Qwen2 (the family the engines serve DCA for)."""
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from sparse_ft.modeling.tiny import tiny_tokenizer

    config = Qwen2Config(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=256, rope_parameters=rope_parameters)
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(tmp_path / "base")
    tiny_tokenizer().save_pretrained(tmp_path / "base")
    model = get_peft_model(Qwen2ForCausalLM.from_pretrained(tmp_path / "base"), LoraConfig(r=4, target_modules=["q_proj"]))
    model.save_pretrained(tmp_path / "adapter")
    return tmp_path / "adapter"


def test_merge_exports_the_dca_config_the_engines_read(tmp_path):
    from transformers import AutoConfig

    from sparse_ft.methods.dca import DualChunk
    from sparse_ft.merge import merge

    adapter = _tiny_qwen2_adapter(tmp_path, {"rope_type": "default", "rope_theta": 10000.0})
    merge(str(adapter), tmp_path / "merged", method="dca", method_args={"chunk_size": 256, "local_window": 8},
          context_length=4096)
    config = _no_transformers_warnings(lambda: AutoConfig.from_pretrained(tmp_path / "merged"))
    assert config.dual_chunk_attention_config == {"chunk_size": 256, "local_size": 8, "original_max_position_embeddings": 256}
    assert config.max_position_embeddings == 4096
    # sparse-ft's own dca reads it back as the same algorithm
    assert DualChunk().algorithm_for(config).sizes(4096) == (256, 8, 256)


@pytest.mark.parametrize("rope_parameters, kwargs, said", [
    ({"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}, {"context_length": 4096}, "rope_type='linear'"),
    ({"rope_type": "default", "rope_theta": 10000.0}, {}, "needs --context-length"),
    ({"rope_type": "default", "rope_theta": 10000.0}, {"context_length": 4096, "method_args": {"backend": "math"}},
     "backend cannot be exported"),
])
def test_a_dca_export_the_engines_would_serve_otherwise_is_refused(tmp_path, rope_parameters, kwargs, said):
    from sparse_ft.merge import merge

    adapter = _tiny_qwen2_adapter(tmp_path, rope_parameters)
    with pytest.raises(ValueError, match=said):
        merge(str(adapter), tmp_path / "merged", method="dca", **kwargs)
    assert not (tmp_path / "merged").exists()

