"""Faults a training run meets, each injected on purpose: SIGKILL in the middle of a save,
SIGTERM / SIGINT (preemption), a corrupt latest checkpoint, a full disk, a second run in the
same directory, a stale lock, a fresh run over an old one, a resume with the recipe changed,
with its data edited in place, or onto a base of other shapes, a loss, gradient or weight gone
non-finite. Every case asserts that nothing the user had is lost and, where the run resumes,
that its loss curve is the uninterrupted one. (The two-process DeepSpeed cases, a corrupt
checkpoint and a signal to one rank, are in test_train_deepspeed.py.)"""

import errno
import functools
import itertools
import json
import os
import re
import shutil
import signal
import socket
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.train.helpers_train import (ROOT, common, curve, losses, one_thread, reference, snapshot, start,  # noqa: F401
                           start_killed_during_save, start_paused_in_save, train_py, wait_for)
from sparse_ft.config import load_recipe
from sparse_ft.train import checkpoint, stopping
from sparse_ft.train.deepspeed import DeepSpeedEngine
from sparse_ft.train.engine import Engine
from sparse_ft.train.checkpoint import complete_checkpoints, verify
from sparse_ft.files.outputs import RUN_LOCK as LOCK, RunLock
from sparse_ft.files.outputs import OUTPUT_MARKER
from sparse_ft.train.run_directory import claim
from sparse_ft.train.trainer import train


def run_in(out, common, *extra):
    return ["recipe=tiny", *common, f"train.output_dir={out}", *extra]


def resume(out, common, *extra) -> dict:
    return train(load_recipe("tiny", [*common, f"train.output_dir={out}", *extra]))


def copy_checkpoints(reference_dir: Path, out: Path, *steps: int) -> None:
    out.mkdir()
    for step in steps:
        shutil.copytree(reference_dir / f"checkpoint-{step}", out / f"checkpoint-{step}")


