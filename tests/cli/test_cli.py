"""The command line: help without torch and with every default, ``sparse-ft train`` and
``train.py`` as one command, outputs that never delete what sparse-ft did not write, and a
W&B run that a resumed training run continues."""

import argparse
import json
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

from sparse_ft import __version__
from sparse_ft.cli import HelpFormatter, build_parser, main
from sparse_ft.modeling.model_io import adapter_base
from sparse_ft.files.outputs import OUTPUT_MARKER, atomic_directory

ROOT = Path(__file__).resolve().parents[2]


def _parsers(parser: argparse.ArgumentParser, name: str = "sparse-ft"):
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from _parsers(sub, f"{name} {sub_name}")


def test_help_builds_every_parser_without_torch():
    """``--help`` stays instant because building the parsers imports none of the heavy modules;
    that is asserted, not a time (a timed bound failed at 2.1 s on a loaded 2-core machine)."""
    code = ("import sys; from sparse_ft.cli import build_parser; build_parser(); "
            "print(sorted({'torch', 'transformers', 'numpy'} & set(sys.modules)))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert done.stdout.strip() == "[]", done.stdout


def test_every_flag_has_help_and_a_default():
    for name, parser in _parsers(build_parser()):
        formatter = HelpFormatter(name)
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._VersionAction, argparse._SubParsersAction)):
                continue
            assert action.help, f"{name} {action.dest} has no help"
            if action.option_strings and action.nargs != 0 and not action.required:
                assert "default" in formatter._get_help_string(action), f"{name} {action.option_strings[0]} names no default"


