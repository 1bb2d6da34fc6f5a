"""Issue 11, "nothing lost, nothing silent": every bad input to ``train.py`` ends in one line
naming the key or file, the value and what is allowed, with exit status 2, before the model
loads and before anything is written to the output directory. The cases run in-process through
train.py's ``main`` (one subprocess checks the real command line)."""

import json
import os
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TINY_LINE = json.dumps({"text": "def f():\n    return 1\n" * 20})


def jsonl(content):
    """The data column: writes ``docs.jsonl`` (text or bytes) into the test's directory."""
    return lambda tmp: _write(tmp / "docs.jsonl", content)


def _write(path, content):
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return path


# overrides (DATA: the path the data column returns, else the test's directory), data, message
CASES = {
    "resume not auto/never/a checkpoint": (
        ["train.resume=maybe"], None,
        r"recipe key train.resume='maybe' is invalid: allowed: auto, never, or a checkpoint-N directory with meta.json; no such directory"),
    "save_total_limit negative": (
        ["train.save_total_limit=-3"], None,
        r"recipe key train.save_total_limit=-3 is invalid: must be >= 1 \(checkpoints kept\), or 0 to keep every checkpoint"),
    "save_minutes negative": (
        ["train.save_minutes=-5"], None,
        r"recipe key train.save_minutes=-5.0 is invalid: must be > 0 \(minutes between checkpoints by the clock\), or 0 for none"),
    "learning rate infinite": (
        ["train.lr=.inf"], None, r"recipe key train.lr=inf is invalid: must be a finite number \(not .inf or .nan\)$"),
    "gradient clipping nan": (
        ["train.max_grad_norm=.nan"], None, r"recipe key train.max_grad_norm=nan is invalid: must be a finite number"),
    "learning rate inf as a word": (["train.lr=inf"], None, r"recipe key train.lr=inf is invalid: must be a finite number"),
    "a beta nan": (["train.betas=[0.9,.nan]"], None, r"recipe key train.betas\[1\]=nan is invalid: must be a finite number"),
    "save_minutes infinite": (["train.save_minutes=.inf"], None, r"recipe key train.save_minutes=inf is invalid: must be a finite number"),
    "a pattern parameter infinite": (
        ["attention.params={chunks: .inf}"], None, r"recipe key attention.params.chunks=inf is invalid: must be a finite number"),
    "a tiny model number nan": (
        ["model.tiny.rms_norm_eps=.nan"], None, r"recipe key model.tiny.rms_norm_eps=nan is invalid: must be a finite number"),
    "output_dir is a file": (
        ["train.output_dir=DATA"], jsonl(TINY_LINE + "\n"),
        r"recipe key train.output_dir='.*docs.jsonl' is invalid: a directory .*; this is a file"),
    "unknown model.tiny key": (
        ["model.tiny.hiden_size=32"], None,
        r"recipe key model.tiny=\{'hiden_size': 32\} is invalid: unknown LlamaConfig parameter\(s\) hiden_size "
        r"\(did you mean hidden_size\?\); allowed: .*num_attention_heads"),
    "tiny hidden size not divisible by heads": (
        ["model.tiny.hidden_size=60"], None,
        r"model.tiny=\{'hidden_size': 60\} is invalid: The hidden size \(60\) is not a multiple of the number of attention heads \(8\)"),
    "tiny vocabulary smaller than the tokenizer's": (
        ["model.tiny.vocab_size=10"], None, r"model.tiny=\{'vocab_size': 10\} is invalid: vocab_size=10 must be >= 384"),
    "tiny heads not divisible by kv heads": (
        ["model.tiny.num_key_value_heads=3"], None,
        r"model.tiny=\{'num_key_value_heads': 3\} is invalid: num_attention_heads=8 is not a multiple of num_key_value_heads=3"),
    "tiny config no model can be built from": (
        ["model.tiny.intermediate_size=-1"], None,
        r"model.tiny=\{'intermediate_size': -1\} is invalid: a llama model cannot be built from it \(RuntimeError: .*negative dimension"),
    "heads not divisible by the pattern": (
        ["attention.params.chunks=3"], None,
        r"recipe key attention.params=\{'chunks': 3\} is invalid: scca_flow: num_heads=8 must be divisible by 3"),
    "sequence parallelism without DeepSpeed": (
        ["train.sequence_parallel_size=2"], None,
        r"recipe key train.sequence_parallel_size=2 is invalid: > 1 needs DeepSpeed \(Ulysses is DeepSpeed's\)"),
    "sequence parallelism not dividing the sequence": (
        ["deepspeed=zero3_cpu_fp32", "train.sequence_parallel_size=2", "data.seq_len=511"], None,
        r"train.sequence_parallel_size=2 is invalid: must divide the sequence length data.seq_len=511"),
    "sequence parallelism not dividing the heads": (
        ["deepspeed=zero3_cpu_fp32", "train.sequence_parallel_size=16"], None,
        r"train.sequence_parallel_size=16 is invalid: must divide the model's num_attention_heads=8"),
    "sequence parallelism not dividing the processes": (
        ["deepspeed=zero3_cpu_fp32", "train.sequence_parallel_size=2"], None,
        r"train.sequence_parallel_size=2 is invalid: must divide the number of processes, 1 \(data parallelism"),
    "flash in float32": (
        ["attention.backend=flash"], None,
        r"recipe key attention.backend='flash' is invalid: flash-attn computes in float16/bfloat16 only and model.dtype is float32"),
    "flash where flash-attn cannot run": (
        ["attention.backend=flash", "model.dtype=bfloat16"], None,
        r"recipe key attention.backend='flash' is invalid: flash-attn cannot run here \(it needs the flash-attn package and a CUDA device\)"),
    "missing local model path": (
        ["model.name_or_path=DATA/no-model"], None,
        r"recipe key model.name_or_path='.*/no-model' is invalid: no such local directory \(a Hub model is named like"),
    "local directory without config.json": (
        ["model.name_or_path=DATA"], lambda tmp: (tmp / "model").mkdir() or tmp / "model",  # beside train.output_dir, not holding it
        r"recipe key model.name_or_path='.*' is invalid: a local model is a directory with config.json; this has none"),
    "hub id that cannot be reached": (
        ["model.name_or_path=nobody-here/no-model"], None,
        r"model.name_or_path='nobody-here/no-model' is invalid: not a local directory, and its config cannot be read: "),
    "lora target that names nothing": (
        ["lora.target_modules=[q_proj,foo_proj]"], None,
        r"recipe key lora.target_modules=\['q_proj', 'foo_proj'\] is invalid: 'foo_proj' names no module; "
        r"the model's layers LoRA can adapt: down_proj, embed_tokens, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj"),
    "lora target LoRA cannot adapt": (
        ["lora.target_modules=[mlp]"], None, r"lora.target_modules=\['mlp'\] is invalid: 'mlp' names a LlamaMLP, which LoRA cannot adapt"),
    "extra_trainable that matches nothing": (
        ["lora.extra_trainable=[embed_tokens,foo]"], None,
        r"recipe key lora.extra_trainable=\['embed_tokens', 'foo'\] is invalid: 'foo' ends no module name; "
        r"the model's names end in: .*embed_tokens.*post_attention_layernorm"),
    "missing data file": (
        ["data.source=DATA/missing.jsonl"], None, r"data.source .*/missing.jsonl does not exist"),
    "empty jsonl": (
        ["data.source=DATA"], jsonl(""), r"data.source .*/docs.jsonl: no documents"),
    "malformed jsonl": (
        ["data.source=DATA"], jsonl(TINY_LINE + "\n" + '{"text": "a" "b"}\n' + TINY_LINE + "\n"),
        r"data.source .*/docs.jsonl line 2: not valid JSON \(Expecting ',' delimiter at column 14\)$"),
    "truncated jsonl": (
        ["data.source=DATA"], jsonl(TINY_LINE + "\n" + TINY_LINE[:30]),
        r"data.source .*/docs.jsonl line 2: not valid JSON \(Unterminated string starting at column 10\); "
        r"the file ends in this line without a newline: was it cut short\?"),
    "jsonl that is not UTF-8": (
        ["data.source=DATA"], jsonl(b'{"text": "\xff"}\n'),
        r"data.source .*/docs.jsonl line 1: not UTF-8 text \(invalid start byte\)"),
    "jsonl rows that are not objects": (
        ["data.source=DATA"], jsonl("[1, 2]\n"), r"data.source .*/docs.jsonl item 0: a JSON int, not an object with a 'text' field"),
    "jsonl without the text column": (
        ["data.source=DATA", "data.text_column=body"], jsonl(TINY_LINE + "\n"),
        r"data.source .*/docs.jsonl has no column 'body'; its columns: text \(set data.text_column\)"),
}


