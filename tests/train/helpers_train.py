"""What the training tests share: the tiny recipe's overrides, one uninterrupted reference run
to compare loss curves with, the adapter check, train.py run in this process or as a child,
and a child that pauses in the middle of writing a checkpoint, then SIGKILLs itself or goes on.

Run as a script it is that child: ``python tests/train/helpers_train.py THEN POINT GATE recipe=...``."""

import hashlib
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

ROOT = Path(__file__).resolve().parents[2]
# ``deepspeed`` of the interpreter running the tests, also where DeepSpeed is installed without
# its bin/ script (pip --target, as on the lent GPU machine)
DEEPSPEED = [sys.executable, "-m", "deepspeed.launcher.runner"]
STEPS = 8
# The base already has linear RoPE scaling x2: extending 256 -> 512 must compose to x4, not replace it.
BASE_ROPE = "model.tiny={rope_parameters: {rope_type: linear, factor: 2.0, rope_theta: 10000.0}}"


class SimulatedCrash(BaseException):
    """Like a kill: nothing in the trainer may catch it."""


def overrides(out, cache, *extra):
    return [f"train.output_dir={out}", f"data.cache_dir={cache}", "train.report_to=[none]", *extra]


def write_held_out(path: Path) -> Path:
    """A file for validation to score: the tiny corpus's last four documents (the tests are
    about what validation leaves unchanged, not about a clean split)."""
    path.write_text("".join((ROOT / "data" / "tiny" / "train.jsonl").read_text().splitlines(keepends=True)[-4:]))
    return path


def losses(out):
    """The training steps' losses in log.jsonl (validation lines, which have a ``kind``, aside)."""
    records = [json.loads(line) for line in (Path(out) / "log.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if "kind" not in r]


def curve(summary):
    return [r["loss"] for r in summary["history"]]


def snapshot(directory) -> dict:
    """Every file under ``directory`` by relative path, with a digest of its bytes."""
    root = Path(directory)
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*")) if p.is_file()}


def assert_adapter_reproduces_probe(out):
    """The saved adapter, reloaded with PeftModel.from_pretrained through the trained RoPE,
    gives the logits the model had in memory before saving."""
    from sparse_ft import use_attention
    from sparse_ft.modeling.model_io import load_adapter_model, read_meta

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


def train_py(*argv: str) -> int:
    """``train.py``'s exit code, run in this process."""
    main = runpy.run_path(str(ROOT / "train.py"))["main"]
    saved, sys.argv = sys.argv, ["train.py", *argv]
    try:
        return main()
    finally:
        sys.argv = saved


def default_stop_signals() -> None:
    """A child's SIGINT and SIGTERM set to their default action before it runs (``preexec_fn``).
    A suite started from a shell that ignores them (``nohup``, a background job) passes the
    ignored disposition on to every child, and the trainer leaves an ignored signal ignored on
    purpose: a test that sends one would find it did nothing."""
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_DFL)


def start(argv: list[str], stderr=subprocess.DEVNULL) -> subprocess.Popen:
    """A child Python, stop signals at their default (:func:`default_stop_signals`); its stderr
    where ``stderr`` says (a file: a pipe nobody reads may fill)."""
    return subprocess.Popen([sys.executable, *argv], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=stderr,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, preexec_fn=default_stop_signals)


def wait_for(path: Path, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while not path.exists():
        assert proc.poll() is None and time.time() < deadline, f"the run ended before {path} appeared"
        time.sleep(0.01)


def start_killed_during_save(point: str, gate: Path, argv: list[str]) -> subprocess.Popen:
    """train.py in a child that, at ``point`` of a save, touches ``gate.waiting``, waits for
    ``gate`` and SIGKILLs itself: halfway through writing the file whose path ends with
    ``point`` (e.g. ``checkpoint-6.tmp/meta.json``), or, for a ``checkpoint-N`` name, right
    after it is renamed into place, before older ones are pruned."""
    return start_paused_in_save("kill", point, gate, argv)


def start_paused_in_save(then: str, point: str, gate: Path, argv: list[str], *, stderr=subprocess.DEVNULL) -> subprocess.Popen:
    """As :func:`start_killed_during_save`; once ``gate`` exists the child SIGKILLs itself
    (``then="kill"``) or, paused at a ``checkpoint-N`` point, carries on (``"continue"``: a
    signal sent while it waited lands at a known point of the run)."""
    return start([str(Path(__file__).resolve()), then, point, str(gate), *argv], stderr=stderr)


def _pause_during_save(then: str, point: str, gate: Path) -> None:
    from sparse_ft.train import checkpoint

    def pause() -> None:
        gate.with_suffix(".waiting").touch()
        while not gate.exists():
            time.sleep(0.01)
        if then == "kill":
            os.kill(os.getpid(), signal.SIGKILL)

    write_bytes, fsync_dir = checkpoint.write_synced, checkpoint.fsync_dir

    def half_write(path: Path, data: bytes) -> None:
        if str(path).endswith(point):
            write_bytes(path, data[: len(data) // 2])
            pause()
        write_bytes(path, data)

    def fsync_then_pause(path: Path) -> None:
        fsync_dir(path)
        if (path / point).is_dir():
            pause()

    checkpoint.write_synced, checkpoint.fsync_dir = half_write, fsync_then_pause


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
    from sparse_ft.config import load_recipe
    from sparse_ft.train.trainer import train

    out = tmp_path_factory.mktemp("reference")
    summary = train(load_recipe("tiny", [*common, f"train.output_dir={out}", "train.report_to=[tensorboard]"]))
    return out, summary


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    _pause_during_save(sys.argv[1], sys.argv[2], Path(sys.argv[3]))
    sys.argv = ["train.py", *sys.argv[4:]]
    runpy.run_path(str(ROOT / "train.py"), run_name="__main__")