def test_version_and_help_exit_0(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.strip() == f"sparse-ft {__version__}"
    for argv in (["--help"], ["train", "--help"], ["eval", "ppl", "--help"], ["merge", "--help"]):
        with pytest.raises(SystemExit) as done:
            main(argv)
        assert done.value.code == 0 and "usage: sparse-ft" in capsys.readouterr().out


def test_train_py_is_sparse_ft_train():
    began = time.perf_counter()
    done = subprocess.run([sys.executable, "train.py", "--help"], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0 and done.stdout.startswith("usage: train.py") and "recipe=NAME" in done.stdout
    assert time.perf_counter() - began < 10  # no model, no training: the parser alone
    done = subprocess.run([sys.executable, "train.py"], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 2 and done.stderr.count("\n") == 1
    assert done.stderr.startswith("train.py: error: recipe=NAME must be given once, got 0; recipes: ")


def test_train_takes_flags_between_overrides(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the shipped recipe's paths do not depend on where it runs
    assert main(["train", "recipe=tiny", "--print-recipe", "train.lr=0.5", "data.source=mine.jsonl"]) == 0
    printed = capsys.readouterr().out
    assert "lr: 0.5" in printed and f"source: {tmp_path / 'mine.jsonl'}" in printed
    assert main(["train", "recipe=nope"]) == 2
    assert "sparse-ft train: error: recipe='nope' not found" in capsys.readouterr().err


# --- outputs: nothing is deleted that sparse-ft did not write ------------------------------------


def test_atomic_directory_replaces_only_its_own_output(tmp_path):
    mine = tmp_path / "out"
    with atomic_directory(mine, "sparse-ft test") as tmp:
        (tmp / "a.txt").write_text("first")
    assert (mine / OUTPUT_MARKER).read_text() == "sparse-ft test\n" and sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    with pytest.raises(ValueError, match=r"--output .*out holds the output of `sparse-ft test`; pass --overwrite"):
        with atomic_directory(mine, "sparse-ft test", overwrite=False, flag="--output"):
            pass
    with pytest.raises(RuntimeError):  # a failure midway keeps the previous output and leaves no scratch
        with atomic_directory(mine) as tmp:
            (tmp / "a.txt").write_text("half")
            raise RuntimeError
    assert (mine / "a.txt").read_text() == "first" and sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "notes.txt").write_text("keep")
    with pytest.raises(ValueError, match="not empty and was not written by sparse-ft"):
        with atomic_directory(theirs, overwrite=True):
            pass
    assert (theirs / "notes.txt").read_text() == "keep"
    (tmp_path / "file").write_text("keep")
    with pytest.raises(ValueError, match="is a file, not a directory"):
        with atomic_directory(tmp_path / "file"):
            pass


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    """A PEFT adapter on a saved tiny base, as sparse-ft train writes it (without training)."""
    from peft import LoraConfig, get_peft_model

    from sparse_ft.modeling.tiny import tiny_llama, tiny_tokenizer

    root = tmp_path_factory.mktemp("merge")
    base, adapter = root / "base", root / "run" / "adapter"
    tiny_llama().save_pretrained(base)
    tiny_tokenizer().save_pretrained(base)
    get_peft_model(tiny_llama(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"])).save_pretrained(adapter)
    (adapter / "sparse_ft.json").write_text(json.dumps({"base_model": str(base), "base_model_given": str(base)}))
    return adapter


def test_merge_refuses_outputs_that_would_lose_files(adapter, tmp_path, capsys):
    before = sorted(p.name for p in adapter.iterdir())
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "notes.txt").write_text("keep")
    (tmp_path / "file").write_text("")
    cases = [(tmp_path / "file" / "merged", "cannot write in"), (adapter, "overlaps --adapter"), (adapter / "merged", "overlaps --adapter"),
             (adapter.parent, "overlaps --adapter"),
             (adapter.parent.parent / "base", "overlaps the base model"), (theirs, "not empty and was not written by sparse-ft")]
    for output, message in cases:
        assert main(["merge", "--adapter", str(adapter), "--output", str(output)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("sparse-ft merge: error: --output") and message in err, err
    assert sorted(p.name for p in adapter.iterdir()) == before and (theirs / "notes.txt").read_text() == "keep"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "theirs"]  # nothing written either


@pytest.mark.slow
def test_merge_overwrites_only_its_own_output_when_asked(adapter, tmp_path, capsys):
    out = tmp_path / "merged"
    assert main(["merge", "--adapter", str(adapter), "--output", str(out)]) == 0
    assert (out / OUTPUT_MARKER).read_text() == "sparse-ft merge\n" and (out / "model.safetensors").is_file()
    assert main(["merge", "--adapter", str(adapter), "--output", str(out)]) == 2
    assert "holds the output of `sparse-ft merge`; pass --overwrite" in capsys.readouterr().err
    assert main(["merge", "--adapter", str(adapter), "--output", str(out), "--overwrite"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["merged"]


def test_pretrain_refuses_its_inputs_and_foreign_directories(tmp_path, capsys):
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "corpus.json").write_text("{}")
    common = ["pretrain", "--corpus", str(tmp_path / "corpus"), "--steps", "1"]
    assert main([*common, "--output", str(tmp_path / "corpus" / "base")]) == 2
    assert "--output" in (err := capsys.readouterr().err) and "overlaps --corpus" in err
    assert main([*common, "--output", str(tmp_path / "corpus")]) == 2
    assert main([*common, "--output", str(ROOT / "assets" / "tiny-base")]) == 2  # the committed checkpoint, without --overwrite
    assert "holds the output of `sparse-ft pretrain`; pass --overwrite" in capsys.readouterr().err.splitlines()[-1]


def test_adapters_find_their_base_from_anywhere(tmp_path, monkeypatch):
    """An adapter written before bases were recorded absolute names one relative to where it
    was trained: it is found from the adapter's parents, not sent to the hub."""
    (tmp_path / "runs" / "x" / "base-model").mkdir(parents=True)
    (tmp_path / "runs" / "x" / "base-model" / "config.json").write_text("{}")
    adapter = tmp_path / "runs" / "x" / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "runs/x/base-model"}))
    monkeypatch.chdir(adapter)
    assert adapter_base(adapter, {"base_model": "runs/x/base-model"}) == str(tmp_path / "runs" / "x" / "base-model")
    assert adapter_base(adapter, {}) == str(tmp_path / "runs" / "x" / "base-model")
    assert adapter_base(adapter, {"base_model": "meta-llama/Llama-2-7b-hf"}) == "meta-llama/Llama-2-7b-hf"


# --- W&B -------------------------------------------------------------------------------------------


def test_a_resumed_run_continues_its_wandb_run(tmp_path, monkeypatch):
    from sparse_ft.train.metrics import WANDB_ID_FILE, MetricLog

    calls = []

    def init(**kwargs):
        calls.append(kwargs)
        return types.SimpleNamespace(id=kwargs.get("id", f"run{len(calls)}"), log=lambda *a, **k: None, finish=lambda: None)

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    MetricLog(tmp_path, ["wandb"], []).close()
    assert "id" not in calls[0] and (tmp_path / WANDB_ID_FILE).read_text() == "run1\n"
    MetricLog(tmp_path, ["wandb"], [{"step": 1, "loss": 1.0}]).close()
    assert calls[1]["id"] == "run1" and calls[1]["resume"] == "allow"
    MetricLog(tmp_path, ["wandb"], []).close()  # started afresh (train.resume=never): a new run
    assert "id" not in calls[2] and (tmp_path / WANDB_ID_FILE).read_text() == "run3\n"
