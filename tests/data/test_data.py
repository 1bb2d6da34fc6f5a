"""The training data pipeline (``sparse_ft.data``): documents packed with EOS into samples,
every local source format read (jsonl, json arrays, txt, parquet, directories, globs), the
token cache keyed on its settings, reused, rebuilt when cut or changed, never left partial on a
full disk or a kill; rows without text counted, bad sources refused naming their key or flag."""

import json
import re
from types import SimpleNamespace

import numpy as np
import pytest

from sparse_ft.data import packing
from sparse_ft.data.packing import build_train_dataset
from sparse_ft.data.sources import iter_texts
from sparse_ft.modeling.tiny import tiny_tokenizer


def cfg(tmp_path, source, **kw):
    base = dict(source=str(source), split="train", text_column="text", min_tokens=0, cache_dir=str(tmp_path / "cache"),
                streaming=False, max_documents=None, packing="blocks", format="text", chat_template=None)
    return SimpleNamespace(**{**base, **kw})


def write_jsonl(path, texts, column="text"):
    path.write_text("".join(json.dumps({column: t}) + "\n" for t in texts))
    return path


def test_packs_documents_with_eos_and_filters_short_ones(tmp_path):
    tok = tiny_tokenizer()
    src = write_jsonl(tmp_path / "d.jsonl", ["a" * 10, "b" * 3, "c" * 12])
    ds = build_train_dataset(cfg(tmp_path, src, min_tokens=5), tok, seq_len=8)
    a, c, eos = tok("a", add_special_tokens=False).input_ids[0], tok("c", add_special_tokens=False).input_ids[0], tok.eos_token_id
    stream = [a] * 10 + [eos] + [c] * 12 + [eos]  # "bbb" is shorter than min_tokens
    assert len(ds) == len(stream) // 8
    for i in range(len(ds)):
        assert ds[i]["input_ids"].tolist() == stream[i * 8 : (i + 1) * 8]
        assert ds[i]["labels"].tolist() == ds[i]["input_ids"].tolist()


def test_txt_parquet_and_directory_sources(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "one.txt").write_text("first document")
    (tmp_path / "docs" / "two.txt").write_text("second")
    assert list(iter_texts(str(tmp_path / "docs"))) == ["first document", "second"]
    import pandas as pd

    pd.DataFrame({"content": ["x", "yy"]}).to_parquet(tmp_path / "p.parquet")
    assert list(iter_texts(str(tmp_path / "p.parquet"), text_column="content")) == ["x", "yy"]


def test_cache_is_reused_and_keyed_on_settings(tmp_path, monkeypatch):
    tok = tiny_tokenizer()
    src = write_jsonl(tmp_path / "d.jsonl", ["hello world " * 20] * 5)
    calls = []
    real = packing._flush
    monkeypatch.setattr(packing, "_flush", lambda *a, **k: calls.append(1) or real(*a, **k))
    first = build_train_dataset(cfg(tmp_path, src), tok, seq_len=16)
    n = len(calls)
    second = build_train_dataset(cfg(tmp_path, src), tok, seq_len=16)
    assert len(calls) == n and np.array_equal(first.samples, second.samples)  # no re-tokenisation
    build_train_dataset(cfg(tmp_path, src, min_tokens=3), tok, seq_len=16)
    assert len(calls) > n  # another setting, another cache
    assert not list((tmp_path / "cache").glob("*.tmp*"))


def test_errors_are_clear(tmp_path):
    tok = tiny_tokenizer()
    with pytest.raises(FileNotFoundError, match="does not exist"):
        build_train_dataset(cfg(tmp_path, tmp_path / "missing.jsonl"), tok, 8)
    src = write_jsonl(tmp_path / "d.jsonl", ["abc"], column="body")
    with pytest.raises(ValueError, match="has no column 'text'; its columns: body"):
        build_train_dataset(cfg(tmp_path, src), tok, 8)
    src = write_jsonl(tmp_path / "e.jsonl", ["abc", "de"])
    with pytest.raises(ValueError, match=r"0 of 2 documents have >= data.min_tokens=100 tokens \(longest: 3\)"):
        build_train_dataset(cfg(tmp_path, src, min_tokens=100), tok, 8)


