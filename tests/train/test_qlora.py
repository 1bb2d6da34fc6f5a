"""QLoRA (``model.quantization: nf4``) on the tiny model, on the CPU (bitsandbytes' 4-bit
forward and backward run there): a few steps through a sparse pattern lower the loss over an
NF4 base whose trainable tensors are fp32; the adapter reloads over the NF4 base to the logits
it was trained to, evaluates with ``--load-in-4bit``, and merges onto the unquantised base,
which differs from the trained model by the NF4 rounding only."""

import importlib.util
import json
import re
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.train.helpers_train import overrides

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
    from sparse_ft.config.bad_input import BadInput
    from sparse_ft.train.pretrainer import Pretrainer

    recipe = load_recipe("tiny", overrides(tmp_path / "run", tmp_path / "cache", "model.quantization=nf4", "deepspeed=null"))
    with pytest.raises(BadInput, match=r"^recipe key model.quantization='nf4' is invalid: pretraining trains every weight"):
        Pretrainer(recipe, np.zeros((4, 512), dtype=np.int64)).run()
    assert not (tmp_path / "run").exists()


@pytest.fixture(scope="module")
def zero2_nf4(tmp_path_factory):
    """A two-rank ZeRO-2 QLoRA run (bf16, scca_flow, 4 steps): its directory."""
    from tests.train.test_train_deepspeed import launch

    root = tmp_path_factory.mktemp("zero2-nf4")
    launch(root / "ds", root / "cache", "deepspeed=zero2_bf16", "model.dtype=bfloat16", "model.quantization=nf4")
    return root / "ds"


def assert_reloads_over_nf4(out) -> torch.Tensor:
    """The run's adapter is complete and reloads over the NF4 base; its logits."""
    from sparse_ft.evaluation import loading

    tensors = load_file(str(out / "adapter" / "adapter_model.safetensors"))
    assert any("lora_A" in k for k in tensors) and all(t.numel() for t in tensors.values())
    model, _ = loading.load(None, str(out / "adapter"), "bfloat16", load_in_4bit=True, compute_dtype="bfloat16",
                            device="cpu", tokenizer=False)
    with torch.no_grad():
        logits = model(input_ids=torch.arange(3, 67)[None]).logits
    assert torch.isfinite(logits).all()
    return logits


@pytest.mark.slow
def test_qlora_on_two_deepspeed_zero2_ranks_saves_an_adapter_that_reloads_over_nf4(zero2_nf4):
    summary = json.loads((zero2_nf4 / "train_summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 4
    assert all(0 < record["loss"] < 10 for record in summary["history"])
    assert_reloads_over_nf4(zero2_nf4)


@pytest.mark.slow
def test_qlora_on_two_zero3_ranks_trains_as_zero2_does(zero2_nf4, tmp_path):
    """ZeRO-3 partitions the 4-bit weights (stored in bf16) and gathers them for each layer:
    the same quantised base, data and steps as ZeRO-2, so the same losses (the first two
    equal, the optimizer's partitioned bf16 arithmetic then moves the fourth decimal at most),
    and an adapter that reloads over NF4 to ZeRO-2's logits within that."""
    from tests.train.test_train_deepspeed import launch

    out = tmp_path / "ds"
    launch(out, tmp_path / "cache", "deepspeed=zero3_bf16", "model.dtype=bfloat16", "model.quantization=nf4")
    zero3, zero2 = (json.loads((d / "train_summary.json").read_text()) for d in (out, zero2_nf4))
    assert zero3["world_size"] == 2 and zero3["steps"] == 4
    got, want = ([r["loss"] for r in run["history"]] for run in (zero3, zero2))
    assert got[:2] == want[:2] and max(abs(a - b) for a, b in zip(got, want)) < 1e-3
    torch.testing.assert_close(assert_reloads_over_nf4(out), assert_reloads_over_nf4(zero2_nf4), atol=2e-2, rtol=0)


@pytest.mark.slow
def test_zero3_partitions_the_4bit_weights_and_gathers_them_exactly(tmp_path):
    """Two ranks load the NF4 base as the trainer does under ZeRO-3 and initialise DeepSpeed:
    each holds half of every packed 4-bit weight, and the partitioned model's logits equal the
    unpartitioned NF4 model's exactly (this file's ``__main__``)."""
    from tests.train.helpers_train import DEEPSPEED, ROOT
    from sparse_ft.modeling.model_io import materialize_tiny
    from tests.train.test_train_deepspeed import free_port

    model = materialize_tiny(tmp_path / "model", 0)
    done = subprocess.run([*DEEPSPEED, "--num_gpus", "2", "--master_port", str(free_port()), __file__, str(model)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert sorted(re.findall(r"rank (\d): partitioned, logits equal", done.stdout)) == ["0", "1"], done.stdout[-3000:]


def test_nf4_under_zero3_is_refused_by_name_where_4bit_storage_is_not_float(monkeypatch):
    from sparse_ft.config import load_recipe
    from sparse_ft.config.bad_input import BadInput
    from sparse_ft.modeling import quantization

    assert quantization.float_storage_refused() is None  # the locked versions support it
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else real(name, *a))
    assert quantization.float_storage_refused() == "bitsandbytes is not installed (pip install bitsandbytes)"
    monkeypatch.setattr(quantization, "float_storage_refused",
                        lambda: "transformers 4.38.2 has no bnb_4bit_quant_storage (needs >= 4.39)")
    with pytest.raises(BadInput, match=r"^recipe key model.quantization='nf4' is invalid: deepspeed config zero3_bf16 is "
                                       r"ZeRO-3, which partitions 4-bit weights only in a float storage dtype, and "
                                       r"transformers 4.38.2 has no .*; use a ZeRO-2 config \(zero2_bf16, zero2_fp16\) or "
                                       r"deepspeed: null$"):
        load_recipe("tiny", ["model.quantization=nf4", "deepspeed=zero3_bf16", "model.dtype=bfloat16"])


if __name__ == "__main__":  # a rank of test_zero3_partitions_the_4bit_weights_and_gathers_them_exactly
    import os
    import sys

    import deepspeed

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from sparse_ft.config import load_recipe
    from sparse_ft.config.deepspeed_file import read_deepspeed_config
    from sparse_ft.train.model_setup import load_base

    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    path = sys.argv[-1]
    ids = torch.arange(3, 40)[None]
    plain = load_base(load_recipe("tiny", ["deepspeed=null", "model.dtype=bfloat16", "model.quantization=nf4"]), path)
    with torch.no_grad():
        want = plain(input_ids=ids).logits
    ds = {**read_deepspeed_config("zero3_bf16"), "train_micro_batch_size_per_gpu": 1, "train_batch_size": 2,
          "gradient_accumulation_steps": 1, "gradient_clipping": 1.0}
    ds.pop("optimizer", None)
    model = load_base(load_recipe("tiny", ["deepspeed=zero3_bf16", "model.dtype=bfloat16", "model.quantization=nf4"]), path, ds)
    engine, *_ = deepspeed.initialize(model=model, config=ds)
    weight = model.model.layers[0].self_attn.q_proj.weight
    assert type(weight).__name__ == "Params4bit" and weight.dtype == torch.bfloat16
    assert weight.ds_tensor.numel() * 2 == weight.ds_numel and weight.numel() == 0  # half of it here, gathered on use
    with torch.no_grad():
        got = engine(input_ids=ids).logits
    assert torch.equal(got, want), (got - want).abs().max()
    print(f"rank {os.environ['RANK']}: partitioned, logits equal", flush=True)
