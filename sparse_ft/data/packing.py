"""Training samples: documents tokenised once, filtered by length, joined with EOS and cut
into fixed-length samples (labels = inputs; the model shifts them). ``data.packing`` decides
whether a sample's documents attend to each other (``blocks``) or each to itself alone
(``padding_free``: positions restart after each EOS).

The token stream goes to a cache file as it is produced, so a large streamed source never
sits in memory, and a finished cache is found again by a key over everything that changes
its contents. Caches are written to a temporary name and renamed: a crash leaves no file
that looks complete, and a later build removes the temporary files of writers killed on this
host (``remove_stale_scratch``), never one another host or a live process is writing. The
sidecar records the tokens file's size and sha256, checked at every load: a cache cut short
or overwritten is rebuilt, not trained on.
"""

from __future__ import annotations

import hashlib
import json
import sys
from itertools import islice
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
from tqdm import tqdm

from sparse_ft.data.sources import iter_texts, local_files
from sparse_ft.data.token_files import sha256_file
from sparse_ft.files.outputs import atomic_file, remove_stale_scratch

BATCH = 64
TOKEN_BYTES = np.dtype(np.int32).itemsize


class TokenBlocks(torch.utils.data.Dataset):
    """Training samples from rows of token ids (samples, seq_len), e.g. a pretraining corpus's
    blocks (``sparse_ft.experiment.corpus.load_blocks``). With ``restart_after`` (the EOS id
    that ends each document), padding-free packing: positions restart at 0 after it, which
    the attention reads as document boundaries (each document attends to itself alone, with
    its own pattern, as transformers' DataCollatorWithFlattening rows do), and a document's
    first token is no target (nothing before it in its document predicts it)."""

    def __init__(self, samples: np.ndarray, restart_after: Optional[int] = None) -> None:
        self.samples, self.restart_after = samples, restart_after

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids = torch.from_numpy(np.array(self.samples[index], dtype=np.int64))
        if self.restart_after is None:
            return {"input_ids": ids, "labels": ids}
        return {"input_ids": ids, "labels": ids.masked_fill(document_starts(ids, self.restart_after), -100),
                "position_ids": restarting_positions(ids, self.restart_after)}

    def sha256(self) -> str:
        """The samples' content, which a checkpoint records so that a resume on other data is
        refused (``sparse_ft.train.fingerprint.check_data``)."""
        return hashlib.sha256(np.ascontiguousarray(self.samples).data).hexdigest()


def document_starts(ids: torch.Tensor, end: int) -> torch.Tensor:
    """True on the tokens that follow ``end`` (a document's first token; the sample's first
    token continues a document cut by the previous sample, or starts one)."""
    return torch.nn.functional.pad(ids[:-1] == end, (1, 0))


def restarting_positions(ids: torch.Tensor, end: int) -> torch.Tensor:
    """Positions counting from 0 at the sample's start and after every ``end`` token."""
    index = torch.arange(len(ids))
    starts = document_starts(ids, end)
    starts[0] = True
    return index - torch.where(starts, index, 0).cummax(dim=0).values


