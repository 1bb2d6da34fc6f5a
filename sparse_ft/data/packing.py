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
or overwritten is rebuilt, not trained on. Chat and instruction rows (``data.format``) are packed
whole, with their labels, by turn_packing.py into caches of their own. The build reports the rows it left out (no text,
blank, shorter than ``data.min_tokens``) in one line on stderr and in the sidecar.

Under padding-free packing a sample made only of empty documents (EOS after EOS, possible
with ``data.min_tokens: 0``) has no target: every token follows an EOS. Such samples are
skipped, counted in :attr:`TokenBlocks.skipped` (the trainer prints it), rather than refused:
they carry no gradient, so leaving them out trains exactly as if they were never there, while
an optimizer step on them would still move Adam's moments (weight decay, the schedule) with a
zero gradient and log ``loss 0.0``. The skip is decided by the samples alone, so every rank and
every resume agrees on it.
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import asdict, dataclass
from itertools import islice
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
from tqdm import tqdm

from sparse_ft.data.conversations import iter_rendered
from sparse_ft.data.sources import Rows, iter_texts, local_files
from sparse_ft.data.token_files import sha256_file
from sparse_ft.data.turn_packing import PackedTurns, flags_problem, positions_from_starts, template_key, write_turn_cache
from sparse_ft.files.outputs import atomic_file, remove_stale_scratch

BATCH = 64
TOKEN_BYTES = np.dtype(np.int32).itemsize
CHECK_TOKENS = 1 << 24  # tokens read at a time when looking for samples without a target
# The cache format's version, a part of every cache key: raised when what a cache holds, or
# what its sidecar records, changes in a way the key's other parts (source, tokenizer, lengths)
# do not say, so that a cache written the old way is never found again and read the new way;
# raising it rebuilds every cache once. 2: the sidecar records the tokens file's size and
# sha256, checked at every load (1 recorded neither).
CACHE_FORMAT = 2


class TokenBlocks(torch.utils.data.Dataset):
    """Training samples from rows of token ids (samples, seq_len), e.g. a pretraining corpus's
    blocks (``sparse_ft.experiment.corpus.load_blocks``). With ``restart_after`` (the EOS id
    that ends each document), padding-free packing: positions restart at 0 after it, which
    the attention reads as document boundaries (each document attends to itself alone, with
    its own pattern, as transformers' DataCollatorWithFlattening rows do), and a document's
    first token is no target (nothing before it in its document predicts it). A sample
    without any target is skipped (see the module docstring); ``skipped`` counts them."""

    def __init__(self, samples: np.ndarray, restart_after: Optional[int] = None) -> None:
        self.samples, self.restart_after = samples, restart_after
        self.rows = np.arange(len(samples)) if restart_after is None else rows_with_a_target(samples, restart_after)
        self.skipped = len(samples) - len(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids = torch.from_numpy(np.array(self.samples[self.rows[index]], dtype=np.int64))
        if self.restart_after is None:
            return {"input_ids": ids, "labels": ids}
        return {"input_ids": ids, "labels": ids.masked_fill(document_starts(ids, self.restart_after), -100),
                "position_ids": restarting_positions(ids, self.restart_after)}

    def sha256(self) -> str:
        """The samples' content, which a checkpoint records so that a resume on other data is
        refused (``sparse_ft.train.fingerprint.check_resume_data``)."""
        return hashlib.sha256(np.ascontiguousarray(self.samples).data).hexdigest()


def rows_with_a_target(samples: np.ndarray, end: int) -> np.ndarray:
    """The indices of the samples that hold a target under padding-free packing: a token
    whose predecessor is not ``end`` (the model predicts token i from those before it, and a
    document's first token, after ``end``, is no target). Read in pieces: a memory-mapped
    cache never sits in memory whole."""
    keep = np.zeros(len(samples), dtype=bool)
    rows = max(1, CHECK_TOKENS // max(samples.shape[1], 1))
    for start in range(0, len(samples), rows):
        keep[start : start + rows] = (np.asarray(samples[start : start + rows, :-1]) != end).any(axis=1)
    return np.flatnonzero(keep)


def document_starts(ids: torch.Tensor, end: int) -> torch.Tensor:
    """True on the tokens that follow ``end`` (a document's first token; the sample's first
    token continues a document cut by the previous sample, or starts one)."""
    return torch.nn.functional.pad(ids[:-1] == end, (1, 0))


def restarting_positions(ids: torch.Tensor, end: int) -> torch.Tensor:
    """Positions counting from 0 at the sample's start and after every ``end`` token."""
    return positions_from_starts(document_starts(ids, end))


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
             data_cfg.max_documents, seq_len, _tokenizer_id(tokenizer), CACHE_FORMAT]
    if data_cfg.format != "text":  # text caches keep the key they always had
        parts += template_key(data_cfg, tokenizer)
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:24]


