"""Flat token files: a ``.bin`` of uint16 or uint32 ids (LongLoRA's evaluation format, memory-
mappable) with a JSON sidecar (same name, ``.json``) recording its dtype, token count and
tokenizer, so readers need not be told the dtype. The corpus builder writes them, the
evaluator reads them."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np

from sparse_ft.files.json_files import json_object
from sparse_ft.files.outputs import atomic_file

TOKEN_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}


def dtype_for(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 65536 else "uint32"


def sha256_file(path: Path) -> str:
    """A file's checksum, read in pieces: token files run to gigabytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for piece in iter(lambda: f.read(1 << 24), b""):
            digest.update(piece)
    return digest.hexdigest()


def sidecar(path: Path) -> dict:
    """The token file's JSON sidecar (empty when there is none); one that is not a JSON object
    is a ``ValueError`` naming it."""
    meta = path.with_suffix(".json")
    return json_object(meta, f"the sidecar of {path}") if meta.is_file() else {}


def write_tokens(tokens: Any, path: Path, dtype: str) -> Path:
    """The raw ids, written to a temporary file and renamed: a reader never sees half a file."""
    with atomic_file(path, "wb") as f:
        np.asarray(tokens, dtype=TOKEN_DTYPES[dtype]).tofile(f)
    return path


def write_token_file(tokens: np.ndarray, path: Path, vocab_size: int, tokenizer_name: str) -> Path:
    """``path`` (.bin, uint16 or uint32 by vocabulary size) plus its JSON sidecar, each written
    atomically."""
    if path.suffix != ".bin":
        raise ValueError(f"--output {path} must end in .bin")
    dtype = dtype_for(vocab_size)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_tokens(tokens, path, dtype)
    meta = {"dtype": dtype, "tokens": int(len(tokens)), "tokenizer": tokenizer_name, "vocab_size": int(vocab_size)}
    with atomic_file(path.with_suffix(".json")) as f:
        f.write(json.dumps(meta, indent=1))
    return path
