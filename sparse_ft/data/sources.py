"""Where documents come from. Every source yields plain strings, in a fixed order:

- local jsonl / json / parquet / txt files: a file, a directory (searched recursively) or a glob;
  a ``.txt`` file is one document, the others hold one document per row;
- ``hf://datasets/OWNER/NAME/PATTERN``: files of a Hub dataset repository, read by datasets'
  json/parquet/text builders. This reaches data-only files of repositories whose loading script
  datasets >= 4 refuses to run, e.g. RedPajama's sample:
  ``hf://datasets/togethercomputer/RedPajama-Data-1T-Sample/*.jsonl``;
- anything else is an HF dataset id for ``datasets.load_dataset(id, split=split)``.
"""

from __future__ import annotations

import glob
import os
from pathlib import Path
from typing import Iterator, Optional

LOCAL_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text"}
HUB_FILES = "hf://"


def local_files(source: str) -> Optional[list[Path]]:
    """Local files behind ``source``, or None when it is remote (an HF id or hf:// files)."""
    if source.startswith(HUB_FILES):
        return None
    path = Path(source).expanduser()
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix in LOCAL_FORMATS)
        if not files:
            raise FileNotFoundError(f"data source {source}: directory holds no {', '.join(LOCAL_FORMATS)} files")
        return files
    if any(ch in source for ch in "*?["):
        files = sorted(Path(p) for p in glob.glob(os.path.expanduser(source), recursive=True) if Path(p).suffix in LOCAL_FORMATS)
        if not files:
            raise FileNotFoundError(f"data source {source}: the pattern matches no {', '.join(LOCAL_FORMATS)} file")
        return files
    if path.exists():
        if path.suffix not in LOCAL_FORMATS:
            raise ValueError(f"data source {source}: unsupported file type {path.suffix!r}; allowed: {', '.join(LOCAL_FORMATS)}")
        return [path]
    if path.suffix in LOCAL_FORMATS or source.startswith((".", "/", "~")):
        raise FileNotFoundError(f"data source {source} does not exist")
    return None


def iter_texts(source: str, split: str = "train", text_column: str = "text", streaming: bool = False,
               trust_remote_code: bool = False) -> Iterator[str]:
    """Documents of ``source`` (see the module docstring) in a fixed order. ``split`` applies to
    HF dataset ids only; files are one split. ``streaming`` reads remote data without
    downloading it first."""
    files = local_files(source)
    if files is not None:
        for path in files:
            if path.suffix == ".txt":
                yield path.read_text(encoding="utf-8", errors="replace")
            else:
                yield from _column(_load_files(LOCAL_FORMATS[path.suffix], str(path), streaming), text_column, str(path))
        return
    if source.startswith(HUB_FILES):
        suffix = Path(source).suffix
        if suffix not in LOCAL_FORMATS:
            raise ValueError(f"data source {source}: name the files' type, e.g. {source.rstrip('/')}/*.jsonl; "
                             f"allowed: {', '.join(LOCAL_FORMATS)}")
        ds = _remote(source, lambda: _load_files(LOCAL_FORMATS[suffix], source, streaming))
    else:
        import datasets

        kwargs = {"trust_remote_code": True} if trust_remote_code else {}
        ds = _remote(source, lambda: datasets.load_dataset(source, split=split, streaming=streaming, **kwargs), split)
    yield from _column(ds, text_column, source)


def _load_files(kind: str, data_files: str, streaming: bool):
    import datasets

    extra = {"sample_by": "document"} if kind == "text" else {}  # a text file is one document, as locally
    return datasets.load_dataset(kind, data_files=data_files, split="train", streaming=streaming, **extra)


def _remote(source: str, load, split: Optional[str] = None):
    where = f"{source!r}" + (f" split {split!r}" if split else "")
    try:
        return load()
    except Exception as err:  # hub errors come in many types; say which source failed and why
        hint = ""
        if "scripts are no longer supported" in str(err):
            hint = f"; read its data files instead, e.g. data.source=hf://datasets/{source}/*.jsonl"
        if os.environ.get("HF_HUB_OFFLINE") == "1":
            hint += " (HF_HUB_OFFLINE=1 is set)"
        raise ValueError(f"cannot load dataset {where}: {err}{hint}") from None


def _column(ds, text_column: str, where: str) -> Iterator[str]:
    columns = ds.column_names
    if columns is not None and text_column not in columns:
        raise ValueError(f"data source {where} has no column {text_column!r}; its columns: {', '.join(columns)} (set data.text_column)")
    for row in ds:
        text = row[text_column]
        if text is None:  # a missing value: no document
            continue
        if not isinstance(text, str):
            raise ValueError(f"data source {where}: column {text_column!r} holds {type(text).__name__}, not text (set data.text_column)")
        yield text