@pytest.fixture(scope="module")
def train_main():
    return runpy.run_path(str(ROOT / "train.py"))["main"]


def argv(out, cache, *overrides):
    return ["train.py", "recipe=tiny", "deepspeed=null", "train.max_steps=1", f"train.output_dir={out}",
            "train.report_to=[none]", f"data.cache_dir={cache}", *overrides]


def listing(path):
    return sorted(str(p.relative_to(path)) for p in path.rglob("*")) if path.exists() else None


def run_refused(train_main, monkeypatch, capsys, args):
    monkeypatch.setattr(sys, "argv", args)
    code = train_main()
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert code == 2, err
    (line,) = err.strip().splitlines()  # one line
    return line


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_fails_in_one_line_before_anything_loads(case, tmp_path, monkeypatch, capsys, train_main):
    import attn_patterns.kernels

    monkeypatch.setattr(attn_patterns.kernels, "flash_available", lambda: False)  # the same answer on a GPU machine
    overrides, data, message = CASES[case]
    where = data(tmp_path) if data else tmp_path
    overrides = [o.replace("DATA", str(where)) for o in overrides]
    out = tmp_path / "run"
    line = run_refused(train_main, monkeypatch, capsys, argv(out, tmp_path / "cache", *overrides))
    assert line.startswith("train.py: error: ")
    assert re.search(message, line), line
    assert not out.exists()  # nothing written: not even the resolved recipe or the tiny base model
    assert not (tmp_path / "cache").exists()


def test_an_earlier_runs_directory_is_left_as_it_was(tmp_path, monkeypatch, capsys, train_main):
    out = tmp_path / "run"
    (out / "checkpoint-2").mkdir(parents=True)  # a save that never finished: no meta.json
    (out / "log.jsonl").write_text("{}\n")
    before = listing(out)
    line = run_refused(train_main, monkeypatch, capsys, argv(out, tmp_path / "cache", f"train.resume={out / 'checkpoint-2'}"))
    assert "it has no meta.json" in line
    line = run_refused(train_main, monkeypatch, capsys, argv(out, tmp_path / "cache", "lora.target_modules=[foo_proj]"))
    assert "'foo_proj' names no module" in line
    assert listing(out) == before and (out / "log.jsonl").read_text() == "{}\n"


@pytest.mark.slow
def test_the_command_line_exits_2_without_a_traceback(tmp_path):
    empty = _write(tmp_path / "empty.jsonl", "")
    out = tmp_path / "run"
    done = subprocess.run([sys.executable, *argv(out, tmp_path / "cache", f"data.source={empty}")], cwd=ROOT,
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1] == f"train.py: error: data.source {empty}: no documents (empty, or no row with a 'text' value)"
    assert not out.exists()
