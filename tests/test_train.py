"""The training path for real: plain torch in-process, a killed-and-resumed run, and two
DeepSpeed ZeRO-3 ranks on CPU (gloo)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from sparse_ft import use_attention
from sparse_ft.config import load_recipe
from sparse_ft.train.adapter import load_adapter_model, read_meta
from sparse_ft.train.checkpoint import complete_checkpoints, find_resume
from sparse_ft.train.loop import train

ROOT = Path(__file__).resolve().parent.parent


def overrides(out, cache, *extra):
    return [f"train.output_dir={out}", f"data.cache_dir={cache}", "train.report_to=[none]", *extra]


def losses(out):
    return [json.loads(line)["loss"] for line in (Path(out) / "log.jsonl").read_text().splitlines()]


def assert_adapter_reproduces_probe(out):
    adapter = Path(out) / "adapter"
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    assert tensors and all(t.numel() > 0 for t in tensors.values())
    assert any("lora_A" in k for k in tensors) and any("embed_tokens" in k for k in tensors) and any("norm" in k for k in tensors)
    meta = read_meta(adapter)
    model = load_adapter_model(adapter).eval()
    attention = dict(meta["train_attention"])
    use_attention(model, attention.pop("pattern"), **attention)
    probe = load_file(str(Path(out) / "adapter_probe.safetensors"))
    with torch.no_grad():
        logits = model(input_ids=probe["input_ids"]).logits
    torch.testing.assert_close(logits, probe["logits"], atol=1e-4, rtol=1e-4)
    return meta


def test_single_process_run_composes_rope_and_saves_a_complete_adapter(tmp_path):
    # The base already has linear RoPE scaling x2: extending 256 -> 512 must give x4, not x2.
    recipe = load_recipe("tiny", overrides(tmp_path / "run", tmp_path / "cache", "deepspeed=null", "train.max_steps=3",
                                           "model.tiny={rope_parameters: {rope_type: linear, factor: 2.0, rope_theta: 10000.0}}"))
    summary = train(recipe)
    assert summary["steps"] == 3 and len(losses(tmp_path / "run")) == 3
    meta = assert_adapter_reproduces_probe(tmp_path / "run")
    assert meta["rope_parameters"]["factor"] == 4.0 and meta["max_position_embeddings"] == 512
    record = json.loads((tmp_path / "run" / "log.jsonl").read_text().splitlines()[-1])
    assert {"loss", "lr", "grad_norm", "tokens_per_s", "peak_mem_mib"} <= set(record)
    assert (tmp_path / "run" / "recipe.resolved.yaml").is_file()


def test_killed_run_resumes_with_the_uninterrupted_loss_curve(tmp_path):
    common = overrides(tmp_path / "x", tmp_path / "cache", "deepspeed=null", "train.max_steps=12", "train.save_steps=2",
                       "train.save_total_limit=10")
    reference = train(load_recipe("tiny", [*common, f"train.output_dir={tmp_path / 'ref'}"]))
    out = tmp_path / "crash"
    argv = [sys.executable, str(ROOT / "train.py"), "recipe=tiny", *common, f"train.output_dir={out}"]
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while not (out / "checkpoint-4" / "meta.json").exists():
        assert proc.poll() is None and time.time() < deadline, "run ended before the kill"
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL and not (out / "adapter").exists()
    assert find_resume(out, "auto") is not None
    resumed = train(load_recipe("tiny", [*common, f"train.output_dir={out}"]))
    assert [r["loss"] for r in resumed["history"]] == [r["loss"] for r in reference["history"]]
    assert losses(out) == losses(tmp_path / "ref")


def test_half_written_checkpoints_are_never_resumed(tmp_path):
    (tmp_path / "checkpoint-2").mkdir()
    (tmp_path / "checkpoint-2" / "meta.json").write_text("{}")
    (tmp_path / "checkpoint-4.tmp").mkdir()  # crashed mid-save
    (tmp_path / "checkpoint-6").mkdir()  # renamed but meta missing: impossible by construction, ignored anyway
    assert complete_checkpoints(tmp_path) == [2]
    assert find_resume(tmp_path, "auto") == tmp_path / "checkpoint-2"
    assert find_resume(tmp_path, "never") is None
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        find_resume(tmp_path, str(tmp_path / "checkpoint-4.tmp"))


@pytest.mark.slow
def test_two_process_deepspeed_zero3_on_cpu(tmp_path):
    out = tmp_path / "ds"
    launcher = Path(sys.executable).parent / "deepspeed"
    argv = [str(launcher), "--num_gpus", "2", "train.py", "recipe=tiny", "attention.pattern=scca_flow", "train.max_steps=4",
            *overrides(out, tmp_path / "cache")]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 4
    assert_adapter_reproduces_probe(out)


def test_merge_writes_a_plain_model_with_the_trained_positions(tmp_path):
    from transformers import AutoModelForCausalLM

    from sparse_ft.cli import main

    train(load_recipe("tiny", overrides(tmp_path / "run", tmp_path / "cache", "deepspeed=null", "train.max_steps=2",
                                        "attention.pattern=full", "attention.params={}")))
    assert main(["merge", "--adapter", str(tmp_path / "run" / "adapter"), "--output", str(tmp_path / "merged")]) == 0
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    assert merged.config.rope_parameters["factor"] == 2.0 and merged.config.max_position_embeddings == 512
    probe = load_file(str(tmp_path / "run" / "adapter_probe.safetensors"))
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=probe["input_ids"]).logits, probe["logits"], atol=1e-4, rtol=1e-4)


def test_prepare_train_builds_the_cache_the_trainer_reuses(tmp_path):
    done = subprocess.run([sys.executable, "data/prepare_train.py", "recipe=tiny", f"data.cache_dir={tmp_path}",
                           f"train.output_dir={tmp_path / 'run'}"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "samples of 512 tokens" in done.stdout and list(tmp_path.glob("*.tokens"))
