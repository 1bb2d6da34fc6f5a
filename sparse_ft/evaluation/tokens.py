"""Evaluation token streams: a flat numpy token file (``.bin``, memory-mapped, as LongLoRA's
eval data), or text tokenised with the model's tokenizer (documents joined by EOS).

A ``.bin`` written here has a JSON sidecar (same name, ``.json``) with its dtype, token count
and tokenizer, so readers need not be told the dtype."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import numpy as np
from tqdm import tqdm

DTYPES = {"uint16": np.uint16, "uint32": np.uint32}


def dtype_for(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 65536 else "uint32"


def sidecar(path: Path) -> dict:
    meta = path.with_suffix(".json")
    return json.loads(meta.read_text()) if meta.is_file() else {}


def load_tokens(data: str, tokenizer, vocab_size: int, data_dtype: Optional[str] = None, split: str = "validation",
                text_column: str = "text", max_tokens: Optional[int] = None) -> np.ndarray:
    """The evaluation tokens, checked against the model's vocabulary."""
    path = Path(data)
    if path.suffix == ".bin":
        if not path.is_file():
            raise FileNotFoundError(f"--data {data} does not exist")
        dtype = data_dtype or sidecar(path).get("dtype", "uint16")
        if dtype not in DTYPES:
            raise ValueError(f"--data-dtype {dtype!r} is unknown; allowed: {', '.join(DTYPES)}")
        if path.stat().st_size % np.dtype(DTYPES[dtype]).itemsize:
            raise ValueError(f"--data {data} has {path.stat().st_size} bytes, not a whole number of {dtype} tokens")
        tokens = np.memmap(path, dtype=DTYPES[dtype], mode="r") if path.stat().st_size else np.zeros(0, np.uint16)
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
    """Tokenise ``source`` (text/jsonl/parquet file or directory, or an HF dataset id, streamed
    when only ``max_tokens`` are wanted) document by document, EOS between documents."""
    from sparse_ft.data.sources import iter_texts, local_files

    streaming = max_tokens is not None and local_files(source) is None
    out: list[int] = []
    bar = tqdm(desc=f"tokenising {source}", unit="tok", unit_scale=True, total=max_tokens, leave=False)
    for text in iter_texts(source, split, text_column, streaming=streaming):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if tokenizer.eos_token_id is not None:
            ids.append(tokenizer.eos_token_id)
        out.extend(ids)
        bar.update(len(ids))
        if max_tokens is not None and len(out) >= max_tokens:
            break
    bar.close()
    return np.asarray(out[:max_tokens] if max_tokens else out, dtype=np.int64)


def write_token_file(tokens: np.ndarray, path: Path, vocab_size: int, tokenizer_name: str) -> Path:
    """``path`` (.bin, uint16 or uint32 by vocabulary size) plus its JSON sidecar, each written
    atomically."""
    if path.suffix != ".bin":
        raise ValueError(f"--output {path} must end in .bin")
    dtype = dtype_for(vocab_size)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".bin.tmp")
    np.asarray(tokens, dtype=DTYPES[dtype]).tofile(tmp)
    tmp.replace(path)
    meta = {"dtype": dtype, "tokens": int(len(tokens)), "tokenizer": tokenizer_name, "vocab_size": int(vocab_size)}
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(meta, indent=1))
    tmp.replace(path.with_suffix(".json"))
    return path
