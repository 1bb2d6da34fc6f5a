"""A real two-process DeepSpeed ZeRO-3 run on CPU (gloo), started by the ``deepspeed`` launcher
exactly as the README says: the adapter it saves is complete (ZeRO-3 partitions every
parameter; saving without gathering writes empty tensors), reloads with
PeftModel.from_pretrained to the logits the trained model had, and a relaunch, finding the
final checkpoint damaged, resumes from the previous one to the same losses; the same with
ZeRO-3 offloading parameters and optimizer to the CPU (DeepSpeedCPUAdam, built by DeepSpeed on
first use); and SIGTERM sent to one rank only, which every rank acts on at the same step."""

import json
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from tests.train.helpers_train import DEEPSPEED, assert_adapter_reproduces_probe, default_stop_signals, losses, overrides, write_held_out
from sparse_ft.files.outputs import RUN_LOCK
from sparse_ft.train import checkpoint

from sparse_ft.modeling.weight_files import fingerprint

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    """DeepSpeed's default port may be taken by another run on the machine."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def command(out: Path, cache: Path, *extra: str, gpus: int = 2) -> list[str]:
    """``deepspeed --num_gpus GPUS train.py recipe=tiny ...``: CPU ranks on gloo without CUDA."""
    return [*DEEPSPEED, "--num_gpus", str(gpus), "--master_port", str(free_port()), "train.py", "recipe=tiny",
            "attention.pattern=scca_flow",
            "train.max_steps=4", "train.save_steps=2", *overrides(out, cache), *extra]


def launch(out: Path, cache: Path, *extra: str, gpus: int = 2) -> subprocess.CompletedProcess:
    done = subprocess.run(command(out, cache, *extra, gpus=gpus), cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def validations(out: Path) -> list[tuple[int, str]]:
    records = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    return [(r["step"], r["task"]) for r in records if r.get("kind") == "validation"]


@pytest.fixture(scope="module")
def zero3(tmp_path_factory):
    """One uninterrupted two-process ZeRO-3 run, validating every two steps (both ranks take
    part in each forward, rank 0 logs): its directory, token cache and losses. The runs
    compared with it validate nothing: validation must not change the losses. The loss's head
    runs over 96-token chunks (its partitioned weight gathered for each, forward and backward)."""
    root = tmp_path_factory.mktemp("zero3")
    out, cache, held_out = root / "ds", root / "cache", root / "held_out.jsonl"
    launch(out, cache, "train.loss_chunk_tokens=96", "validation.every_steps=2", f"validation.data={write_held_out(held_out)}",
           "validation.params={ppl: {max_windows: 2}}")
    return out, cache, losses(out)


@pytest.mark.slow
def test_two_process_deepspeed_zero3_on_cpu_saves_a_complete_adapter_and_resumes(zero3):
    out, cache, first = zero3
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 4
    meta = assert_adapter_reproduces_probe(out)
    assert meta["train_attention"]["pattern"] == "scca_flow"
    # read from the base's files, not from the ZeRO-3 partitions: what eval and merge compare with
    assert meta["base_fingerprint"] == fingerprint(str(out / "base-model"))
    assert meta["rope_parameters"]["factor"] == 2.0 and meta["max_position_embeddings"] == 512
    assert len(first) == 4
    assert validations(out) == [(2, "ppl"), (4, "ppl")]

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
    assert validations(out) == [(2, "ppl")]  # kept by checkpoint-2; the relaunch validates nothing
    assert_adapter_reproduces_probe(out)


@pytest.mark.slow
def test_zero3_chunked_loss_trains_as_the_models_own_loss(zero3, tmp_path):
    out, cache, chunked = zero3
    launch(tmp_path / "model_loss", cache, "train.loss=model")
    assert losses(tmp_path / "model_loss") == pytest.approx(chunked, abs=1e-5)


@pytest.mark.slow
def test_sigterm_to_one_rank_stops_every_rank_at_the_same_step_and_resumes(tmp_path, zero3):
    """Slurm signals every process; a launcher or a node's own kill may reach one rank only.
    Rank 1 alone gets SIGTERM once step 1 is logged: the ranks agree (an all-reduce per step)
    and stop after the same step, which is saved with both ranks' RNG; rank 0 prints one line;
    the ranks exit 143 and the launcher passes it on. The relaunch resumes to the
    uninterrupted run's losses."""
    out, log = tmp_path / "ds", tmp_path / "output"
    with open(log, "w") as output:
        proc = subprocess.Popen(command(out, zero3[1]), cwd=ROOT, stdout=output, stderr=subprocess.STDOUT,
                                preexec_fn=default_stop_signals)  # ranks inherit it: SIGTERM acts though the suite ignores it
        while not ((out / "log.jsonl").is_file() and (out / "log.jsonl").read_text()):
            assert proc.poll() is None, log.read_text()[-3000:]
            time.sleep(0.05)
        (rank1,) = [p for p in psutil.Process(proc.pid).children(recursive=True) if "--local_rank=1" in p.cmdline()]
        rank1.send_signal(signal.SIGTERM)
        proc.wait(timeout=900)
    printed = log.read_text()
    assert proc.returncode == 143, printed[-3000:]
    (line,) = [line for line in printed.splitlines() if line.startswith("train.py: ")]
    stopped = re.fullmatch(r"train\.py: preempted by SIGTERM at step (\d+): saved checkpoint-\1; resume with the same command", line)
    assert stopped and 2 <= int(stopped[1]) <= 4, line
    step = int(stopped[1])
    saved = out / f"checkpoint-{step}"
    assert checkpoint.verify(saved)["world_size"] == 2 and (saved / checkpoint.rng_file(1)).is_file()
    assert not (out / RUN_LOCK).exists() and not (out / "adapter").exists() and "Traceback" not in printed
    done = launch(out, zero3[1])
    assert f"resumed from {saved} at step {step}" in done.stdout
    assert losses(out) == pytest.approx(zero3[2], abs=1e-5)


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
