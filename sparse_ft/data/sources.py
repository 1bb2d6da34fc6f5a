"""Where documents come from. Every source yields plain strings (``iter_texts``), or its rows
whole for chat and instruction data (``iter_rows``), in a fixed order:

- local jsonl / json / parquet / txt files: a file, a directory (searched recursively) or a glob;
  a ``.txt`` file is one document, the others hold one document per row. JSON files are read
  here, line by line, so that a broken line is reported with its file and line number;
- ``hf://datasets/OWNER/NAME/PATTERN``: files of a Hub dataset repository, read by datasets'
  json/parquet/text builders. This reaches data-only files of repositories whose loading script
  datasets >= 4 refuses to run, e.g. RedPajama's sample:
  ``hf://datasets/togethercomputer/RedPajama-Data-1T-Sample/*.jsonl``;
- anything else is an HF dataset id for ``datasets.load_dataset(id, split=split)``.

Errors name the source by the key or flag the user gave it (:class:`Keys`): ``data.source``
for training, ``--data`` for ``sparse-ft eval``, ``validation.data`` for validation. A row
without a document (the text column absent or null) is counted (:class:`Rows`), so that the
cache build reports how many rows gave nothing rather than drop them silently.
"""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, NamedTuple, Optional

LOCAL_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text"}
HUB_FILES = "hf://"


class Keys(NamedTuple):
    """What the user typed to name the source and its text column, which every error names."""

    source: str = "data.source"
    text_column: str = "data.text_column"

    def setting(self, value: str) -> str:
        """How the user sets the source to ``value``: ``--data VALUE`` or ``data.source=VALUE``."""
        return f"{self.source} {value}" if self.source.startswith("-") else f"{self.source}={value}"


TRAINING = Keys()


@dataclass
class Rows:
    """Rows read that held no document: the text column absent from the row, or null."""

    without_text: int = 0


def local_files(source: str, keys: Keys = TRAINING) -> Optional[list[Path]]:
    """Local files behind ``source``, or None when it is remote (an HF id or hf:// files)."""
    if source.startswith(HUB_FILES):
        return None
    path = Path(source).expanduser()
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix in LOCAL_FORMATS)
        if not files:
            raise FileNotFoundError(f"{keys.source} {source}: directory holds no {', '.join(LOCAL_FORMATS)} files")
        return files
    if any(ch in source for ch in "*?["):
        files = sorted(Path(p) for p in glob.glob(os.path.expanduser(source), recursive=True) if Path(p).suffix in LOCAL_FORMATS)
        if not files:
            raise FileNotFoundError(f"{keys.source} {source}: the pattern matches no {', '.join(LOCAL_FORMATS)} file")
        return files
    if path.exists():
        if path.suffix not in LOCAL_FORMATS:
            raise ValueError(f"{keys.source} {source}: unsupported file type {path.suffix!r}; allowed: {', '.join(LOCAL_FORMATS)}")
        return [path]
    if path.suffix in LOCAL_FORMATS or source.startswith((".", "/", "~")):
        raise FileNotFoundError(f"{keys.source} {source} does not exist")
    return None


def iter_texts(source: str, split: str = "train", text_column: str = "text", streaming: bool = False,
               *, trust_remote_code: bool = False, keys: Keys = TRAINING, rows: Optional[Rows] = None) -> Iterator[str]:
    """Documents of ``source`` (see the module docstring) in a fixed order; a source with none
    is an error once it is read to the end. ``split`` applies to HF dataset ids only; files
    are one split. ``streaming`` reads remote data without downloading it first (local JSON
    files are always read line by line). ``rows`` counts the rows that held no document."""
    documents = 0
    for text in _texts(source, split, text_column, streaming, trust_remote_code=trust_remote_code, keys=keys):
        if text is None:
            if rows is not None:
                rows.without_text += 1
            continue
        documents += 1
        yield text
    if documents == 0:
        raise ValueError(f"{keys.source} {source}: no documents (empty, or no row with a {text_column!r} value)")


