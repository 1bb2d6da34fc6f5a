import json
from types import SimpleNamespace

import numpy as np
import pytest

from sparse_ft.data import packing
from sparse_ft.data.packing import build_train_dataset
from sparse_ft.data.sources import iter_texts
from sparse_ft.tiny import tiny_tokenizer


def cfg(tmp_path, source, **kw):
    base = dict(source=str(source), split="train", text_column="text", min_tokens=0, cache_dir=str(tmp_path / "cache"),
                streaming=False, max_documents=None)
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
    monkeypatch.setattr(packing, "_flush", lambda *a: calls.append(1) or real(*a))
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


def test_tiny_recipe_corpus_builds(tmp_path):
    from sparse_ft.config import load_recipe

    recipe = load_recipe("tiny", [f"data.cache_dir={tmp_path}"])
    ds = build_train_dataset(recipe.data, tiny_tokenizer(), recipe.seq_len)
    meta = packing.load_meta(ds)
    assert len(ds) >= 100 and ds[0]["input_ids"].shape == (recipe.seq_len,) and meta["kept"] == meta["documents"]


def test_tiny_corpus_is_small_and_from_the_stdlib():
    from pathlib import Path

    from sparse_ft.data.stdlib_text import iter_stdlib_documents

    path = Path(__file__).resolve().parent.parent / "data" / "tiny" / "train.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert 10 <= len(rows) and path.stat().st_size < 400_000 and all(r["text"] for r in rows)
    assert list(iter_stdlib_documents(["heapq", "no_such_module"])) == list(iter_stdlib_documents(["heapq"]))
    assert '"""Heap queue algorithm' in next(iter_stdlib_documents(["heapq"]))
