"""A real two-process DeepSpeed ZeRO-3 run on CPU (gloo), started by the ``deepspeed`` launcher
exactly as the README says: the adapter it saves is complete (ZeRO-3 partitions every
parameter; saving without gathering writes empty tensors), reloads with
PeftModel.from_pretrained to the logits the trained model had, and a relaunch, finding the
final checkpoint damaged, resumes from the previous one to the same losses; the same with
ZeRO-3 offloading parameters and optimizer to the CPU (DeepSpeedCPUAdam, built by DeepSpeed on
first use)."""

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from helpers_train import assert_adapter_reproduces_probe, losses, overrides

from sparse_ft.modeling.weight_files import fingerprint

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    """DeepSpeed's default port may be taken by another run on the machine."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(out: Path, cache: Path, *extra: str, gpus: int = 2) -> subprocess.CompletedProcess:
    """``deepspeed --num_gpus GPUS train.py recipe=tiny ...``: CPU ranks on gloo without CUDA."""
    launcher = Path(sys.executable).parent / "deepspeed"
    argv = [str(launcher), "--num_gpus", str(gpus), "--master_port", str(free_port()), "train.py", "recipe=tiny", "attention.pattern=scca_flow",
            "train.max_steps=4", "train.save_steps=2", *overrides(out, cache), *extra]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


@pytest.mark.slow
def test_two_process_deepspeed_zero3_on_cpu_saves_a_complete_adapter_and_resumes(tmp_path):
    out, cache = tmp_path / "ds", tmp_path / "cache"
    launch(out, cache)
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 4
    meta = assert_adapter_reproduces_probe(out)
    assert meta["train_attention"]["pattern"] == "scca_flow"
    # read from the base's files, not from the ZeRO-3 partitions: what eval and merge compare with
    assert meta["base_fingerprint"] == fingerprint(str(out / "base-model"))
    assert meta["rope_parameters"]["factor"] == 2.0 and meta["max_position_embeddings"] == 512
    first = losses(out)
    assert len(first) == 4

    # relaunch into the same directory: the final checkpoint-4 truncated (rank 0 names it and
    # falls back to checkpoint-2, the other rank follows) and a half-written one ignored
    trainable = out / "checkpoint-4" / "trainable.safetensors"
    trainable.write_bytes(trainable.read_bytes()[:100])
    (out / "checkpoint-4.tmp").mkdir()
    (out / "checkpoint-4.tmp" / "trainable.safetensors").write_bytes(b"half")
    for path in (out / "adapter_probe.safetensors", out / "train_summary.json"):
        path.unlink()
    done = launch(out, cache)
    assert f"skipping checkpoint-4: {trainable}: 100 bytes, meta.json recorded" in done.stdout
    assert f"resumed from {out / 'checkpoint-2'} at step 2" in done.stdout
    assert losses(out) == pytest.approx(first, abs=1e-5)
    assert_adapter_reproduces_probe(out)


@pytest.mark.slow
def test_zero3_offload_to_cpu_saves_a_complete_adapter_and_resumes(tmp_path):
    """The V100 16k recipe's setting (ZeRO-3 with parameter and optimizer offload) on CPU ranks."""
    config = json.loads((ROOT / "ds_configs" / "zero3_cpu_fp32.json").read_text())
    config["zero_optimization"] |= {"offload_optimizer": {"device": "cpu", "pin_memory": False},
                                    "offload_param": {"device": "cpu", "pin_memory": False}}
    ds_config = tmp_path / "zero3_offload_cpu_fp32.json"
    ds_config.write_text(json.dumps(config))
    out, cache = tmp_path / "ds", tmp_path / "cache"
    launch(out, cache, f"deepspeed={ds_config}")
    assert json.loads((out / "train_summary.json").read_text())["world_size"] == 2
    assert_adapter_reproduces_probe(out)
    first = losses(out)
    (out / "checkpoint-4" / "meta.json").write_text("{")
    for path in (out / "adapter_probe.safetensors", out / "train_summary.json"):
        path.unlink()
    done = launch(out, cache, f"deepspeed={ds_config}")
    assert f"resumed from {out / 'checkpoint-2'} at step 2" in done.stdout
    assert losses(out) == pytest.approx(first, abs=1e-5)
    assert_adapter_reproduces_probe(out)