def _texts(source: str, split: str, text_column: str, streaming: bool, *, trust_remote_code: bool,
           keys: Keys) -> Iterator[Optional[str]]:
    """Each row's document, None for a row without one."""
    files = local_files(source, keys)
    if files is not None:
        for path in files:
            kind = LOCAL_FORMATS[path.suffix]
            if kind == "text":
                yield _utf8_text(path, keys)
            elif kind == "json":
                yield from _json_texts(path, text_column, keys)
            else:
                yield from _column(_parquet(path, streaming, keys), text_column, str(path), keys)
        return
    yield from _column(_remote_dataset(source, split, streaming=streaming, trust_remote_code=trust_remote_code, keys=keys),
                       text_column, source, keys)


def iter_rows(source: str, split: str = "train", streaming: bool = False, *, trust_remote_code: bool = False,
              keys: Keys = TRAINING) -> Iterator[tuple[str, dict]]:
    """Every row of ``source`` whole, as ``(where, row)``: ``where`` names the file and line of
    a local JSON row, else the source and the row's number (from 1), for errors about the row.
    Chat and instruction data (sparse_ft/data/conversations.py) read their rows so; a ``.txt``
    file holds one text, not rows, and is refused."""
    files = local_files(source, keys)
    if files is None:
        ds = _remote_dataset(source, split, streaming=streaming, trust_remote_code=trust_remote_code, keys=keys)
        yield from ((f"{source} row {number}", row) for number, row in enumerate(ds, 1))
        return
    for path in files:
        kind = LOCAL_FORMATS[path.suffix]
        if kind == "text":
            raise ValueError(f"{keys.source} {path}: a .txt file is one text, not rows; rows are read from "
                             f"{', '.join(s for s, k in LOCAL_FORMATS.items() if k != 'text')} files")
        if kind == "parquet":
            yield from ((f"{path} row {number}", row) for number, row in enumerate(_parquet(path, streaming, keys), 1))
            continue
        for where, row in _json_rows(path, keys):
            if not isinstance(row, dict):
                raise ValueError(f"{keys.source} {path} {where}: a JSON {type(row).__name__}, not an object")
            yield f"{path} {where}", row


def _remote_dataset(source: str, split: str, *, streaming: bool, trust_remote_code: bool, keys: Keys):
    """An HF dataset id's split, or the files of ``hf://datasets/...``, loaded by datasets."""
    if source.startswith(HUB_FILES):
        suffix = Path(source).suffix
        if suffix not in LOCAL_FORMATS:
            raise ValueError(f"{keys.source} {source}: name the files' type, e.g. {source.rstrip('/')}/*.jsonl; "
                             f"allowed: {', '.join(LOCAL_FORMATS)}")
        return _remote(source, lambda: _load_files(LOCAL_FORMATS[suffix], source, streaming), keys)
    import datasets

    kwargs = {"trust_remote_code": True} if trust_remote_code else {}
    return _remote(source, lambda: datasets.load_dataset(source, split=split, streaming=streaming, **kwargs), keys, split)


def _json_texts(path: Path, text_column: str, keys: Keys) -> Iterator[Optional[str]]:
    """The ``text_column`` of every row of a local JSON file. A row without the column is
    no document, like a null one (datasets' behaviour), and counted as one; a file where no
    row has it is an error."""
    columns: set[str] = set()
    for where, row in _json_rows(path, keys):
        if not isinstance(row, dict):
            raise ValueError(f"{keys.source} {path} {where}: a JSON {type(row).__name__}, not an object with a {text_column!r} field")
        columns.update(row)
        yield _text(row.get(text_column), text_column, f"{path} {where}", keys)
    if columns and text_column not in columns:
        raise _no_column(str(path), text_column, sorted(columns), keys)


