"""Chat and instruction rows packed into training samples (``data.format: chat | instruction``):
padding-free, and each row whole.

A row (a conversation) goes whole into one sample of ``seq_len`` tokens, in the source's order:
one that does not fit in what is left of the current sample starts the next, and the rest of the
current one is filler: one document of fill tokens (the pad id, else EOS) that is no target.
Cutting a row instead would train the second part's answers without their prompt. Rows longer
than ``seq_len`` are left out (trained whole or not at all; truncating would cut answers) and
counted in the build's line on stderr. Positions restart at 0 at every row and at the filler, so
each row attends to itself alone, with its own pattern, as padding-free text documents do
(``data.packing`` is for text; these rows are always packed so). A row's first token is no
target: nothing in its row precedes it.

The cache holds the int32 ids (as text's) and beside them ``<key>.flags``: one uint8 per token,
:data:`TARGET` (the loss trains on it) and :data:`START` (a row or the filler starts here),
so the labels travel with the tokens. :data:`CACHE_FORMAT` is part of the cache key and the
sidecar, which records the flags file's size and sha256 too: a cache written another way is never
found, and flags cut short or overwritten rebuild it as tokens do.
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import asdict, dataclass
from itertools import islice
from pathlib import Path
from typing import Any, BinaryIO, Optional

import numpy as np
import torch
from tqdm import tqdm

from sparse_ft.data.conversations import Renderer, iter_rendered, tokenize
from sparse_ft.data.token_files import sha256_file
from sparse_ft.files.outputs import atomic_file

TARGET, START = 1, 2
CACHE_FORMAT = 3
BATCH = 64


def flags_path(tokens_path: Path) -> Path:
    return tokens_path.with_suffix(".flags")


def template_key(data_cfg: Any, tokenizer: Any) -> list:
    """What the cache key adds for these rows: the format, the cache format, and the chat
    template's text (a changed template file builds a new cache)."""
    return [data_cfg.format, CACHE_FORMAT, Renderer(data_cfg, tokenizer).template]


def positions_from_starts(starts: torch.Tensor) -> torch.Tensor:
    """Positions counting from 0 at the sample's start and at every True of ``starts``."""
    index = torch.arange(len(starts))
    starts = starts.clone()
    starts[0] = True
    return index - torch.where(starts, index, 0).cummax(dim=0).values


class TurnBlocks(torch.utils.data.Dataset):
    """Samples of whole rows with their flags (samples, seq_len): labels are the tokens flagged
    :data:`TARGET`, -100 elsewhere, and positions restart at every :data:`START`. Every sample
    holds a row, so none is without a target (``skipped`` is 0)."""

    skipped = 0

    def __init__(self, samples: np.ndarray, flags: np.ndarray) -> None:
        self.samples, self.flags = samples, flags

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids = torch.from_numpy(np.array(self.samples[index], dtype=np.int64))
        flags = torch.from_numpy(np.array(self.flags[index], dtype=np.uint8))
        return {"input_ids": ids, "labels": ids.masked_fill(flags & TARGET == 0, -100),
                "position_ids": positions_from_starts(flags & START != 0)}

    def sha256(self) -> str:
        """The samples' content, labels included, which a checkpoint records."""
        digest = hashlib.sha256(np.ascontiguousarray(self.samples).data)
        digest.update(np.ascontiguousarray(self.flags).data)
        return digest.hexdigest()


class PackedTurns(TurnBlocks):
    """The samples read from the cache by memory map."""

    def __init__(self, path: Path, seq_len: int) -> None:
        tokens = np.memmap(path, dtype=np.int32, mode="r")
        flags = np.memmap(flags_path(path), dtype=np.uint8, mode="r")
        super().__init__(tokens.reshape(-1, seq_len), flags.reshape(-1, seq_len))
        self.path, self.seq_len = path, seq_len

    def sha256(self) -> str:
        """Both files' sha256, computed when the cache was built and checked when it loaded."""
        meta = json.loads(self.path.with_suffix(".json").read_text())
        return hashlib.sha256(f"{meta['sha256']} {meta['flags_sha256']}".encode()).hexdigest()


@dataclass
class TurnTally:
    """What a build read and kept: rows, those kept, those shorter than ``data.min_tokens`` or
    longer than ``seq_len`` (left out), the longest's tokens, the rows' tokens kept, the answer
    tokens among them, and the filler tokens written."""

    rows: int = 0
    kept: int = 0
    short: int = 0
    long: int = 0
    longest: int = 0
    row_tokens: int = 0
    targets: int = 0
    filler: int = 0

    def report(self, data_cfg: Any, seq_len: int) -> str:
        """The build's one line."""
        left = [f"{self.long} longer than data.seq_len={seq_len} tokens (a row is trained whole or not at all)"] if self.long else []
        if self.short:
            left.append(f"{self.short} shorter than data.min_tokens={data_cfg.min_tokens} tokens")
        return (f"data.source {data_cfg.source}: of {self.rows} {data_cfg.format} rows, kept {self.kept} ({self.row_tokens} "
                f"tokens, {self.targets} of them answer tokens, the loss's targets), packed whole into "
                f"{(self.row_tokens + self.filler) // seq_len} samples with {self.filler} filler tokens"
                + (f"; left out {', '.join(left)}" if left else ""))