def test_max_documents_and_streaming(tmp_path):
    tok = tiny_tokenizer()
    src = write_jsonl(tmp_path / "d.jsonl", [f"doc {i} " * 10 for i in range(20)])
    ds = build_train_dataset(cfg(tmp_path, src, max_documents=4, streaming=True), tok, seq_len=10)
    meta = packing.load_meta(ds)
    assert meta["documents"] == 4 and meta["tokens"] == sum(len(f"doc {i} " * 10) + 1 for i in range(4))


def test_json_glob_and_missing_values(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", ["one", "two"])
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": None}) + "\n" + json.dumps({"text": "three"}) + "\n")
    (tmp_path / "notes.md").write_text("not data")
    assert list(iter_texts(str(tmp_path / "*"))) == ["one", "two", "three"]  # sorted files, null rows skipped
    with pytest.raises(FileNotFoundError, match="matches no"):
        list(iter_texts(str(tmp_path / "*.parquet")))
    with pytest.raises(ValueError, match=r"unsupported file type '.md'"):
        list(iter_texts(str(tmp_path / "notes.md")))
    (tmp_path / "c.jsonl").write_text(json.dumps({"text": 5}) + "\n")
    with pytest.raises(ValueError, match="column 'text' holds int, not text"):
        list(iter_texts(str(tmp_path / "c.jsonl")))


def test_remote_sources_fail_clearly_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match=r"name the files' type, e.g. hf://datasets/org/name/\*.jsonl"):
        next(iter_texts("hf://datasets/org/name"))
    import datasets

    def scripted(*args, **kwargs):
        raise RuntimeError("Dataset scripts are no longer supported, but found name.py")

    monkeypatch.setattr(datasets, "load_dataset", scripted)
    with pytest.raises(ValueError, match=r"cannot load dataset 'org/name' split 'train'.*data.source=hf://datasets/org/name/\*.jsonl"):
        next(iter_texts("org/name"))


