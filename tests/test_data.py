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
