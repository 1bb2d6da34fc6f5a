"""Nothing that sparse-ft did not write is deleted or overwritten, by any
command. One test per class of fault, each asserting the exit code, the one-line message and
that nothing the user had changed (every path under the test's directory, links included,
with its bytes, before and after):

* a fixed sibling name (``NAME.old``, ``NAME.tmp``) taken as scratch space;
* an output that is, holds or lies inside an input;
* an existing file or directory that sparse-ft did not write, or wrote but was not told to
  replace;
* a training run over an earlier run's results, over a checkpoint-named directory of the
  user's, or in the current directory;
* a write through a symbolic link.
"""

import errno
import hashlib
import json
import os
import re
import shutil
from pathlib import Path

import pytest

from tests.train.helpers_train import overrides
from sparse_ft.cli import main
from sparse_ft.files import outputs
from sparse_ft.files.outputs import OUTPUT_MARKER, SCRATCH_SUFFIX, atomic_directory, written_by

ROOT = Path(__file__).resolve().parents[2]
SCRATCH = re.compile(rf"^\..+\.\w{{8}}{re.escape(SCRATCH_SUFFIX)}$")


def state(root: Path) -> dict:
    """Every path under ``root`` (links not followed): a file's sha256, a link's target, a directory."""
    found = {}
    for path in sorted(Path(root).rglob("*")):
        key = str(path.relative_to(root))
        found[key] = ("link", os.readlink(path)) if path.is_symlink() else "dir" if path.is_dir() else \
            hashlib.sha256(path.read_bytes()).hexdigest()
    return found


def refused(argv: list[str], capsys) -> str:
    """The command's one line on stderr, after exit status 2."""
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    (line,) = err.strip().splitlines()
    return line


def mine(directory: Path, writer: str = "sparse-ft merge", name: str = "model.safetensors") -> Path:
    """A directory as sparse-ft writes it whole: a file and the marker naming its command."""
    directory.mkdir(parents=True)
    (directory / name).write_text(f"weights of {directory.name}")
    (directory / OUTPUT_MARKER).write_text(writer + "\n")
    return directory