def test_json_files_read_line_by_line_or_as_one_array(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": "one"}\n\n  \n{"other": 1}\n{"text": "two"}\n')  # blank lines, a row without text
    assert list(iter_texts(str(tmp_path / "a.jsonl"))) == ["one", "two"]
    (tmp_path / "b.json").write_text(json.dumps([{"text": "x"}, {"text": None}, {"text": "y"}], indent=2))
    assert list(iter_texts(str(tmp_path / "b.json"))) == ["x", "y"]
    (tmp_path / "c.json").write_text('[\n  {"text": "x"},\n  {"text": "y"\n]\n')
    with pytest.raises(ValueError, match=r"c.json line 4: not valid JSON \(Expecting ',' delimiter at column 1\)$"):
        list(iter_texts(str(tmp_path / "c.json")))
    (tmp_path / "d.jsonl").write_text('{"text": "ok"}\n"just a string"\n')
    with pytest.raises(ValueError, match=r"d.jsonl line 2: a JSON str, not an object with a 'text' field"):
        list(iter_texts(str(tmp_path / "d.jsonl")))
    (tmp_path / "e.jsonl").write_text(json.dumps({"text": None}) + "\n")
    with pytest.raises(ValueError, match=r"e.jsonl: no documents"):
        list(iter_texts(str(tmp_path / "e.jsonl")))


def test_tiny_recipe_corpus_builds_and_a_cut_cache_is_rebuilt_whole(tmp_path, capsys):
    """The issue's case: a token cache cut to 2 samples was trained on as 2 samples, not 489."""
    from sparse_ft.config import load_recipe

    recipe = load_recipe("tiny", [f"data.cache_dir={tmp_path}"])
    ds = build_train_dataset(recipe.data, tiny_tokenizer(), recipe.seq_len)
    meta = packing.load_meta(ds)
    assert len(ds) >= 100 and ds[0]["input_ids"].shape == (recipe.seq_len,) and meta["kept"] == meta["documents"]
    samples = np.array(ds.samples)  # a copy: reading the map of a file cut short is a bus error
    with open(ds.path, "r+b") as f:
        f.truncate(2 * recipe.seq_len * 4)
    again = build_train_dataset(recipe.data, tiny_tokenizer(), recipe.seq_len)
    assert f"{2 * recipe.seq_len * 4} bytes on disk, but {meta['bytes']} recorded" in capsys.readouterr().err
    assert len(again) == len(samples) == meta["samples"] and np.array_equal(again.samples, samples)


@pytest.mark.parametrize("damage, said", [
    (lambda tokens, meta: tokens.unlink(), "the tokens file is missing"),
    (lambda tokens, meta: tokens.write_bytes(bytes(tokens.stat().st_size)),
     r"its sha256 differs from the one recorded \(the file was overwritten\)"),
    (lambda tokens, meta: meta.write_text(meta.read_text()[:20]), r"its record \w+.json is not valid JSON"),
    (lambda tokens, meta: meta.write_text(json.dumps({"tokens": 3})), r"its record \w+.json lacks bytes, sha256"),
])
def test_a_cache_that_differs_from_its_record_is_rebuilt(tmp_path, capsys, damage, said):
    tok = tiny_tokenizer()
    src = write_jsonl(tmp_path / "d.jsonl", ["hello world " * 20] * 5)
    first = build_train_dataset(cfg(tmp_path, src), tok, seq_len=16)
    expected = np.array(first.samples)
    meta_path = first.path.with_suffix(".json")
    assert json.loads(meta_path.read_text())["bytes"] == first.path.stat().st_size
    damage(first.path, meta_path)
    again = build_train_dataset(cfg(tmp_path, src), tok, seq_len=16)
    err = capsys.readouterr().err  # the line, then the tokenizer's progress bar
    assert re.search(f"^data cache .*{first.path.name}: {said}; rebuilding it$", err, re.MULTILINE), err
    assert np.array_equal(again.samples, expected)
    build_train_dataset(cfg(tmp_path, src), tok, seq_len=16)  # verified now: used as it is
    assert capsys.readouterr().err == ""


def test_check_source_reads_a_local_source_unless_its_cache_exists(tmp_path):
    tok = tiny_tokenizer()
    src = write_jsonl(tmp_path / "d.jsonl", ["hello world " * 20] * 5)
    packing.check_source(cfg(tmp_path, src), tok, 16)
    with open(src, "a") as f:
        f.write('{"text": "cut')
    packing.check_source(cfg(tmp_path, src, max_documents=5), tok, 16)  # the broken line is past what is read
    with pytest.raises(ValueError, match=r"d.jsonl line 6: not valid JSON .*was it cut short\?"):
        packing.check_source(cfg(tmp_path, src), tok, 16)
    packing.check_source(cfg(tmp_path, "org/remote-dataset"), tok, 16)  # remote: read when the cache is built


def test_tiny_corpus_is_small_and_from_the_stdlib():
    from pathlib import Path

    from sparse_ft.data.stdlib_text import iter_stdlib_documents

    path = Path(__file__).resolve().parents[2] / "data" / "tiny" / "train.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert 10 <= len(rows) and path.stat().st_size < 400_000 and all(r["text"] for r in rows)
    assert list(iter_stdlib_documents(["heapq", "no_such_module"])) == list(iter_stdlib_documents(["heapq"]))
    assert '"""Heap queue algorithm' in next(iter_stdlib_documents(["heapq"]))


def test_a_full_disk_while_caching_is_one_line_and_leaves_no_partial_file(tmp_path, monkeypatch):
    """ENOSPC midway through the token stream: the run stops naming data.cache_dir, and the
    partial file, under a name of its own, is gone."""
    import errno

    src = write_jsonl(tmp_path / "d.jsonl", ["hello world " * 20] * 5)
    flush = packing._flush

    def full_disk(*args, **kwargs):
        flush(*args, **kwargs)  # some bytes are written, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(packing, "_flush", full_disk)
    with pytest.raises(ValueError, match=r"^data.cache_dir .*/cache: cannot write the token cache \w+.tokens "
                                         r"\(No space left on device\); free space there or set data.cache_dir elsewhere$"):
        build_train_dataset(cfg(tmp_path, src), tiny_tokenizer(), seq_len=16)
    assert list((tmp_path / "cache").iterdir()) == []


def test_a_killed_writers_partial_cache_is_removed_by_the_next_build_and_no_other(tmp_path, capsys):
    """What a SIGKILL leaves (``.<cache file>.<host>.<pid>.<random>.sparse-ft-tmp``) is removed once
    its process is gone from this host; another host's, or a live process's, stays."""
    import os
    import socket
    import subprocess
    import sys

    src = write_jsonl(tmp_path / "d.jsonl", ["hello world " * 20] * 5)
    tokens, _ = packing.cache_paths(cfg(tmp_path, src), tiny_tokenizer(), 16)
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True).stdout.strip()
    host = socket.gethostname()
    stale, live, elsewhere = (tokens.with_name(f".{tokens.name}.{h}.{pid}.0badc0de.sparse-ft-tmp")
                              for h, pid in ((host, gone), (host, os.getpid()), ("other-host", gone)))
    tokens.parent.mkdir(parents=True)
    for path in (stale, live, elsewhere):
        path.write_bytes(b"half")
    build_train_dataset(cfg(tmp_path, src), tiny_tokenizer(), seq_len=16)
    assert not stale.exists() and live.exists() and elsewhere.exists()
    assert f"data cache: removed {stale.name}, left by a killed run" in capsys.readouterr().err


