"""Evaluation token streams: a flat numpy token file (``.bin``, memory-mapped), or text
tokenised with the model's tokenizer (documents joined by EOS)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import numpy as np

DTYPES = {"uint16": np.uint16, "uint32": np.uint32}


def dtype_for(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 65536 else "uint32"


def load_tokens(data: str, tokenizer, vocab_size: int, data_dtype: str = "uint16", split: str = "validation",
                text_column: str = "text", max_tokens: Optional[int] = None) -> np.ndarray:
    path = Path(data)
    if path.suffix == ".bin":
        if not path.is_file():
            raise FileNotFoundError(f"--data {data} does not exist")
        if data_dtype not in DTYPES:
            raise ValueError(f"--data-dtype {data_dtype!r} is unknown; allowed: {', '.join(DTYPES)}")
        tokens = np.memmap(path, dtype=DTYPES[data_dtype], mode="r")
    else:
        tokens = text_tokens(data, tokenizer, split, text_column, max_tokens)
    if max_tokens is not None:
        tokens = tokens[:max_tokens]
    if len(tokens) == 0:
        raise ValueError(f"--data {data} holds no tokens")
    top = int(tokens.max())
    if top >= vocab_size:
        raise ValueError(
            f"--data {data} contains token id {top} >= the model's vocabulary size {vocab_size}: "
            "it was tokenised for another model (or read with the wrong --data-dtype)"
        )
    return tokens


def text_tokens(source: str, tokenizer, split: str = "validation", text_column: str = "text",
                max_tokens: Optional[int] = None) -> np.ndarray:
    from sparse_ft.data.sources import iter_texts

    out: list[int] = []
    for text in iter_texts(source, split, text_column):
        out.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
        out.append(tokenizer.eos_token_id)
        if max_tokens is not None and len(out) >= max_tokens:
            break
    return np.asarray(out, dtype=np.int64)


def write_token_file(tokens: np.ndarray, path: Path, vocab_size: int, tokenizer_name: str) -> Path:
    """``path`` (.bin) plus a JSON sidecar saying how to read it."""
    dtype = dtype_for(vocab_size)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".bin.tmp")
    np.asarray(tokens, dtype=DTYPES[dtype]).tofile(tmp)
    tmp.replace(path)
    path.with_suffix(".json").write_text(json.dumps({"dtype": dtype, "tokens": int(len(tokens)), "tokenizer": tokenizer_name}, indent=1))
    return path