def one_error_line(err: str) -> str:
    """train.py's error: one line, no traceback (progress bars may surround it)."""
    lines = [line for line in err.splitlines() if line.startswith("train.py: error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.slow
@pytest.mark.parametrize("point", ["checkpoint-6.tmp/optimizer.safetensors", "checkpoint-6.tmp/meta.json", "checkpoint-6"])
def test_sigkill_during_save_refuses_a_second_run_and_resumes_exactly(tmp_path, common, reference, point, capsys):
    """A run is killed halfway through a file of checkpoint 6, or right after renaming it into
    place. While it runs, a second run into its directory is refused; after the kill its lock
    is stale and the relaunch takes it over and resumes to the uninterrupted loss curve."""
    out, gate = tmp_path / "run", tmp_path / "gate"
    proc = start_killed_during_save(point, gate, run_in(out, common))
    wait_for(gate.with_suffix(".waiting"), proc)
    before = snapshot(out)
    assert train_py(*run_in(out, common)) == 2
    line = one_error_line(capsys.readouterr().err)
    assert f"train.output_dir={out} is in use by another run (pid {proc.pid} on {socket.gethostname()}" in line
    assert snapshot(out) == before
    gate.touch()
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL and not (out / "adapter").exists()
    kept = {step: snapshot(out / f"checkpoint-{step}") for step in complete_checkpoints(out)}
    assert sorted(kept) == ([2, 4, 6] if point == "checkpoint-6" else [2, 4])
    resumed = resume(out, common)
    printed = capsys.readouterr().out
    assert f"taking over the stale lock {out / LOCK} of pid {proc.pid}" in printed
    assert f"resumed from {out / f'checkpoint-{max(kept)}'}" in printed
    assert curve(resumed) == curve(reference[1]) and losses(out) == losses(reference[0])
    assert all(snapshot(out / f"checkpoint-{step}") == files for step, files in kept.items())
    assert complete_checkpoints(out) == [2, 4, 6, 8] and not (out / LOCK).exists()


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.slow
@pytest.mark.parametrize("name, damage, problem", [
    ("trainable.safetensors", truncate, "bytes, meta.json recorded"),
    ("optimizer.safetensors", flip_a_byte, "its sha256 differs"),
    ("meta.json", lambda p: p.write_text('{"step": 6, "hist'), "unreadable"),
    ("meta.json", lambda p: p.write_text(p.read_text().replace('"step": 6', '"step": 7')), "checksum does not match"),
])
def test_a_corrupt_latest_checkpoint_is_named_and_the_previous_one_resumed(tmp_path, common, reference, name, damage, problem, capsys):
    out = tmp_path / "run"
    copy_checkpoints(reference[0], out, 2, 4, 6)
    damage(out / "checkpoint-6" / name)
    kept = {step: snapshot(out / f"checkpoint-{step}") for step in (2, 4)}
    resumed = resume(out, common)
    printed = capsys.readouterr().out
    assert f"skipping checkpoint-6: {out / 'checkpoint-6' / name}: " in printed and problem in printed
    assert f"resumed from {out / 'checkpoint-4'} at step 4" in printed
    assert curve(resumed) == curve(reference[1])
    assert all(snapshot(out / f"checkpoint-{step}") == files for step, files in kept.items())
    verify(out / "checkpoint-6")  # written again by the resumed run


def test_no_usable_checkpoint_is_a_clear_error(tmp_path, common, reference, capsys):
    out = tmp_path / "run"
    copy_checkpoints(reference[0], out, 4)
    truncate(out / "checkpoint-4" / "optimizer.safetensors")
    before = snapshot(out)
    assert train_py(*run_in(out, common)) == 2
    line = one_error_line(capsys.readouterr().err)
    assert f"no usable checkpoint in {out} ({out / 'checkpoint-4' / 'optimizer.safetensors'}: " in line
    assert snapshot(out) == before


@pytest.mark.slow
def test_a_full_disk_fails_the_save_clearly_and_the_relaunch_resumes_exactly(tmp_path, common, reference, monkeypatch, capsys):
    out = tmp_path / "run"
    write_bytes = checkpoint.write_synced

    def disk_full_in_checkpoint_6(path: Path, data: bytes) -> None:
        if path.parent.name == "checkpoint-6.tmp" and path.name == "optimizer.safetensors":
            with open(path, "wb") as f:
                f.write(data[: len(data) // 3])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        write_bytes(path, data)

    monkeypatch.setattr(checkpoint, "write_synced", disk_full_in_checkpoint_6)
    assert train_py(*run_in(out, common)) == 1
    line = one_error_line(capsys.readouterr().err)
    assert f"could not write {out / 'checkpoint-6'}: No space left on device" in line
    assert "the earlier checkpoints are intact (latest: checkpoint-4)" in line
    monkeypatch.undo()
    assert complete_checkpoints(out) == [2, 4] and not (out / "checkpoint-6.tmp").exists() and not (out / LOCK).exists()
    for step in (2, 4):
        verify(out / f"checkpoint-{step}")
        for name in ("trainable.safetensors", "optimizer.safetensors"):
            assert (out / f"checkpoint-{step}" / name).read_bytes() == (reference[0] / f"checkpoint-{step}" / name).read_bytes()
    assert curve(resume(out, common)) == curve(reference[1])


def _full_disk_in_the_log(monkeypatch, out):
    """The second line appended to log.jsonl meets a full disk (open fails as a full disk's
    write does, without naming the file)."""
    from sparse_ft.train import metrics

    appended = itertools.count()

    def full(path, mode="r", *args, **kwargs):
        if Path(path) == out / "log.jsonl" and mode == "a" and next(appended) == 1:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return open(path, mode, *args, **kwargs)

    monkeypatch.setattr(metrics, "open", full, raising=False)
    return out / "log.jsonl", "no earlier checkpoint"


def _full_disk_in_the_probe(monkeypatch, out):
    """The end-of-run save's first file (it was a SafetensorError traceback)."""
    from sparse_ft.train import trainer

    write = trainer.write_synced

    def full(path, data):
        if path.name == "adapter_probe.safetensors":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        write(path, data)

    monkeypatch.setattr(trainer, "write_synced", full)
    return out / "adapter_probe.safetensors", "the earlier checkpoints are intact (latest: checkpoint-2)"


def _full_disk_in_the_adapter(monkeypatch, out):
    """PEFT's safetensors write of the final adapter, which reports a full disk as a SafetensorError."""
    import peft.peft_model
    from safetensors import SafetensorError

    write = peft.peft_model.safe_save_file

    def full(tensors, filename, *args, **kwargs):
        if "checkpoint-" not in str(filename):  # the final adapter's (a checkpoint's is the same call)
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        write(tensors, filename, *args, **kwargs)

    monkeypatch.setattr(peft.peft_model, "safe_save_file", full)
    return None, "the earlier checkpoints are intact (latest: checkpoint-2)"


@pytest.mark.parametrize("full_disk", [_full_disk_in_the_log, _full_disk_in_the_probe, _full_disk_in_the_adapter],
                         ids=["log", "probe", "adapter"])
def test_a_full_disk_in_any_write_of_the_run_is_one_line(tmp_path, common, monkeypatch, capsys, full_disk):
    """Issue 31: ENOSPC in the loop's log or in the end-of-run save (the probe, the adapter) is
    the one line a checkpoint's full disk gives, exit 1, the lock released and no adapter left;
    after the end's, the relaunch resumes at the last checkpoint and saves."""
    out = tmp_path / "run"
    failed, kept = full_disk(monkeypatch, out)
    assert train_py(*run_in(out, common, "train.max_steps=2")) == 1
    line = one_error_line(capsys.readouterr().err)
    target = re.escape(str(failed)) if failed else re.escape(str(out)) + r"/\S*adapter\S*/adapter_model.safetensors"
    assert re.fullmatch(rf"train.py: error: could not write {target}: No space left on device(?: \(.*\))?; "
                        rf"{re.escape(kept)}: free the space and relaunch to resume", line), line
    assert not (out / LOCK).exists() and not (out / "adapter").exists()
    monkeypatch.undo()
    if failed is not None and failed.name == "adapter_probe.safetensors":
        assert train_py(*run_in(out, common, "train.max_steps=2")) == 0
        assert (out / "adapter" / "adapter_model.safetensors").is_file() and (out / "adapter_probe.safetensors").is_file()


def test_a_full_disk_in_tensorboards_writer_thread_is_one_line(tmp_path, common, monkeypatch, capsys):
    """Issue 31: TensorBoard writes from a thread of its own; a full disk there printed that
    thread's traceback ("Exception in thread ...") before the run's line. The disk fills when
    the first training scalar is written: the run ends in the one line, naming TensorBoard's
    directory, and an error of any other thread still reaches the hook it had."""
    import threading

    from tensorboard.compat.tensorflow_stub.io import gfile

    append = gfile.LocalFileSystem.append

    def full(self, filename, file_content, binary_mode=False):
        if b"train/" in file_content:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        append(self, filename, file_content, binary_mode)

    monkeypatch.setattr(gfile.LocalFileSystem, "append", full)
    printed = []  # what reaches the hook that prints a thread's traceback (pytest's own, in the suite)
    monkeypatch.setattr(threading, "excepthook", printed.append)
    out = tmp_path / "run"
    assert train_py(*run_in(out, common, "train.max_steps=3", "train.report_to=[tensorboard]")) == 1
    line = one_error_line(capsys.readouterr().err)
    assert line.startswith(f"train.py: error: could not write {out / 'tensorboard'}: No space left on device; "), line
    assert printed == [] and not (out / LOCK).exists()
    other = threading.Thread(target=lambda: 1 / 0)
    other.start()
    other.join()
    assert [type(args.exc_value) for args in printed] == [ZeroDivisionError]


def test_a_lock_held_elsewhere_is_refused_and_a_dead_one_here_taken_over(tmp_path, capsys):
    lock = tmp_path / LOCK
    lock.write_text(json.dumps({"pid": 1234, "host": "another-node", "since": 0}))
    with pytest.raises(ValueError, match=rf"in use by another run \(pid 1234 on another-node, since .*delete {lock}"):
        RunLock(tmp_path).acquire()
    lock.write_text(json.dumps({"pid": os.getppid(), "host": socket.gethostname(), "since": 0}))  # alive
    with pytest.raises(ValueError, match=f"pid {os.getppid()} on {socket.gethostname()}"):
        RunLock(tmp_path).acquire()
    dead = start(["-c", "pass"])  # a process that has exited
    dead.wait()
    lock.write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname(), "since": 0}))
    mine = RunLock(tmp_path)
    mine.acquire()
    assert f"taking over the stale lock {lock} of pid {dead.pid}" in capsys.readouterr().out
    assert json.loads(lock.read_text())["pid"] == os.getpid()
    mine.release()
    assert not lock.exists()


@pytest.mark.slow
def test_a_fresh_run_over_an_old_one_is_refused_unless_told_to_delete_its_checkpoints(tmp_path, common, reference, capsys):
    """The issue's case: an earlier, longer run left checkpoint-10. A fresh run that kept it
    would prune its own checkpoints by step and leave the old one for a later resume."""
    out = tmp_path / "run"
    shutil.copytree(reference[0], out)
    shutil.copytree(out / "checkpoint-8", out / "checkpoint-10")
    (out / "notes.txt").write_text("mine")
    before = snapshot(out)
    assert train_py(*run_in(out, common, "train.resume=never")) == 2
    line = one_error_line(capsys.readouterr().err)
    earlier = ("checkpoint-2, checkpoint-4, checkpoint-6, checkpoint-8, checkpoint-10, adapter, train_summary.json, "
               "adapter_probe.safetensors")
    assert f"train.output_dir={out} holds an earlier run's {earlier}; resume it with train.resume=auto" in line
    assert "train.overwrite_output_dir=true" in line and snapshot(out) == before
    assert train_py(*run_in(out, common, "train.resume=never", "train.overwrite_output_dir=true")) == 0
    assert f"train.overwrite_output_dir: deleted {earlier} from" in capsys.readouterr().out
    assert complete_checkpoints(out) == [2, 4, 6, 8] and losses(out) == losses(reference[0])
    assert (out / "notes.txt").read_text() == "mine"


def test_overwrite_output_dir_deletes_its_own_checkpoints_and_results_and_nothing_else(tmp_path):
    """sparse-ft's checkpoints carry meta.json (a save in progress, the marker, or before
    markers only a checkpoint's files); the user's checkpoint-best, though a copy of one, has a
    name no save writes, and stays."""
    marks = {"checkpoint-2": checkpoint.META, "checkpoint-4.tmp": OUTPUT_MARKER, "checkpoint-6.tmp": checkpoint.TRAINABLE,
             "checkpoint-best": checkpoint.META,
             "adapter": OUTPUT_MARKER, "tensorboard": "events"}
    for name, file in marks.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / file).write_text(name)
    for name in ("log.jsonl", "recipe.resolved.yaml", "notes.txt", "train_summary.json"):
        (tmp_path / name).write_text(name)
    deleted = ("checkpoint-2/", "checkpoint-4.tmp/", "checkpoint-6.tmp/", "adapter/", "train_summary.json")
    others = {k: v for k, v in snapshot(tmp_path).items() if not k.startswith(deleted)}
    claim(tmp_path, "auto", overwrite=False)  # a resume of the same run claims nothing
    claim(tmp_path, "never", overwrite=True)
    assert snapshot(tmp_path) == others and "checkpoint-best/meta.json" in others