def test_a_txt_document_that_is_not_utf8_is_refused_by_byte(tmp_path):
    (tmp_path / "d.txt").write_bytes("héllo".encode("latin-1"))
    with pytest.raises(ValueError, match=r"d.txt: not UTF-8 text \(byte 1: invalid continuation byte\)"):
        list(iter_texts(str(tmp_path / "d.txt")))


def test_rows_without_text_and_blank_rows_are_counted_at_the_cache_build(tmp_path, capsys):
    """Issue 31: 32 of 64 JSON rows without the text column were dropped without a word, and
    blank rows were kept by default. The build counts both (stderr and the sidecar), and the
    default data.min_tokens (1) keeps blank rows out; 0 keeps them and says so."""
    from sparse_ft.config.schema import DataSection
    from sparse_ft.data.packing import load_meta

    rows = [{"text": "hello world " * 4}] * 30 + [{"body": "x"}] * 32 + [{"text": ""}] * 2
    src = tmp_path / "d.jsonl"
    src.write_text("".join(json.dumps(row) + "\n" for row in rows))
    tok = tiny_tokenizer()
    ds = build_train_dataset(cfg(tmp_path, src, min_tokens=DataSection().min_tokens), tok, seq_len=16)
    assert ("of 64 rows, 32 without a 'text' value (the column absent or null), 2 blank (no tokens); kept 30 documents "
            in capsys.readouterr().err)
    assert {k: load_meta(ds)[k] for k in ("rows_without_text", "blank", "kept")} == {"rows_without_text": 32, "blank": 2, "kept": 30}
    build_train_dataset(cfg(tmp_path, src, min_tokens=0), tok, seq_len=16)
    assert "2 blank (kept: data.min_tokens=0); kept 32 documents" in capsys.readouterr().err
    build_train_dataset(cfg(tmp_path, write_jsonl(tmp_path / "e.jsonl", ["abc"] * 8), min_tokens=1), tok, seq_len=16)
    assert "rows," not in capsys.readouterr().err  # nothing left out: no report


def test_errors_name_the_key_or_flag_the_source_was_given_by(tmp_path):
    """The same reader serves data.source, --data and validation.data: its errors name the one
    the user typed, and the setting of the text column beside it."""
    from sparse_ft.data.sources import Keys

    src = write_jsonl(tmp_path / "d.jsonl", ["x"], column="body")
    with pytest.raises(ValueError, match=r"^--data .*d.jsonl has no column 'text'; its columns: body \(set --text-column\)$"):
        list(iter_texts(str(src), keys=Keys("--data", "--text-column")))
    with pytest.raises(FileNotFoundError, match=r"^validation.data .*missing.jsonl does not exist$"):
        list(iter_texts(str(tmp_path / "missing.jsonl"), keys=Keys("validation.data")))