def _json_rows(path: Path, keys: Keys) -> Iterator[tuple[str, Any]]:
    """``(where, value)`` for each row of a JSON-lines file, or of a file holding one JSON array
    (datasets reads ``.json`` both ways); blank lines are skipped."""
    with open(path, "rb") as f:
        array = f.read(4096).lstrip().startswith(b"[")
        f.seek(0)
        if array:
            yield from ((f"item {i}", row) for i, row in enumerate(_parse(f.read(), path, 1, keys)))
            return
        for number, line in enumerate(f, 1):
            if line.strip():
                yield f"line {number}", _parse(line, path, number, keys)


def _parse(raw: bytes, path: Path, first_line: int, keys: Keys) -> Any:
    """``raw`` (the text from ``first_line`` on) as JSON; an error names the file and line."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line = first_line + raw[: err.start].count(b"\n")
        raise ValueError(f"{keys.source} {path} line {line}: not UTF-8 text ({err.reason})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        cut = "; the file ends in this line without a newline: was it cut short?" if not raw.endswith(b"\n") else ""
        line = first_line + err.lineno - 1
        raise ValueError(f"{keys.source} {path} line {line}: not valid JSON "
                         f"({err.msg.removesuffix(' at')} at column {err.colno}){cut}") from None


def _utf8_text(path: Path, keys: Keys) -> str:
    """A ``.txt`` document, refused by byte offset when it is not UTF-8 (as JSON lines are by
    line): replacing undecodable bytes would train on text that is not in the file."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{keys.source} {path}: not UTF-8 text (byte {err.start}: {err.reason})") from None


def check_parquet(path: Path, keys: Keys = TRAINING) -> None:
    """A local parquet file's footer, read (cheaply) before datasets reads the file: one that
    is not parquet (cut short, another format) fails naming it, before datasets logs and raises."""
    import pyarrow.parquet as pq

    try:
        pq.read_schema(path)
    except Exception as err:  # pyarrow raises ArrowInvalid, OSError and others
        raise ValueError(f"{keys.source} {path}: not a parquet file ({' '.join(str(err).split())})") from None


def _parquet(path: Path, streaming: bool, keys: Keys):
    check_parquet(path, keys)
    return _load_files("parquet", str(path), streaming)


def _load_files(kind: str, data_files: str, streaming: bool):
    import datasets

    extra = {"sample_by": "document"} if kind == "text" else {}  # a text file is one document, as locally
    return datasets.load_dataset(kind, data_files=data_files, split="train", streaming=streaming, **extra)


def _remote(source: str, load, keys: Keys, split: Optional[str] = None):
    where = f"{source!r}" + (f" split {split!r}" if split else "")
    try:
        return load()
    except Exception as err:  # hub errors come in many types; say which source failed and why
        hint = ""
        if "scripts are no longer supported" in str(err):
            hint = f"; read its data files instead, e.g. {keys.setting(f'hf://datasets/{source}/*.jsonl')}"
        if os.environ.get("HF_HUB_OFFLINE") == "1":
            hint += " (HF_HUB_OFFLINE=1 is set)"
        raise ValueError(f"cannot load dataset {where}: {err}{hint}") from None


def _column(ds, text_column: str, where: str, keys: Keys) -> Iterator[Optional[str]]:
    columns = ds.column_names
    if columns is not None and text_column not in columns:
        raise _no_column(where, text_column, columns, keys)
    for row in ds:
        yield _text(row[text_column], text_column, where, keys)


def _text(value: Any, text_column: str, where: str, keys: Keys) -> Optional[str]:
    """A row's document; None for a missing value (no document)."""
    if value is not None and not isinstance(value, str):
        raise ValueError(f"{keys.source} {where}: column {text_column!r} holds {type(value).__name__}, not text "
                         f"(set {keys.text_column})")
    return value


def _no_column(where: str, text_column: str, columns: list[str], keys: Keys) -> ValueError:
    return ValueError(f"{keys.source} {where} has no column {text_column!r}; its columns: {', '.join(columns)} "
                      f"(set {keys.text_column})")