SHAPED = "lora.r shape(s) the trained tensors, which no resume can change (not even train.resume_allow_changes)"


@pytest.mark.parametrize("change, named, remedy", [
    (["lora.r=16"], "lora.r: 8 then, 16 now", SHAPED),
    # allowed, but no checkpoint's tensors continue under another shape: refused before the model loads
    (["lora.r=16", "train.resume_allow_changes=[lora.r]"], "lora.r: 8 then, 16 now", SHAPED),
    (["train.lr=0.002"], "train.lr: 0.001 then, 0.002 now", "list them in train.resume_allow_changes=[train.lr]"),
    # allowed, but the run's base-model/ was written once from the old value: it would train on that
    (["model.tiny.rope_parameters.factor=4.0", "train.resume_allow_changes=[model.tiny]"], "model.tiny: {",
     "model.tiny built the base this run wrote into its directory (base-model/) and trains on, which no resume can change"),
    (["attention.pattern=s2"], "attention.pattern: 'scca_flow' then, 's2' now",
     "list them in train.resume_allow_changes=[attention.pattern,"),
])
def test_a_resume_with_a_changed_recipe_is_refused_by_name(tmp_path, common, reference, change, named, remedy, capsys):
    out = tmp_path / "run"
    copy_checkpoints(reference[0], out, 4)
    shutil.copy(reference[0] / "recipe.resolved.yaml", out)
    before = snapshot(out)
    assert train_py(*run_in(out, common, *change)) == 2
    line = one_error_line(capsys.readouterr().err)
    assert f"train.resume: {out / 'checkpoint-4'} was written with other settings (" in line and named in line
    assert remedy in line
    assert snapshot(out) == before  # recipe.resolved.yaml included