def cache_paths(data_cfg: Any, tokenizer, seq_len: int) -> tuple[Path, Path]:
    """The cache's tokens file and its JSON sidecar."""
    cache = Path(data_cfg.cache_dir) / cache_key(data_cfg, tokenizer, seq_len)
    return cache.with_suffix(".tokens"), cache.with_suffix(".json")


def build_train_dataset(data_cfg: Any, tokenizer, seq_len: int, trust_remote_code: bool = False) -> PackedDataset | PackedTurns:
    """Build (or reuse, once verified) the packed token cache for ``data_cfg`` and return the dataset."""
    tokens_path, meta_path = cache_paths(data_cfg, tokenizer, seq_len)
    problem = _cache_problem(tokens_path, meta_path) if meta_path.exists() else None
    if problem:
        print(f"data cache {tokens_path}: {problem}; rebuilding it", file=sys.stderr, flush=True)
    if problem or not meta_path.exists():
        _remove_stale(tokens_path, meta_path)
        write = _write_cache if data_cfg.format == "text" else write_turn_cache
        try:
            write(data_cfg, tokenizer, seq_len, tokens_path, meta_path=meta_path, trust_remote_code=trust_remote_code)
        except OSError as err:  # a full disk, a read-only or vanished directory
            raise ValueError(f"data.cache_dir {data_cfg.cache_dir}: cannot write the token cache {tokens_path.name} "
                             f"({err.strerror or err}); free space there or set data.cache_dir elsewhere") from None
    if data_cfg.format != "text":
        return PackedTurns(tokens_path, seq_len)
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
    return flags_problem(tokens_path, meta) if "flags_sha256" in meta else None


def check_source(data_cfg: Any, tokenizer, seq_len: int) -> None:
    """Read a local source's documents before a run starts, so that a broken file is reported
    (file and line) before anything loads. Nothing to do where this cache exists (its source
    was read whole to build it) or the source is remote (it is read when the cache is built)."""
    if cache_paths(data_cfg, tokenizer, seq_len)[1].exists() or local_files(data_cfg.source) is None:
        return
    if data_cfg.format != "text":  # every row rendered (not tokenised): a bad row or template is named now
        for _ in iter_rendered(data_cfg, tokenizer, limit=data_cfg.max_documents):
            pass
        return
    texts = iter_texts(data_cfg.source, data_cfg.split, data_cfg.text_column)
    for _ in islice(texts, data_cfg.max_documents):
        pass