@pytest.fixture(scope="module")
def adapter(tmp_path_factory) -> Path:
    """A PEFT adapter on a saved tiny base, written as sparse-ft train writes it (no training)."""
    from peft import LoraConfig, get_peft_model

    from sparse_ft.modeling.tiny import tiny_llama, tiny_tokenizer

    root = tmp_path_factory.mktemp("adapter")
    base = root / "base"
    tiny_llama().save_pretrained(base)
    tiny_tokenizer().save_pretrained(base)
    with atomic_directory(root / "adapter") as tmp:
        get_peft_model(tiny_llama(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"])).save_pretrained(tmp)
        (tmp / "sparse_ft.json").write_text(json.dumps({"base_model": str(base), "base_model_given": str(base)}))
    return root / "adapter"


# --- 1. scratch space: unique to the call, and the only thing removed ------------------------------


@pytest.mark.slow
def test_replacing_a_directory_never_touches_fixed_sibling_names(adapter, tmp_path, capsys):
    """The issue's three cases: ``mv r/adapter r/adapter.old`` then merging it into
    ``r/adapter``; a user's ``adapter.old`` backup when an adapter is saved; an earlier merge
    output ``m.old`` when merging into ``m``. Each keeps every sibling and leaves no scratch."""
    run = tmp_path / "r"
    run.mkdir()
    os.rename(adapter.parent / "adapter", run / "adapter.old")  # the user's move (the fixture is restored below)
    try:
        before = state(tmp_path)
        assert main(["merge", "--adapter", str(run / "adapter.old"), "--output", str(run / "adapter")]) == 0
        after = state(tmp_path)
        assert {k: v for k, v in after.items() if not k.startswith("r/adapter/")} == {**before, "r/adapter": "dir"}
        assert written_by(run / "adapter") == "sparse-ft merge"
        mine(tmp_path / "m.old")  # an earlier merge output, and a user's folder named like scratch
        (tmp_path / "m.tmp").mkdir()
        (tmp_path / "m.tmp" / "notes.txt").write_text("mine")
        siblings = {k: v for k, v in state(tmp_path).items() if k.startswith(("m.old", "m.tmp", "r/adapter.old"))}
        for _ in range(2):  # a new output, then the same output replaced with --overwrite
            assert main(["merge", "--adapter", str(run / "adapter.old"), "--output", str(tmp_path / "m"), "--overwrite"]) == 0
            assert {k: v for k, v in state(tmp_path).items() if k.startswith(("m.old", "m.tmp", "r/adapter.old"))} == siblings
        with atomic_directory(run / "adapter.new", "sparse-ft train"):  # as a training run saves its adapter
            (run / "adapter.new.old").mkdir()  # a backup made meanwhile: not the save's to touch
        assert (run / "adapter.new.old").is_dir() and (run / "adapter.new" / OUTPUT_MARKER).is_file()
        assert sorted(p.name for p in tmp_path.rglob(".*") if p.name != OUTPUT_MARKER) == []  # no scratch left
    finally:
        os.rename(run / "adapter.old", adapter.parent / "adapter")


class Killed(BaseException):
    """The process dies here: nothing after it runs, no cleanup either."""


@pytest.mark.parametrize("crash", ["killed after the exchange", "killed between the renames", "the second rename fails"])
def test_a_crash_while_replacing_leaves_the_old_or_the_new_and_only_marked_scratch(tmp_path, monkeypatch, crash):
    """Where the filesystem can exchange two paths, a kill after the swap leaves the new
    directory in place and the old one under a scratch name; where it cannot, a kill between
    the two renames leaves both under scratch names, and a failed second rename puts the old
    one back. Every leftover is recognisably sparse-ft's: a scratch name and the marker."""
    out = mine(tmp_path / "out", name="old.txt")
    (tmp_path / "out.old").write_text("a user's backup")
    killed, replace, calls = crash.startswith("killed"), os.replace, []

    def kill(*args, **kwargs):
        raise Killed

    def second_rename_fails(src, dst):
        calls.append(dst)
        if len(calls) == 2 or (killed and len(calls) > 2):
            raise Killed if killed else OSError(errno.EIO, "Input/output error", str(dst))
        replace(src, dst)

    if killed:
        monkeypatch.setattr(outputs.shutil, "rmtree", kill)
    if crash != "killed after the exchange":
        monkeypatch.setattr(outputs, "_exchange", lambda a, b: False)
        monkeypatch.setattr(outputs.os, "replace", second_rename_fails)
    with pytest.raises(Killed if killed else OSError):
        with atomic_directory(out, "sparse-ft merge", overwrite=True) as tmp:
            (tmp / "new.txt").write_text("new")
    monkeypatch.undo()
    left = {p.name: sorted(q.name for q in p.iterdir()) for p in tmp_path.iterdir() if p.is_dir()}
    assert (tmp_path / "out.old").read_text() == "a user's backup"
    scratch = {name: files for name, files in left.items() if name != "out"}
    assert all(SCRATCH.match(name) and OUTPUT_MARKER in files for name, files in scratch.items()), left
    if crash == "killed after the exchange":
        assert left["out"] == [OUTPUT_MARKER, "new.txt"] and list(scratch.values()) == [[OUTPUT_MARKER, "old.txt"]]
    elif crash == "killed between the renames":
        assert "out" not in left and sorted(scratch.values()) == [[OUTPUT_MARKER, "new.txt"], [OUTPUT_MARKER, "old.txt"]]
    else:
        assert left["out"] == [OUTPUT_MARKER, "old.txt"] and scratch == {}


# --- 2. an output never is, holds or lies inside an input ------------------------------------------


def test_outputs_that_overlap_inputs_are_refused_by_every_command(adapter, tmp_path, capsys):
    data = tmp_path / "d.txt"
    data.write_text("some text " * 50)
    base = mine(tmp_path / "base", "sparse-ft pretrain", "config.json")
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "train.jsonl").write_text(json.dumps({"text": "def f():\n    return 1\n" * 20}) + "\n")
    cases = [
        (["eval", "ppl", "--model", "tiny", "--data", str(data), "--output", str(data), "--overwrite"],
         f"--output {data} overlaps --data {data}"),
        (["eval", "ppl", "--model", "tiny", "--adapter", str(adapter), "--data", str(data), "--output",
          str(adapter / "adapter_config.json"), "--overwrite"], "overlaps --adapter"),
        (["eval", "passkey", "--model", str(base), "--heatmap", str(base / "h.png")], f"--heatmap {base / 'h.png'} overlaps --model"),
        (["merge", "--adapter", str(adapter), "--output", str(adapter / "merged")], "overlaps --adapter"),
        (["pretrain", "--corpus", str(tmp_path / "new" / "corpus"), "--output", str(tmp_path / "new")], "overlaps --corpus"),
        (["experiment", "--base", str(base), "--output", str(base / "results")], "--output"),
        (["train", "recipe=tiny", *overrides(docs, tmp_path / "cache"), f"data.source={docs / 'train.jsonl'}"],
         f"train.output_dir {docs} overlaps data.source {docs / 'train.jsonl'}"),
    ]
    before = state(tmp_path)
    for argv, message in cases:
        line = refused(argv, capsys)
        assert message in line and "overlaps" in line and line.startswith(f"sparse-ft {argv[0]}"), line
    assert state(tmp_path) == before


# --- 3. files and directories sparse-ft did not write, or was not told to replace ------------------


@pytest.mark.slow
def test_existing_outputs_are_replaced_only_when_sparse_fts_and_asked(adapter, tmp_path, capsys):
    data = tmp_path / "d.txt"
    data.write_text("some text " * 50)
    theirs = {"result.json": '{"results": []}', "notes.json": "[1, 2]", "plot.png": "not a png", "table.md": "# mine\n",
              "bench.md": "# my table\n"}
    for name, text in theirs.items():
        (tmp_path / name).write_text(text)
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "notes.txt").write_text("mine")
    mine(tmp_path / "run", "sparse-ft train\nshared", "notes.txt")  # a run's directory: it may hold the user's files
    ppl = ["eval", "ppl", "--model", "tiny", "--data", str(data), "--lengths", "64", "--num-windows", "1"]
    cases = [
        ([*ppl, "--output", str(tmp_path / "result.json"), "--overwrite"], "--output", "result.json"),
        ([*ppl, "--output", str(tmp_path / "new.json"), "--plot", str(tmp_path / "plot.png"), "--overwrite"], "--plot", "plot.png"),
        (["eval", "plot", str(tmp_path / "result.json"), "--output", str(tmp_path / "plot.png")], "--output", "plot.png"),
        (["bench", "dca", "--lengths", "64", "--output", str(tmp_path / "bench.json"), "--overwrite"], "--output", "bench.md"),
        (["bench", "dca", "--lengths", "64", "--output", str(tmp_path / "table.md")], "--output", "table.md"),
        (["merge", "--adapter", str(adapter), "--output", str(tmp_path / "folder"), "--overwrite"], "--output", "folder"),
        (["merge", "--adapter", str(adapter), "--output", str(tmp_path / "run"), "--overwrite"], "--output", "run"),
        (["pretrain", "--corpus", str(tmp_path / "folder"), "--output", str(tmp_path / "base")], "--corpus", "folder"),
        (["experiment", "--base", str(ROOT / "assets" / "tiny-base"), "--output", str(tmp_path / "folder")], "--output", "folder"),
    ]
    before = state(tmp_path)
    for argv, flag, name in cases:
        line = refused(argv, capsys)
        assert f"{flag} {tmp_path / name} " in line, line
        assert re.search(r"not written by (sparse-ft|`sparse-ft experiment`)|must end in \.json|is the directory of `sparse-ft "
                         r"train`, which may hold files of yours", line), line
    assert state(tmp_path) == before
    # sparse-ft's own results: refused without --overwrite, replaced with it
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    assert main([*ppl, "--output", str(out), "--plot", str(png)]) == 0
    assert written_by(out) == written_by(png) == "sparse-ft eval ppl"
    capsys.readouterr()
    line = refused([*ppl, "--output", str(out)], capsys)
    assert line == f"sparse-ft eval: error: --output {out} holds the output of `sparse-ft eval ppl`; pass --overwrite to replace it"
    assert main([*ppl, "--output", str(out), "--plot", str(png), "--overwrite"]) == 0
    assert {k: v for k, v in state(tmp_path).items() if k in before} == before