@pytest.mark.slow
def test_a_resume_on_changed_data_of_the_same_size_is_refused_by_name(tmp_path, common, capsys):
    """The recipe unchanged, its data file edited in place (one byte: the same number of
    samples): the checkpoint's token-cache sha256 names the change, in one line, before the
    model loads; allowing data.source continues on the new data."""
    out, data = tmp_path / "run", tmp_path / "docs.jsonl"
    shutil.copy(ROOT / "data" / "tiny" / "train.jsonl", data)
    run = [*common, f"data.source={data}", "data.max_documents=2", "train.max_steps=3"]
    assert train_py(*run_in(out, run, "train.max_steps=2")) == 0
    data.write_text(data.read_text().replace("Heap queue", "Heap Queue", 1))
    before = snapshot(out)
    assert train_py(*run_in(out, run, "train.resume_allow_changes=[train.max_steps]")) == 2
    line = one_error_line(capsys.readouterr().err)
    assert f"train.resume: {out / 'checkpoint-2'} was written on other training data (sha256: '" in line
    assert "list data.source in train.resume_allow_changes to continue on the new data" in line and "samples:" not in line
    assert snapshot(out) == before
    assert train_py(*run_in(out, run, "train.resume_allow_changes=[train.max_steps,data.source]")) == 0
    assert f"resumed from {out / 'checkpoint-2'} at step 2" in capsys.readouterr().out
    assert checkpoint.read_meta(out / "checkpoint-3")["data"]["sha256"] != checkpoint.read_meta(out / "checkpoint-2")["data"]["sha256"]


