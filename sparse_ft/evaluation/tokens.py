"""Evaluation token streams: a flat numpy token file (``.bin``, memory-mapped, as LongLoRA's
eval data; its format is ``sparse_ft.data.token_files``), or text tokenised with the model's
tokenizer (documents joined by EOS)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import numpy as np
from tqdm import tqdm

from sparse_ft.data.token_files import DTYPES, sidecar


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