class PackedDataset(TokenBlocks):
    """Fixed-length samples read from the cache by memory map."""

    def __init__(self, path: Path, seq_len: int, restart_after: Optional[int] = None) -> None:
        tokens = np.memmap(path, dtype=np.int32, mode="r")
        super().__init__(tokens[: len(tokens) // seq_len * seq_len].reshape(-1, seq_len), restart_after)
        self.path, self.seq_len = path, seq_len

    def sha256(self) -> str:
        """The token cache's sha256, computed once when the cache was built and checked against
        the file when it loaded: reading it costs nothing more."""
        return load_meta(self)["sha256"]


def _fingerprint(source: str) -> list:
    files = local_files(source)
    if files is None:
        return [source]
    return [[str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns] for p in files]


def _tokenizer_id(tokenizer) -> str:
    vocab = sorted(tokenizer.get_vocab().items())
    return hashlib.sha256(json.dumps([type(tokenizer).__name__, vocab, tokenizer.eos_token_id]).encode()).hexdigest()[:16]


def cache_key(data_cfg: Any, tokenizer, seq_len: int) -> str:
    parts = [_fingerprint(data_cfg.source), data_cfg.split, data_cfg.text_column, data_cfg.min_tokens,
             data_cfg.max_documents, seq_len, _tokenizer_id(tokenizer), 2]
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:24]


def cache_paths(data_cfg: Any, tokenizer, seq_len: int) -> tuple[Path, Path]:
    """The cache's tokens file and its JSON sidecar."""
    cache = Path(data_cfg.cache_dir) / cache_key(data_cfg, tokenizer, seq_len)
    return cache.with_suffix(".tokens"), cache.with_suffix(".json")


def build_train_dataset(data_cfg: Any, tokenizer, seq_len: int, trust_remote_code: bool = False) -> PackedDataset:
    """Build (or reuse, once verified) the packed token cache for ``data_cfg`` and return the dataset."""
    tokens_path, meta_path = cache_paths(data_cfg, tokenizer, seq_len)
    problem = _cache_problem(tokens_path, meta_path) if meta_path.exists() else None
    if problem:
        print(f"data cache {tokens_path}: {problem}; rebuilding it", file=sys.stderr, flush=True)
    if problem or not meta_path.exists():
        _remove_stale(tokens_path, meta_path)
        try:
            _write_cache(data_cfg, tokenizer, seq_len, tokens_path, meta_path=meta_path,
                         trust_remote_code=trust_remote_code)
        except OSError as err:  # a full disk, a read-only or vanished directory
            raise ValueError(f"data.cache_dir {data_cfg.cache_dir}: cannot write the token cache {tokens_path.name} "
                             f"({err.strerror or err}); free space there or set data.cache_dir elsewhere") from None
    return PackedDataset(tokens_path, seq_len, tokenizer.eos_token_id if data_cfg.packing == "padding_free" else None)


def _remove_stale(*paths: Path) -> None:
    for path in paths:
        for tmp in remove_stale_scratch(path):
            print(f"data cache: removed {tmp.name}, left by a killed run", file=sys.stderr, flush=True)


def _cache_problem(tokens_path: Path, meta_path: Path) -> Optional[str]:
    """Why the tokens file differs from what its sidecar recorded, or None. The size is checked
    first (free), then the sha256 on every load: it reads the file once (0.4 s for 100M tokens,
    400 MB, on one CPU core), little next to the run, and catches what keeps size and mtime."""
    try:
        meta = json.loads(meta_path.read_text())
    except ValueError:
        return f"its record {meta_path.name} is not valid JSON"
    missing = [key for key in ("tokens", "bytes", "sha256") if key not in meta]
    if missing:
        return f"its record {meta_path.name} lacks {', '.join(missing)}"
    if not tokens_path.exists():
        return "the tokens file is missing"
    size = tokens_path.stat().st_size
    if size != meta["bytes"] or size != meta["tokens"] * TOKEN_BYTES:
        return f"{size} bytes on disk, but {meta['bytes']} recorded ({meta['tokens']} tokens)"
    if sha256_file(tokens_path) != meta["sha256"]:
        return "its sha256 differs from the one recorded (the file was overwritten)"
    return None


def check_source(data_cfg: Any, tokenizer, seq_len: int) -> None:
    """Read a local source's documents before a run starts, so that a broken file is reported
    (file and line) before anything loads. Nothing to do where this cache exists (its source
    was read whole to build it) or the source is remote (it is read when the cache is built)."""
    if cache_paths(data_cfg, tokenizer, seq_len)[1].exists() or local_files(data_cfg.source) is None:
        return
    texts = iter_texts(data_cfg.source, data_cfg.split, data_cfg.text_column)
    for _ in islice(texts, data_cfg.max_documents):
        pass


def _write_cache(data_cfg, tokenizer, seq_len, tokens_path: Path, *, meta_path: Path, trust_remote_code: bool) -> None:
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no eos_token_id; packing separates documents with EOS")
    tokens_path.parent.mkdir(parents=True, exist_ok=True)
    kept = seen = longest = written = 0
    texts = iter_texts(data_cfg.source, data_cfg.split, data_cfg.text_column, data_cfg.streaming,
                       trust_remote_code=trust_remote_code)
    bar = tqdm(desc=f"tokenize {data_cfg.source}", unit="doc")
    with atomic_file(tokens_path, "wb") as out:
        batch: list[str] = []
        for text in texts:
            batch.append(text)
            if data_cfg.max_documents is not None and seen + len(batch) >= data_cfg.max_documents:
                break
            if len(batch) == BATCH:
                k, lg, w = _flush(batch, tokenizer, data_cfg.min_tokens, out)
                kept, longest, written, seen = kept + k, max(longest, lg), written + w, seen + len(batch)
                bar.update(len(batch))
                bar.set_postfix(kept=kept, tokens=written, refresh=False)
                batch = []
        if batch:
            k, lg, w = _flush(batch, tokenizer, data_cfg.min_tokens, out)
            kept, longest, written, seen = kept + k, max(longest, lg), written + w, seen + len(batch)
            bar.update(len(batch))
        bar.close()
        if written < seq_len:
            raise ValueError(
                f"data.source {data_cfg.source}: {kept} of {seen} documents have >= data.min_tokens={data_cfg.min_tokens} "
                f"tokens (longest: {longest}), {written} tokens in all: not one sample of seq_len={seq_len}"
            )
        out.flush()
        written_file = Path(out.name)
        meta = {"documents": seen, "kept": kept, "tokens": written, "bytes": written_file.stat().st_size,
                "sha256": sha256_file(written_file), "samples": written // seq_len, "seq_len": seq_len,
                "source": data_cfg.source, "min_tokens": data_cfg.min_tokens}
    with atomic_file(meta_path) as f:
        f.write(json.dumps(meta, indent=2))


def _flush(texts: list[str], tokenizer, min_tokens: int, out) -> tuple[int, int, int]:
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    kept = [doc + [tokenizer.eos_token_id] for doc in ids if len(doc) >= min_tokens]
    if kept:
        np.concatenate([np.asarray(doc, dtype=np.int32) for doc in kept]).tofile(out)
    return len(kept), max((len(d) for d in ids), default=0), sum(len(d) for d in kept)


def load_meta(dataset: PackedDataset) -> Optional[dict]:
    path = dataset.path.with_suffix(".json")
    return json.loads(path.read_text()) if path.exists() else None
