"""Where documents come from: an HF dataset id, or local jsonl / json / parquet / txt files
(a file, a directory or a glob). Every source yields plain strings."""

from __future__ import annotations

import glob
import os
from pathlib import Path
from typing import Iterator, Optional

LOCAL_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text"}


def local_files(source: str) -> Optional[list[Path]]:
    """Local files behind ``source``, or None when it is not a local path (an HF id)."""
    path = Path(source)
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix in LOCAL_FORMATS)
        if not files:
            raise FileNotFoundError(f"data source {source}: directory holds no {', '.join(LOCAL_FORMATS)} files")
        return files
    if any(ch in source for ch in "*?["):
        files = sorted(Path(p) for p in glob.glob(source))
        if not files:
            raise FileNotFoundError(f"data source {source}: the pattern matches no file")
        return files
    if path.exists():
        return [path]
    if path.suffix in LOCAL_FORMATS or source.startswith((".", "/", "~")):
        raise FileNotFoundError(f"data source {source} does not exist")
    return None


def iter_texts(source: str, split: str = "train", text_column: str = "text", streaming: bool = False,
               trust_remote_code: bool = False) -> Iterator[str]:
    """Documents of ``source`` in a fixed order. A ``.txt`` file is one document."""
    files = local_files(source)
    if files is not None:
        for path in files:
            if path.suffix == ".txt":
                yield path.read_text(encoding="utf-8", errors="replace")
            else:
                yield from _column(_load(LOCAL_FORMATS[path.suffix], str(path), "train", streaming), text_column, str(path))
        return
    import datasets

    try:
        ds = datasets.load_dataset(source, split=split, streaming=streaming, trust_remote_code=trust_remote_code) \
            if trust_remote_code else datasets.load_dataset(source, split=split, streaming=streaming)
    except Exception as err:  # hub errors come in many types; say which source failed and why
        offline = " (HF_HUB_OFFLINE is set)" if os.environ.get("HF_HUB_OFFLINE") == "1" else ""
        raise ValueError(f"cannot load dataset {source!r} split {split!r}{offline}: {err}") from None
    yield from _column(ds, text_column, source)


def _load(kind: str, path: str, split: str, streaming: bool):
    import datasets

    return datasets.load_dataset(kind, data_files=path, split=split, streaming=streaming)


def _column(ds, text_column: str, where: str) -> Iterator[str]:
    columns = ds.column_names
    if columns is not None and text_column not in columns:
        raise ValueError(f"data source {where} has no column {text_column!r}; its columns: {', '.join(columns)} (set data.text_column)")
    for row in ds:
        yield row[text_column]
