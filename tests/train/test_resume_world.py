"""A run resumed on another number of processes continues its epoch: a two-rank ZeRO-3 run
(the ``deepspeed`` launcher, CPU ranks on gloo), resumed after step 2 on one process (plain
torch, two micro-batches a step: the same global batch), whose step-5 checkpoint two ranks
resume again. Every sample of the epoch is trained on exactly once, each step on the samples
the uninterrupted run took, and the loss curve is the uninterrupted one up to float rounding
(all-reduced gradients against accumulated ones). No LoRA dropout: its masks come from per-rank
RNG streams, which another number of ranks cannot continue. Run as a script, this module is
what every rank of a launch runs: the trainer with the samples it trains on recorded."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.train.helpers_train import DEEPSPEED, ROOT, one_thread, overrides  # noqa: F401
from tests.train.test_train_deepspeed import free_port

ALLOW = "train.resume_allow_changes=[world_size,train.gradient_accumulation_steps]"
# one epoch of the first two documents (16 samples of 512 tokens), a checkpoint every step
SETTINGS = ["deepspeed=zero3_cpu_fp32", "data.max_documents=2", "train.max_steps=-1", "train.num_epochs=1",
            "train.gradient_accumulation_steps=1", "train.save_steps=1", "train.save_total_limit=0", "lora.dropout=0"]


def record_samples(setattr, trace: Path) -> None:
    """Each micro-batch the trainer builds, appended to ``trace`` as the dataset indices of its
    rows (found by content) and the step that trains on it."""
    from sparse_ft.train.trainer import Trainer

    step, batch = Trainer._step, Trainer._batch

    def traced_step(self, n):
        self.traced_step = n + 1
        return step(self, n)

    def traced_batch(self, micro):
        rows = batch(self, micro)
        ids = [next(i for i in range(len(self.dataset)) if torch.equal(self.dataset[i]["input_ids"], row))
               for row in rows["input_ids"]]
        with open(trace, "a") as f:
            f.write(json.dumps({"step": self.traced_step, "rank": self.rank, "samples": ids}) + "\n")
        return rows

    setattr(Trainer, "_step", traced_step)
    setattr(Trainer, "_batch", traced_batch)


def samples_by_step(trace: Path, steps: range) -> dict[int, list[int]]:
    found: dict[int, list[int]] = {}
    for line in trace.read_text().splitlines():
        record = json.loads(line)
        if record["step"] in steps:
            found.setdefault(record["step"], []).extend(record["samples"])
    return found


def launch(out: Path, cache: Path, trace: Path, *extra: str) -> str:
    """Two ranks of this module under ``deepspeed --num_gpus 2``; their stdout."""
    argv = [*DEEPSPEED, "--num_gpus", "2", "--master_port", str(free_port()), str(Path(__file__)), str(trace),
            *overrides(out, cache, *SETTINGS, *extra)]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def as_if_killed_after(out: Path, step: int) -> None:
    """What a run killed after checkpoint ``step`` leaves: no later checkpoint, no adapter."""
    for path in out.glob("checkpoint-*"):
        if int(path.name.split("-")[1]) > step:
            shutil.rmtree(path)
    shutil.rmtree(out / "adapter")
    (out / "train_summary.json").unlink()


def losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "log.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_two_ranks_then_one_then_two_train_on_every_sample_once(tmp_path, monkeypatch, capsys):
    from sparse_ft.config import load_recipe
    from sparse_ft.train import checkpoint
    from sparse_ft.train.trainer import train

    out, cache = tmp_path / "run", tmp_path / "cache"
    launch(out, cache, tmp_path / "two.jsonl")  # the uninterrupted run
    samples = checkpoint.read_meta(out / "checkpoint-1")["data"]["samples"]
    steps = samples // 2
    uninterrupted = losses(out)
    assert len(uninterrupted) == steps and checkpoint.complete_checkpoints(out) == list(range(1, steps + 1))
    took = samples_by_step(tmp_path / "two.jsonl", range(1, steps + 1))

    as_if_killed_after(out, 2)
    record_samples(monkeypatch.setattr, tmp_path / "one.jsonl")
    one = ["deepspeed=null", "train.gradient_accumulation_steps=2", ALLOW]
    summary = train(load_recipe("tiny", overrides(out, cache, *SETTINGS, *one)))
    printed = capsys.readouterr().out
    assert "train.gradient_accumulation_steps: 1 then, 2 now; world_size: 2 then, 1 now" in printed
    assert f"resumed from {out / 'checkpoint-2'} at step 2 (epoch 0, after 4 of its {samples} samples)" in printed
    assert summary["steps"] == steps and summary["world_size"] == 1
    monkeypatch.undo()

    as_if_killed_after(out, 5)
    printed = launch(out, cache, tmp_path / "again.jsonl", ALLOW)
    assert f"resumed from {out / 'checkpoint-5'} at step 5 (epoch 0, after 10 of its {samples} samples)" in printed
    resumed = {**samples_by_step(tmp_path / "two.jsonl", range(1, 3)), **samples_by_step(tmp_path / "one.jsonl", range(3, 6)),
               **samples_by_step(tmp_path / "again.jsonl", range(6, steps + 1))}
    seen = [i for step in sorted(resumed) for i in resumed[step]]
    assert sorted(seen) == list(range(samples)) == sorted(i for ids in took.values() for i in ids)  # each once
    assert {s: sorted(ids) for s, ids in resumed.items()} == {s: sorted(ids) for s, ids in took.items()}
    final = losses(out)
    assert len(final) == steps and all(torch.isfinite(torch.tensor(final)))
    print(f"{samples} samples, {steps} steps; largest loss difference to the uninterrupted run: "
          f"{max(abs(a - b) for a, b in zip(final, uninterrupted)):.2e}")
    assert final == pytest.approx(uninterrupted, abs=1e-5)
    assert checkpoint.read_meta(out / f"checkpoint-{steps}")["data"]["consumed"] == samples


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    from sparse_ft.config import load_recipe
    from sparse_ft.train.trainer import train

    torch.set_num_threads(1)
    trace, *args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]  # the launcher's
    record_samples(setattr, Path(trace))
    train(load_recipe("tiny", args))