@pytest.mark.slow
def test_a_resume_onto_a_base_of_other_shapes_is_refused_by_name_even_when_allowed(tmp_path, capsys):
    from sparse_ft.modeling.tiny import tiny_llama, tiny_tokenizer

    other, out = tmp_path / "wider", tmp_path / "run"
    tiny_llama(hidden_size=128, intermediate_size=256).save_pretrained(other)
    tiny_tokenizer().save_pretrained(other)
    run = ["recipe=tiny", "deepspeed=null", f"train.output_dir={out}", f"data.cache_dir={tmp_path / 'cache'}",
           "train.report_to=[none]", "data.max_documents=2", "train.max_steps=2"]
    assert train_py(*run) == 0
    kept = snapshot(out / "checkpoint-2")
    assert train_py(*run, f"model.name_or_path={other}", "train.resume_allow_changes=[model.name_or_path]") == 2
    line = one_error_line(capsys.readouterr().err)
    assert (f"train.resume: {out / 'checkpoint-2'} has a tensor of shape (384, 64) for the trainable parameter "
            "base_model.model.model.embed_tokens.modules_to_save.default.weight of shape (384, 128)") in line
    assert snapshot(out / "checkpoint-2") == kept


@pytest.mark.slow
def test_a_change_the_recipe_allows_resumes(tmp_path, common, reference, capsys):
    out = tmp_path / "run"
    copy_checkpoints(reference[0], out, 4)
    resumed = resume(out, common, "train.lr=0.002", "train.resume_allow_changes=[train.lr]")
    assert f"resuming {out / 'checkpoint-4'} with train.lr: 0.001 then, 0.002 now" in capsys.readouterr().out
    assert curve(resumed)[:4] == curve(reference[1])[:4] and curve(resumed)[4:] != curve(reference[1])[4:]
    assert checkpoint.read_meta(out / "checkpoint-8")["fingerprint"]["train.lr"] == 0.002