# --- 4. a training run's directory -------------------------------------------------------------------


def train_argv(out, cache, *extra) -> list[str]:
    return ["train", "recipe=tiny", *overrides(out, cache, "deepspeed=null", "train.max_steps=2", "train.save_steps=2",
                                               "lora.target_modules=[q_proj]", *extra)]


@pytest.mark.slow
def test_a_run_replaces_only_its_own_files_and_only_when_told(tmp_path, capsys):
    """An earlier run's adapter, log and summary with no checkpoint left; a checkpoint-named
    directory of the user's; a directory of the user's: each refused with the key that allows
    it, then ``train.overwrite_output_dir`` replaces the run's own files and nothing else."""
    out, cache = tmp_path / "run", tmp_path / "cache"
    assert main(train_argv(out, cache)) == 0
    shutil.rmtree(out / "checkpoint-2")  # the user frees space: no checkpoint is left
    (out / "notes.txt").write_text("mine")
    (out / "checkpoint-best").mkdir()
    (out / "checkpoint-best" / "meta.json").write_text("{}")
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "log.jsonl").write_text("my log\n")
    capsys.readouterr()
    before = state(tmp_path)
    line = refused(train_argv(out, cache), capsys)
    assert line == (f"sparse-ft train: error: train.output_dir={out} holds a finished run (adapter, train_summary.json, "
                    "adapter_probe.safetensors) and no checkpoint to resume: choose another train.output_dir, "
                    "or set train.resume=never train.overwrite_output_dir=true to replace it")
    line = refused(train_argv(out, cache, "train.resume=never"), capsys)
    assert "holds an earlier run's adapter, train_summary.json, adapter_probe.safetensors; choose another" in line
    assert "train.overwrite_output_dir=true" in line
    (out / "checkpoint-4").mkdir()  # another trainer's
    line = refused(train_argv(out, cache, "train.resume=never", "train.overwrite_output_dir=true"), capsys)
    assert line.endswith(f"train.output_dir={out} holds checkpoint-4, which sparse-ft did not write: a save would replace it; "
                         "move it away, or choose another train.output_dir")
    (out / "checkpoint-4").rmdir()
    line = refused(train_argv(theirs, cache), capsys)
    assert f"train.output_dir {theirs} is not empty and was not written by `sparse-ft train`" in line
    assert state(tmp_path) == before
    assert main(train_argv(out, cache, "train.resume=never", "train.overwrite_output_dir=true")) == 0
    printed = capsys.readouterr().out
    assert f"train.overwrite_output_dir: deleted adapter, train_summary.json, adapter_probe.safetensors from {out}" in printed
    after = state(tmp_path)
    assert (after["run/notes.txt"] == before["run/notes.txt"]
            and after["run/checkpoint-best/meta.json"] == before["run/checkpoint-best/meta.json"])
    assert written_by(out) == "sparse-ft train" and (out / "checkpoint-2").is_dir()


