"""The single-process training path for real: a plain-torch run of the tiny recipe, a run killed
by SIGKILL and one that crashes mid-save, both resumed to the uninterrupted loss curve, and the
merged model. The two-process DeepSpeed run is in test_train_deepspeed.py."""

import json
import os
import runpy
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
from sparse_ft.train import checkpoint
from sparse_ft.models import load_adapter_model, read_meta
from sparse_ft.train.checkpoint import complete_checkpoints, find_resume
from sparse_ft.train.distributed import init_distributed
from sparse_ft.train.trainer import train

ROOT = Path(__file__).resolve().parent.parent
STEPS = 8
# The base already has linear RoPE scaling x2: extending 256 -> 512 must compose to x4, not replace it.
BASE_ROPE = "model.tiny={rope_parameters: {rope_type: linear, factor: 2.0, rope_theta: 10000.0}}"


class SimulatedCrash(BaseException):
    """Like a kill: nothing in the trainer may catch it."""


def overrides(out, cache, *extra):
    return [f"train.output_dir={out}", f"data.cache_dir={cache}", "train.report_to=[none]", *extra]


def losses(out):
    return [json.loads(line)["loss"] for line in (Path(out) / "log.jsonl").read_text().splitlines()]


def assert_adapter_reproduces_probe(out):
    """The saved adapter, reloaded with PeftModel.from_pretrained through the trained RoPE,
    gives the logits the model had in memory before saving."""
    adapter = Path(out) / "adapter"
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    assert tensors and all(t.numel() > 0 for t in tensors.values())
    assert any("lora_A" in k for k in tensors) and any("embed_tokens" in k for k in tensors)
    assert any("layernorm" in k for k in tensors) and "base_model.model.model.norm.weight" in tensors
    meta = read_meta(adapter)
    model = load_adapter_model(adapter).eval()
    attention = dict(meta["train_attention"])
    use_attention(model, attention.pop("pattern"), **attention)
    probe = load_file(str(Path(out) / "adapter_probe.safetensors"))
    with torch.no_grad():
        logits = model(input_ids=probe["input_ids"]).logits
    torch.testing.assert_close(logits, probe["logits"], atol=1e-4, rtol=1e-4)
    return meta


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny matrices on a shared CPU: extra OpenMP threads only spin (100x slower when the
    machine is oversubscribed)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def common(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    return overrides("unset", cache, "deepspeed=null", f"train.max_steps={STEPS}", "train.save_steps=2",
                     "train.save_total_limit=10", "train.gradient_checkpointing=true", BASE_ROPE)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, common):
    """One uninterrupted run that the other tests compare against."""
    out = tmp_path_factory.mktemp("reference")
    summary = train(load_recipe("tiny", [*common, f"train.output_dir={out}", "train.report_to=[tensorboard]"]))
    return out, summary


@pytest.mark.slow
def test_single_process_run_composes_rope_and_saves_a_complete_adapter(reference):
    out, summary = reference
    assert summary["steps"] == STEPS and summary["world_size"] == 1 and len(losses(out)) == STEPS
    meta = assert_adapter_reproduces_probe(out)
    assert meta["rope_parameters"]["rope_type"] == "linear" and meta["rope_parameters"]["factor"] == 4.0
    assert meta["max_position_embeddings"] == 512 and meta["original_context"] == 256
    record = json.loads((out / "log.jsonl").read_text().splitlines()[-1])
    assert {"loss", "lr", "grad_norm", "tokens_per_s", "peak_mem_mib"} <= set(record)
    assert record["tokens_per_s"] > 0 and record["peak_mem_mib"] > 0
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    assert (out / "recipe.resolved.yaml").is_file()
    # nothing pickled: checkpoints are safetensors + JSON
    assert complete_checkpoints(out) == [2, 4, 6]
    assert {p.suffix for p in (out / "checkpoint-4").iterdir()} == {".safetensors", ".json"}
    ckpt = json.loads((out / "checkpoint-4" / "meta.json").read_text())
    assert ckpt["data"]["micro_batches"] == 4 * 2 and len(ckpt["history"]) == 4 and ckpt["optimizer_steps"] == 4
    optimizer = load_file(str(out / "checkpoint-4" / "optimizer.safetensors"))
    assert any(k.endswith("::exp_avg_sq") and v.abs().sum() > 0 for k, v in optimizer.items())