@pytest.mark.parametrize("extra, message", [
    (["train.overwrite_output_dir=true"], "train.overwrite_output_dir=True is invalid: only applies with train.resume=never"),
    (["train.resume_allow_changes=[train.output_dir]"],
     "train.resume_allow_changes=['train.output_dir'] is invalid: entries allowed: model."),
])
def test_the_new_keys_are_checked_when_the_recipe_loads(extra, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_recipe("tiny", ["deepspeed=null", *extra])


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_finishes_the_step_saves_and_resumes_exactly(tmp_path, common, reference, signum):
    """The signal reaches a real train.py while it writes checkpoint 4 (paused right after the
    rename): step 5 runs to its end, checkpoint-5 is written, the lock released, one line
    printed, exit 128 + the signal; the relaunch resumes to the uninterrupted loss curve."""
    out, gate, err = tmp_path / "run", tmp_path / "gate", tmp_path / "stderr"
    with open(err, "w") as stderr:
        proc = start_paused_in_save("continue", "checkpoint-4", gate, run_in(out, common), stderr=stderr)
        wait_for(gate.with_suffix(".waiting"), proc)
        proc.send_signal(signum)
        gate.touch()
        proc.wait(timeout=120)
    printed = err.read_text()
    assert proc.returncode == 128 + signum, printed[-3000:]
    name = signal.Signals(signum).name
    assert [line for line in printed.splitlines() if line.startswith("train.py: ")] == [
        f"train.py: preempted by {name} at step 5: saved checkpoint-5; resume with the same command"]
    assert "Traceback" not in printed and "KeyboardInterrupt" not in printed
    assert complete_checkpoints(out) == [2, 4, 5] and not (out / LOCK).exists() and not (out / "adapter").exists()
    verify(out / "checkpoint-5")
    assert checkpoint.read_meta(out / "checkpoint-5")["optimizer_steps"] == 5
    resumed = resume(out, common)
    assert curve(resumed) == curve(reference[1]) and losses(out) == losses(reference[0])
    assert complete_checkpoints(out) == [2, 4, 5, 6, 8]


@pytest.mark.slow
def test_save_minutes_adds_checkpoints_by_the_clock(tmp_path, common, reference, monkeypatch):
    """A clock that moves 25 s per reading against train.save_minutes=1: due at the third
    reading after each save, so checkpoints land at steps 3 and 6 (and the last, 8), none from
    train.save_steps; the training itself is the uninterrupted one."""
    clock = itertools.count(step=25)
    monkeypatch.setattr(stopping, "monotonic", lambda: next(clock))
    out = tmp_path / "run"
    summary = resume(out, common, "train.save_minutes=1", "train.save_steps=1000")
    assert complete_checkpoints(out) == [3, 6, 8]
    assert curve(summary) == curve(reference[1])


def nan_loss_from_step(step: int, accum: int = 2):
    """``Engine.micro_step`` whose forward gives nan logits (so a nan loss, nan gradients and,
    were it applied, nan weights) from the first micro-batch of optimizer step ``step`` on."""
    calls, real = itertools.count(1), Engine.micro_step

    def micro_step(self, batch):
        if next(calls) <= (step - 1) * accum:
            return real(self, batch)
        handle = self.module.get_output_embeddings().register_forward_hook(lambda module, args, out: out * float("nan"))
        try:
            return real(self, batch)
        finally:
            handle.remove()

    return micro_step


def inf_gradients_from_step(step: int, accum: int = 2):
    """``Engine.micro_step`` that leaves an inf in a gradient at the end of optimizer step
    ``step`` and every later one: what fp16's scaled gradients do when they overflow."""
    calls, real = itertools.count(1), Engine.micro_step

    def micro_step(self, batch):
        loss = real(self, batch)
        if next(calls) >= step * accum:
            next(p for p in self.module.parameters() if p.requires_grad).grad.view(-1)[0] = float("inf")
        return loss

    return micro_step


@pytest.mark.slow
def test_a_nan_loss_stops_the_run_keeping_the_last_good_checkpoint(tmp_path, common, reference, monkeypatch, capsys):
    out = tmp_path / "run"
    monkeypatch.setattr(Engine, "micro_step", nan_loss_from_step(5))
    assert train_py(*run_in(out, common)) == 1
    line = one_error_line(capsys.readouterr().err)
    assert line == (f"train.py: error: step 5: the loss is nan: training diverged; kept {out / 'checkpoint-4'} (the last good one), "
                    "saved no adapter; lower train.lr or look at the data")
    assert complete_checkpoints(out) == [2, 4] and not list(out.glob("checkpoint-*.tmp"))
    assert not (out / "adapter").exists() and not (out / LOCK).exists()
    assert losses(out) == losses(reference[0])[:4]  # the nan step is not logged
    for name in ("trainable.safetensors", "optimizer.safetensors"):
        assert (out / "checkpoint-4" / name).read_bytes() == (reference[0] / "checkpoint-4" / name).read_bytes()


@pytest.mark.slow
def test_an_update_to_non_finite_weights_is_never_checkpointed(tmp_path, common, monkeypatch, capsys):
    """Finite loss and gradient norm, but the update of step 4 leaves an inf in a weight (an
    exploding lr would): checkpoint 4 is refused before a byte is written."""
    out = tmp_path / "run"
    real = Engine.optimizer_step

    def optimizer_step(self):
        norm = real(self)
        if self.get_steps() == 4:
            with torch.no_grad():
                next(p for p in self.module.parameters() if p.requires_grad).view(-1)[0] = float("inf")
        return norm

    monkeypatch.setattr(Engine, "optimizer_step", optimizer_step)
    assert train_py(*run_in(out, common)) == 1
    line = one_error_line(capsys.readouterr().err)
    assert line.startswith("train.py: error: step 4: its update left non-finite values in base_model.model.")
    assert line.endswith(f": training diverged; kept {out / 'checkpoint-2'} (the last good one), saved no adapter; "
                         "lower train.lr or look at the data")
    assert complete_checkpoints(out) == [2] and not list(out.glob("checkpoint-4*")) and not (out / "adapter").exists()


@pytest.mark.slow
def test_fp16_overflow_steps_are_skipped_until_the_loss_scale_falls_below_1(tmp_path, common, monkeypatch, capsys):
    """Plain-torch fp16 from a loss scale of 2: step 3's overflow is the loss scaler's to skip
    (scale 2 -> 1, logged with grad_norm inf); step 4's would need a scale below 1, so the
    gradients overflow unscaled: the run stops there."""
    out = tmp_path / "run"
    monkeypatch.setattr(torch.amp, "GradScaler", functools.partial(torch.amp.GradScaler, init_scale=2.0))
    monkeypatch.setattr(Engine, "micro_step", inf_gradients_from_step(3))
    assert train_py(*run_in(out, common, "model.dtype=float16")) == 1
    line = one_error_line(capsys.readouterr().err)
    assert line.startswith(f"train.py: error: step 4: the gradient norm is inf: training diverged; kept {out / 'checkpoint-2'} ")
    log = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert [r["grad_norm"] == float("inf") for r in log] == [False, False, True]
    assert complete_checkpoints(out) == [2] and not (out / "adapter").exists()


@pytest.mark.parametrize("fp16, applied, norm, expected", [
    (True, False, float("inf"), True),    # fp16's loss scaler skipped an overflow: DeepSpeed's to handle
    (False, False, float("inf"), False),  # bf16/fp32: DeepSpeed skipped a non-finite gradient: a divergence
    (True, True, float("nan"), False),
    (False, True, None, True),            # ZeRO-1/2 compute_grad_norm=false: no norm to judge
])
def test_deepspeed_fp16_overflow_steps_are_not_a_divergence(fp16, applied, norm, expected):
    """DeepSpeed (0.19: zero/stage3.py, stage_1_and_2.py) skips every step whose gradient norm
    is not finite, reports the norm as inf and ``was_step_applied() == False``; only fp16's
    are the loss scaler's overflows, which it bounds itself at min_loss_scale."""
    engine = DeepSpeedEngine.__new__(DeepSpeedEngine)
    engine.engine = SimpleNamespace(fp16_enabled=lambda: fp16, was_step_applied=lambda: applied, get_global_grad_norm=lambda: norm)
    assert engine.non_finite_norm_expected() is expected
