"""Evaluation token streams: a flat numpy token file (``.bin``, memory-mapped, as LongLoRA's
eval data; its format is ``sparse_ft.data.token_files``), which needs no tokenizer, or text
tokenised with the model's tokenizer (documents joined by EOS): jsonl/json/parquet rows, an HF
dataset, or any other file as one document of UTF-8 text (``.txt``, ``.md``, no suffix).
Errors name the flag or key the data was given by (``keys``: ``--data`` and ``--text-column``
here, ``validation.data`` and ``data.text_column`` in a training run)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import numpy as np
from tqdm import tqdm

from sparse_ft.data.sources import Keys, check_parquet, iter_texts, local_files
from sparse_ft.data.token_files import TOKEN_DTYPES, sidecar

TOKEN_FILE = ".bin"
ROWS = (".jsonl", ".json", ".parquet")  # one document per row
EVAL_KEYS = Keys("--data", "--text-column")


def _text_file(path: Path) -> bool:
    return path.is_file() and path.suffix not in (TOKEN_FILE, *ROWS)


def check_eval_data(data: str, data_dtype: Optional[str] = None, *, keys: Keys = EVAL_KEYS) -> bool:
    """Whether ``data`` is a token file (then no tokenizer is needed). A local file that is
    missing, not UTF-8 text or of a kind no reader takes, a token file whose sidecar or size
    does not fit, fails here, before any model loads."""
    path = Path(data).expanduser()
    if path.suffix == TOKEN_FILE:
        if not path.is_file():
            raise FileNotFoundError(f"{keys.source} {data} does not exist")
        _token_dtype(path, data, data_dtype, keys)
        return True
    if _text_file(path):
        _utf8(path, data, keys)
    else:
        for file in local_files(data, keys) or []:
            if file.suffix == ".parquet":
                check_parquet(file, keys)
    return False


def load_tokens(data: str, tokenizer, vocab_size: Optional[int], data_dtype: Optional[str] = None, *,
                split: str = "validation", text_column: str = "text", max_tokens: Optional[int] = None,
                keys: Keys = EVAL_KEYS) -> np.ndarray:
    """The evaluation tokens, checked against the model's vocabulary (``vocab_size`` None:
    read before the model loads, then checked with :func:`check_vocabulary`)."""
    path = Path(data).expanduser()
    if check_eval_data(data, data_dtype, keys=keys):
        dtype = _token_dtype(path, data, data_dtype, keys)
        tokens = np.memmap(path, dtype=TOKEN_DTYPES[dtype], mode="r") if path.stat().st_size else np.zeros(0, np.uint16)
    else:
        tokens = text_tokens(data, tokenizer, split, text_column, max_tokens=max_tokens, keys=keys)
    if max_tokens is not None:
        tokens = tokens[:max_tokens]
    if len(tokens) == 0:
        raise ValueError(f"{keys.source} {data} holds no tokens")
    if vocab_size is not None:
        check_vocabulary(tokens, vocab_size, data, keys)
    return tokens


def check_vocabulary(tokens: np.ndarray, vocab_size: int, data: str, keys: Keys = EVAL_KEYS) -> None:
    top = int(tokens.max())
    if top >= vocab_size:
        raise ValueError(
            f"{keys.source} {data} contains token id {top} >= the model's vocabulary size {vocab_size}: "
            "it was tokenised for another model (or read with the wrong --data-dtype)"
        )


def _token_dtype(path: Path, data: str, data_dtype: Optional[str], keys: Keys) -> str:
    """The token file's dtype (``--data-dtype``, else its sidecar's, else uint16), checked
    against the file's size."""
    dtype = data_dtype or sidecar(path).get("dtype", "uint16")
    if dtype not in TOKEN_DTYPES:
        source = "--data-dtype" if data_dtype else f"the dtype in {path.with_suffix('.json')}"
        raise ValueError(f"{source} {dtype!r} is unknown; allowed: {', '.join(TOKEN_DTYPES)}")
    if path.stat().st_size % np.dtype(TOKEN_DTYPES[dtype]).itemsize:
        raise ValueError(f"{keys.source} {data} has {path.stat().st_size} bytes, not a whole number of {dtype} tokens")
    return dtype


def text_tokens(source: str, tokenizer, split: str = "validation", text_column: str = "text",
                *, max_tokens: Optional[int] = None, keys: Keys = EVAL_KEYS) -> np.ndarray:
    """Tokenise ``source`` (a text file, jsonl/json/parquet file or directory, or an HF dataset
    id, streamed when only ``max_tokens`` are wanted) document by document, EOS between
    documents."""
    if tokenizer is None:
        raise ValueError(f"{keys.source} {source} is text: tokenising it needs the model's tokenizer")
    path = Path(source).expanduser()
    if _text_file(path):
        documents = [_utf8(path, source, keys)]
    else:
        streaming = max_tokens is not None and local_files(source, keys) is None
        documents = iter_texts(source, split, text_column, streaming=streaming, keys=keys)
    out: list[int] = []
    with tqdm(desc=f"tokenising {source}", unit="tok", unit_scale=True, total=max_tokens, leave=False) as bar:
        for text in documents:
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            if tokenizer.eos_token_id is not None:
                ids.append(tokenizer.eos_token_id)
            out.extend(ids)
            bar.update(len(ids))
            if max_tokens is not None and len(out) >= max_tokens:
                break
    return np.asarray(out[:max_tokens] if max_tokens else out, dtype=np.int64)


def _utf8(path: Path, source: str, keys: Keys) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{keys.source} {source} is not UTF-8 text (byte {err.start}) nor a {TOKEN_FILE}/{'/'.join(ROWS)} file") from None