@pytest.mark.slow
def test_killed_run_resumes_with_the_uninterrupted_loss_curve(tmp_path, common, reference):
    out = tmp_path / "killed"
    argv = [sys.executable, str(ROOT / "train.py"), "recipe=tiny", *common, f"train.output_dir={out}"]
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.time() + 300
    while not (out / "checkpoint-4" / "meta.json").exists():
        assert proc.poll() is None and time.time() < deadline, "run ended before the kill"
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL and not (out / "adapter").exists()
    assert find_resume(out, "auto") is not None
    resumed = train(load_recipe("tiny", [*common, f"train.output_dir={out}"]))
    assert [r["loss"] for r in resumed["history"]] == [r["loss"] for r in reference[1]["history"]]
    assert losses(out) == losses(reference[0])


@pytest.mark.slow
def test_crash_mid_save_resumes_from_the_last_complete_checkpoint(tmp_path, common, reference, monkeypatch):
    out = tmp_path / "crashed"
    real_save = checkpoint._save

    def crash_in_save_6(tensors, path):
        if path.parent.name.startswith("checkpoint-6") and path.name == "optimizer.safetensors":
            raise SimulatedCrash("while writing checkpoint-6")
        real_save(tensors, path)

    monkeypatch.setattr(checkpoint, "_save", crash_in_save_6)
    with pytest.raises(SimulatedCrash):
        train(load_recipe("tiny", [*common, f"train.output_dir={out}"]))
    monkeypatch.undo()
    half = [p for p in out.iterdir() if p.name.startswith("checkpoint-6")]
    assert len(half) == 1 and (half[0] / "trainable.safetensors").exists() and not (half[0] / "meta.json").exists()
    assert complete_checkpoints(out) == [2, 4] and find_resume(out, "auto") == out / "checkpoint-4"
    resumed = train(load_recipe("tiny", [*common, f"train.output_dir={out}"]))
    assert [r["loss"] for r in resumed["history"]] == [r["loss"] for r in reference[1]["history"]]
    assert complete_checkpoints(out) == [2, 4, 6] and not [p for p in out.iterdir() if ".tmp" in p.name]


@pytest.mark.slow
def test_resume_refuses_a_changed_data_order(tmp_path, common, reference):
    out = tmp_path / "changed"
    out.mkdir()
    os.symlink(reference[0] / "checkpoint-2", out / "checkpoint-2")
    with pytest.raises(ValueError, match=r"different data order \(seed: 42 then, 7 now\)"):
        train(load_recipe("tiny", [*common, f"train.output_dir={out}", "train.seed=7"]))


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


def test_plain_torch_refuses_a_multi_process_launch(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="deepspeed=null trains in one process.*WORLD_SIZE=2"):
        init_distributed(use_deepspeed=False)


@pytest.mark.parametrize("argv", [["--local_rank=1", "recipe=tiny", "a.b=1"], ["--local_rank", "1", "recipe=tiny", "a.b=1"],
                                  ["recipe=tiny", "--local-rank=1", "a.b=1"]])
def test_train_py_tolerates_the_launchers_local_rank(argv, monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    parse_argv = runpy.run_path(str(ROOT / "train.py"))["parse_argv"]
    assert parse_argv(argv) == ("tiny", ["a.b=1"])
    assert os.environ["LOCAL_RANK"] == "1"


@pytest.mark.slow
def test_merge_writes_a_plain_model_with_the_trained_positions(tmp_path, reference):
    from transformers import AutoModelForCausalLM

    from sparse_ft.cli import main

    adapter = reference[0] / "adapter"
    assert main(["merge", "--adapter", str(adapter), "--output", str(tmp_path / "merged")]) == 0
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    assert merged.config.rope_parameters["factor"] == 4.0 and merged.config.max_position_embeddings == 512
    assert not list((tmp_path / "merged").glob("*.bin"))
    unmerged = load_adapter_model(adapter).eval()
    ids = load_file(str(reference[0] / "adapter_probe.safetensors"))["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, unmerged(input_ids=ids).logits, atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_prepare_train_builds_the_cache_the_trainer_reuses(tmp_path, common, reference, capsys):
    cache = Path(next(o for o in common if o.startswith("data.cache_dir=")).split("=", 1)[1])
    before = sorted(cache.rglob("*"))
    main = runpy.run_path(str(ROOT / "data" / "prepare_train.py"))["main"]
    assert main(["recipe=tiny", *common, f"train.output_dir={tmp_path / 'run'}"]) == 0
    assert "samples of 512 tokens" in capsys.readouterr().out
    assert sorted(cache.rglob("*")) == before  # found the trainer's cache instead of writing another
