"""QLoRA (``model.quantization: nf4``) on the tiny model, on the CPU (bitsandbytes' 4-bit
forward and backward run there): a few steps through a sparse pattern lower the loss over an
NF4 base whose trainable tensors are fp32; the adapter reloads over the NF4 base to the logits
it was trained to, evaluates with ``--load-in-4bit``, and merges onto the unquantised base,
which differs from the trained model by the NF4 rounding only."""

import json

import pytest
import torch
from safetensors.torch import load_file

from helpers_train import overrides

NF4 = ["model.quantization=nf4", "deepspeed=null", "attention.pattern=s2", "lora.dropout=0"]


@pytest.fixture(scope="module")
def qlora_run(tmp_path_factory):
    from sparse_ft.config import load_recipe
    from sparse_ft.train.trainer import Trainer

    root = tmp_path_factory.mktemp("qlora")
    trainer = Trainer(load_recipe("tiny", overrides(root / "run", root / "cache", *NF4)), progress=False)
    summary = trainer.run()
    return root / "run", trainer, summary


@pytest.mark.slow
def test_qlora_trains_lora_plus_over_an_nf4_base(qlora_run):
    import bitsandbytes as bnb

    _, trainer, summary = qlora_run
    losses = [record["loss"] for record in summary["history"]]
    assert len(losses) == 8 and sum(losses[-3:]) < sum(losses[:3]) - 0.1
    model = trainer.engine.module
    quantized = [n for n, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert any("q_proj" in n for n in quantized) and any("mlp" in n for n in quantized)  # the frozen base is NF4
    state = next(m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)).weight.quant_state
    # double quantisation (bitsandbytes' CPU kernels unpack the nested statistics, recording that they were)
    assert state.quant_type == "nf4" and getattr(state, "original_nested", state.nested)
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert any("lora_A" in n for n in trainable) and any("embed_tokens" in n for n in trainable)
    assert any("norm" in n for n in trainable) and all(p.dtype == torch.float32 for p in trainable.values())


@pytest.mark.slow
def test_qlora_adapter_reloads_evaluates_and_merges_onto_the_unquantised_base(qlora_run, tmp_path, capsys):
    from sparse_ft import use_attention
    from sparse_ft.cli import main
    from sparse_ft.evaluation import loading
    from sparse_ft.modeling.model_io import load_adapter_model, read_meta

    out, _, _ = qlora_run
    adapter = out / "adapter"
    meta = read_meta(adapter)
    assert meta["base_quantization"] == "nf4"
    probe = load_file(str(out / "adapter_probe.safetensors"))
    reloaded, _ = loading.load(None, str(adapter), load_in_4bit=True, device="cpu", tokenizer=False)
    attention = dict(meta["train_attention"])
    use_attention(reloaded, attention.pop("pattern"), **attention)
    with torch.no_grad():  # the trained model, exactly: the same NF4 rounding of the same base
        torch.testing.assert_close(reloaded(input_ids=probe["input_ids"]).logits, probe["logits"], atol=1e-4, rtol=1e-4)

    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    assert main(["eval", "ppl", "--adapter", str(adapter), "--load-in-4bit", "--data", str(text), "--lengths", "256",
                 "--output", str(tmp_path / "ppl.json")]) == 0, capsys.readouterr().err
    ppl = json.loads((tmp_path / "ppl.json").read_text())["results"][0]["ppl"]
    assert 1 < ppl < float("inf")

    assert main(["merge", "--adapter", str(adapter), "--output", str(tmp_path / "merged")]) == 0
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    unmerged = load_adapter_model(adapter).eval()  # the adapter over the unquantised base
    with torch.no_grad():
        merged_logits = merged(input_ids=probe["input_ids"]).logits
        torch.testing.assert_close(merged_logits, unmerged(input_ids=probe["input_ids"]).logits, atol=1e-4, rtol=1e-4)
    # what merging onto the unquantised base changes: the NF4 rounding the adapter was trained over
    assert (merged_logits - probe["logits"]).abs().max() > 1e-3


def test_pretraining_a_quantized_base_is_refused(tmp_path):
    import numpy as np

    from sparse_ft.config import load_recipe
    from sparse_ft.config.schema import BadInput
    from sparse_ft.train.pretrainer import Pretrainer

    recipe = load_recipe("tiny", overrides(tmp_path / "run", tmp_path / "cache", "model.quantization=nf4", "deepspeed=null"))
    with pytest.raises(BadInput, match=r"^recipe key model.quantization='nf4' is invalid: pretraining trains every weight"):
        Pretrainer(recipe, np.zeros((4, 512), dtype=np.int64)).run()
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_qlora_on_two_deepspeed_zero2_ranks_saves_an_adapter_that_reloads_over_nf4(tmp_path):
    from test_train_deepspeed import launch

    out = tmp_path / "ds"
    launch(out, tmp_path / "cache", "deepspeed=zero2_bf16", "model.dtype=bfloat16", "model.quantization=nf4")
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 4
    assert all(0 < record["loss"] < 10 for record in summary["history"])
    tensors = load_file(str(out / "adapter" / "adapter_model.safetensors"))
    assert any("lora_A" in k for k in tensors) and all(t.numel() for t in tensors.values())
    from sparse_ft.evaluation import loading

    model, _ = loading.load(None, str(out / "adapter"), "bfloat16", load_in_4bit=True, compute_dtype="bfloat16",
                            device="cpu", tokenizer=False)
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=torch.arange(3, 67)[None]).logits).all()