class Packer:
    """Writes rows whole into samples of ``seq_len`` tokens, filling a sample's end that the next
    row does not fit in (see the module docstring)."""

    def __init__(self, seq_len: int, fill: int, *, tokens: BinaryIO, flags: BinaryIO, tally: TurnTally) -> None:
        self.seq_len, self.fill, self.tokens, self.flags, self.tally = seq_len, fill, tokens, flags, tally
        self.used = 0

    def add(self, ids: list[int], mask: list[bool]) -> None:
        if self.used + len(ids) > self.seq_len:
            self.close_sample()
        flags = np.where(mask, TARGET, 0).astype(np.uint8)
        flags[0] = START  # a row's first token is no target
        self._write(np.asarray(ids, dtype=np.int32), flags)
        self.tally.kept += 1
        self.tally.row_tokens += len(ids)
        self.tally.targets += int((flags & TARGET).sum())
        self.used = (self.used + len(ids)) % self.seq_len

    def close_sample(self) -> None:
        """Fill what is left of the current sample (nothing when it is full or none is open)."""
        if self.used:
            rest = self.seq_len - self.used
            flags = np.zeros(rest, dtype=np.uint8)
            flags[0] = START
            self._write(np.full(rest, self.fill, dtype=np.int32), flags)
            self.tally.filler += rest
            self.used = 0

    def _write(self, ids: np.ndarray, flags: np.ndarray) -> None:
        ids.tofile(self.tokens)
        flags.tofile(self.flags)


def write_turn_cache(data_cfg: Any, tokenizer: Any, seq_len: int, tokens_path: Path, *, meta_path: Path,
                     trust_remote_code: bool) -> None:
    """Render, tokenise and pack the rows into the tokens file, its flags and the sidecar, each
    written atomically (the sidecar last: a cache without one is no cache)."""
    tokens_path.parent.mkdir(parents=True, exist_ok=True)
    tally = TurnTally()
    rows = iter_rendered(data_cfg, tokenizer, trust_remote_code=trust_remote_code, limit=data_cfg.max_documents)
    fill = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    bar = tqdm(desc=f"tokenize {data_cfg.source}", unit="row")
    with atomic_file(tokens_path, "wb") as tokens, atomic_file(flags_path(tokens_path), "wb") as flags:
        packer = Packer(seq_len, fill, tokens=tokens, flags=flags, tally=tally)
        while batch := list(islice(rows, BATCH)):
            for ids, mask in tokenize(batch, tokenizer):
                tally.rows += 1
                tally.longest = max(tally.longest, len(ids))
                if len(ids) > seq_len:
                    tally.long += 1
                elif len(ids) < data_cfg.min_tokens:
                    tally.short += 1
                else:
                    packer.add(ids, mask)
            bar.update(len(batch))
        packer.close_sample()
        bar.close()
        print(tally.report(data_cfg, seq_len), file=sys.stderr, flush=True)
        if not tally.kept:
            raise ValueError(f"data.source {data_cfg.source}: none of its {tally.rows} rows fits in data.seq_len={seq_len} "
                             f"tokens with >= data.min_tokens={data_cfg.min_tokens} (longest: {tally.longest} tokens)")
        tokens.flush()
        flags.flush()
        written, written_flags = Path(tokens.name), Path(flags.name)
        samples = (tally.row_tokens + tally.filler) // seq_len
        meta = {**asdict(tally), "format": data_cfg.format, "cache_format": CACHE_FORMAT, "tokens": samples * seq_len,
                "bytes": written.stat().st_size, "sha256": sha256_file(written), "flags_sha256": sha256_file(written_flags),
                "samples": samples, "seq_len": seq_len, "source": data_cfg.source, "min_tokens": data_cfg.min_tokens}
    with atomic_file(meta_path) as f:
        f.write(json.dumps(meta, indent=2))


def flags_problem(tokens_path: Path, meta: dict) -> Optional[str]:
    """Why a cache's flags file differs from what its sidecar recorded, or None."""
    path = flags_path(tokens_path)
    if not path.exists():
        return "its flags file is missing"
    if path.stat().st_size != meta["tokens"]:
        return f"its flags file holds {path.stat().st_size} bytes, not one per token ({meta['tokens']})"
    if sha256_file(path) != meta["flags_sha256"]:
        return "its flags file's sha256 differs from the one recorded (the file was overwritten)"
    return None