@pytest.mark.parametrize("output_dir", ["", ".", "./", "..", "sub/.."])
def test_the_current_directory_is_never_a_runs_output(tmp_path, monkeypatch, capsys, output_dir):
    cwd = tmp_path / "work"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    (cwd / "notes.txt").write_text("mine")
    before = state(tmp_path)
    line = refused(["train", "recipe=tiny", f"train.output_dir={output_dir}", "deepspeed=null"], capsys)
    assert line.startswith(f"sparse-ft train: error: recipe key train.output_dir={output_dir!r} is invalid: "
                           f"a directory of the run's own (e.g. runs/NAME), not the current directory {cwd}")
    assert state(tmp_path) == before


# --- 5. links are not written through ------------------------------------------------------------------


def test_outputs_are_never_written_through_links(adapter, tmp_path, capsys):
    target = tmp_path / "elsewhere.txt"
    target.write_text("someone else's file")
    data = tmp_path / "d.txt"
    data.write_text("some text " * 50)
    run = mine(tmp_path / "run", "sparse-ft train\nshared", "recipe.resolved.yaml")
    (run / "log.jsonl").symlink_to(target)
    (tmp_path / "r.json").symlink_to(target)
    (tmp_path / "merged").symlink_to(run)
    cases = [
        (train_argv(run, tmp_path / "cache"), f"train.output_dir={run}: log.jsonl is a symbolic link (to {target}); "
                                              "a run does not write through links"),
        (["eval", "ppl", "--model", "tiny", "--data", str(data), "--output", str(tmp_path / "r.json"), "--overwrite"],
         f"--output {tmp_path / 'r.json'} is a symbolic link (to {target}); sparse-ft does not write through links"),
        (["merge", "--adapter", str(adapter), "--output", str(tmp_path / "merged"), "--overwrite"],
         f"--output {tmp_path / 'merged'} is a symbolic link (to {run})"),
    ]
    before = state(tmp_path)
    for argv, message in cases:
        assert message in refused(argv, capsys)
    assert state(tmp_path) == before