@dataclass
class Tally:
    """What a cache build read and kept: documents (rows with text), those kept, blank ones
    (no tokens), those shorter than ``data.min_tokens`` (blank ones aside), the longest's
    tokens and the tokens written (EOS included)."""

    documents: int = 0
    kept: int = 0
    blank: int = 0
    short: int = 0
    longest: int = 0
    tokens: int = 0

    def report(self, data_cfg: Any, rows: Rows) -> Optional[str]:
        """The build's one line on what it left out (or kept blank), or None when every row
        was a document kept."""
        if not (rows.without_text or self.blank or self.short):
            return None
        parts = [f"{rows.without_text} without a {data_cfg.text_column!r} value (the column absent or null)"] if rows.without_text else []
        if self.blank:
            parts.append(f"{self.blank} blank ({'kept: data.min_tokens=0' if data_cfg.min_tokens == 0 else 'no tokens'})")
        if self.short:
            parts.append(f"{self.short} shorter than data.min_tokens={data_cfg.min_tokens} tokens")
        return (f"data.source {data_cfg.source}: of {rows.without_text + self.documents} rows, {', '.join(parts)}; "
                f"kept {self.kept} documents ({self.tokens} tokens)")


def _write_cache(data_cfg, tokenizer, seq_len, tokens_path: Path, *, meta_path: Path, trust_remote_code: bool) -> None:
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no eos_token_id; packing separates documents with EOS")
    tokens_path.parent.mkdir(parents=True, exist_ok=True)
    tally, rows = Tally(), Rows()
    texts = iter_texts(data_cfg.source, data_cfg.split, data_cfg.text_column, data_cfg.streaming,
                       trust_remote_code=trust_remote_code, rows=rows)
    bar = tqdm(desc=f"tokenize {data_cfg.source}", unit="doc")
    with atomic_file(tokens_path, "wb") as out:
        batch: list[str] = []
        for text in texts:
            batch.append(text)
            if data_cfg.max_documents is not None and tally.documents + len(batch) >= data_cfg.max_documents:
                break
            if len(batch) == BATCH:
                _flush(batch, tokenizer, data_cfg.min_tokens, out, tally=tally)
                bar.update(len(batch))
                bar.set_postfix(kept=tally.kept, tokens=tally.tokens, refresh=False)
                batch = []
        if batch:
            _flush(batch, tokenizer, data_cfg.min_tokens, out, tally=tally)
            bar.update(len(batch))
        bar.close()
        report = tally.report(data_cfg, rows)
        if report:
            print(report, file=sys.stderr, flush=True)
        if tally.tokens < seq_len:
            raise ValueError(
                f"data.source {data_cfg.source}: {tally.kept} of {tally.documents} documents have >= data.min_tokens="
                f"{data_cfg.min_tokens} tokens (longest: {tally.longest}), {tally.tokens} tokens in all: not one sample "
                f"of seq_len={seq_len}"
            )
        out.flush()
        written_file = Path(out.name)
        meta = {**asdict(tally), "rows_without_text": rows.without_text, "bytes": written_file.stat().st_size,
                "sha256": sha256_file(written_file), "samples": tally.tokens // seq_len, "seq_len": seq_len,
                "source": data_cfg.source, "min_tokens": data_cfg.min_tokens}
    with atomic_file(meta_path) as f:
        f.write(json.dumps(meta, indent=2))


def _flush(texts: list[str], tokenizer, min_tokens: int, out, *, tally: Tally) -> None:
    """Tokenise ``texts``, append the documents of at least ``min_tokens`` tokens (each with
    its EOS) to ``out`` and count them in ``tally``."""
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    kept = [doc + [tokenizer.eos_token_id] for doc in ids if len(doc) >= min_tokens]
    if kept:
        np.concatenate([np.asarray(doc, dtype=np.int32) for doc in kept]).tofile(out)
    tally.documents += len(ids)
    tally.kept += len(kept)
    tally.blank += sum(1 for doc in ids if not doc)
    tally.short += sum(1 for doc in ids if 0 < len(doc) < min_tokens)
    tally.longest = max([tally.longest, *map(len, ids)])
    tally.tokens += sum(len(doc) for doc in kept)


def load_meta(dataset: PackedDataset) -> Optional[dict]:
    path = dataset.path.with_suffix(".json")
    return json.loads(path.read_text()) if path.exists() else None
