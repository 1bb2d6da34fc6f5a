"""The tiny base model's corpus, built on the user's machine: the standard library's modules
(code, docstrings, comments) mixed with synthetic passkey documents.

Deterministic by construction (sorted files, seeded RNG, a hash split), so the same Python
gives the same bytes everywhere and the committed checkpoint can be re-derived. Outputs:

- ``train.bin``: uint16 tokens in blocks of ``context``; a passkey block starts with a whole
  passkey document (so the needle, question and answer share one window), then EOS and text.
- ``val.bin`` (+ ``val.json``): held-out modules only, joined by EOS, in the evaluator's flat
  token format (``sparse-ft eval ppl --data val.bin``).
- ``corpus.json``: what went in, counts and checksums.
- ``train.jsonl`` (optional, :func:`write_jsonl`): the same blocks as documents of
  ``context - 1`` tokens for ``train.py``, whose packing appends EOS, so its samples of
  ``context`` tokens are exactly these blocks and no passkey document is cut.
"""

from __future__ import annotations

import hashlib
import json
import platform
import random
from pathlib import Path
from collections import Counter
from typing import Iterable, Optional, Sequence

import numpy as np
from tqdm import tqdm

from sparse_ft.experiment import retrieval_docs
from sparse_ft.experiment.passkey_docs import passkey_document
from sparse_ft.data.stdlib_text import iter_stdlib_documents
from sparse_ft.data.token_files import TOKEN_DTYPES, dtype_for, sha256_file, write_token_file, write_tokens
from sparse_ft.files.outputs import atomic_file


# Half the blocks: with 30 % the committed base formed no copy (induction) heads in 900 steps
# and never retrieved; with half, 5000 steps retrieve every key inside the window.
RETRIEVAL_FRACTION = 0.5


def is_validation(text: str, val_percent: float) -> bool:
    """Split by content hash: stable under reordering and across machines."""
    return int(hashlib.sha256(text.encode("utf-8")).hexdigest()[:8], 16) % 10000 < val_percent * 100


def fits_one(*shares: float) -> bool:
    """Whether block shares sum to at most 1, up to float rounding: 0.3 + 0.6 + 0.1 is
    1.0000000000000002, and 1 - 0.3 - 0.6 is below 0.1, yet a user who writes them means 1."""
    return sum(shares) <= 1.0 + 1e-9


def build_corpus(output_dir: Path, tokenizer, context: int = 256, retrieval_fraction: float = RETRIEVAL_FRACTION,
                 *, val_percent: float = 5.0, seed: int = 0, modules: Optional[Iterable[str]] = None,
                 max_blocks: Optional[int] = None, retrieval_tasks: Sequence[str] = ("passkey",),
                 text_passes: int = 1, copy_fraction: float = 0.0, full_fraction: float = 0.0,
                 lookup_fraction: float = 0.0, copy_pieces: float = 0.0,
                 copy_names: float = retrieval_docs.COPY_NAMES, keys: str = "frequent") -> dict:
    """Write train.bin, val.bin and corpus.json under ``output_dir``; return the manifest.

    ``modules=None`` takes every top-level module of the standard library; ``max_blocks``
    stops early (the validation split is unchanged). ``retrieval_fraction`` of the blocks open
    with a retrieval document, of a kind drawn uniformly from ``retrieval_tasks``: ``passkey``
    and RULER's task names (:mod:`sparse_ft.experiment.retrieval_docs`); passkeys alone by
    default, which draws exactly what this corpus drew before RULER's kinds existed.
    ``text_passes``: lay the text out that many times, each pass with fresh documents (more
    distinct retrieval documents than one pass of the text holds). ``copy_fraction`` of the
    blocks open with a copy document instead (:func:`retrieval_docs.copy_document`: the
    signal that forms copy heads); 0 draws exactly what this corpus drew before it existed.
    ``copy_pieces`` of the copy documents repeat a span of ids drawn from every id of the
    training text and of names of capital letters instead of words and numbers (the signal
    that makes copying generic); 0 draws what was drawn before. ``copy_names``: the share of
    such a span's items that are names (0: ids alone; the default draws what was drawn before
    the share existed).
    ``keys``: the needles' keys of every document (:func:`retrieval_docs.training_words`:
    ``frequent``, what was drawn before the choice existed, or ``rare``, as many BPE pieces a key
    as the evaluation's).
    ``lookup_fraction`` of the blocks open with a lookup document (:class:`retrieval_docs.Lookup`:
    needles, then every key asked and answered, the signal that teaches matching a key); drawn
    just above the retrieval documents, so 0 draws what was drawn before it existed.
    ``full_fraction`` of the retrieval, lookup and copy documents fill their block: a length drawn
    uniformly rarely puts a needle ~``context`` tokens before its question, the distance a
    prompt at the full context asks for at depth 0 (a base trained without them retrieved at
    depths 0.5 and 1 and missed depth 0 by a few digits); 0 draws what was drawn before.
    """
    if not 0.0 <= retrieval_fraction <= 1.0:
        raise ValueError(f"retrieval_fraction={retrieval_fraction} must be within [0, 1]")
    if not (0.0 <= lookup_fraction and fits_one(retrieval_fraction, lookup_fraction)):
        raise ValueError(f"lookup_fraction={lookup_fraction} must be within [0, 1 - retrieval_fraction={retrieval_fraction}]")
    if not (0.0 <= copy_fraction and fits_one(retrieval_fraction, lookup_fraction, copy_fraction)):
        raise ValueError(f"copy_fraction={copy_fraction} must be within [0, 1 - retrieval_fraction={retrieval_fraction}"
                         + (f" - lookup_fraction={lookup_fraction}]" if lookup_fraction else "]"))
    if not 0.0 <= full_fraction <= 1.0:
        raise ValueError(f"full_fraction={full_fraction} must be within [0, 1]")
    if not 0.0 <= copy_pieces <= 1.0:
        raise ValueError(f"copy_pieces={copy_pieces} must be within [0, 1]")
    if not 0.0 <= copy_names <= 1.0:
        raise ValueError(f"copy_names={copy_names} must be within [0, 1]")
    if keys not in retrieval_docs.KEY_RANKS:
        raise ValueError(f"keys={keys!r}: one of {', '.join(retrieval_docs.KEY_RANKS)}")
    kinds = list(dict.fromkeys(retrieval_tasks))
    if not kinds:
        raise ValueError("retrieval_tasks is empty; name passkey and/or RULER tasks")
    if not isinstance(text_passes, int) or text_passes < 1:
        raise ValueError(f"text_passes={text_passes!r} must be an integer >= 1")
    if not 0.0 < val_percent < 100.0:
        raise ValueError(f"val_percent={val_percent} must be within (0, 100)")
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("the tokenizer has no eos_token_id; documents are separated by EOS")
    train: list[int] = []
    val: list[int] = []
    texts: list[str] = []  # the training split, for RULER's documents: their word lists and essay haystacks
    files = {"train": 0, "validation": 0}
    for text in tqdm(list(iter_stdlib_documents(modules)), desc="tokenize stdlib", unit="module"):
        split = "validation" if is_validation(text, val_percent) else "train"
        files[split] += 1
        (val if split == "validation" else train).extend(tokenizer(text, add_special_tokens=False)["input_ids"] + [eos])
        if split == "train" and (kinds != ["passkey"] or copy_fraction or lookup_fraction):
            texts.append(text)
    if not val or not train:
        raise ValueError(f"val_percent={val_percent} leaves {files} modules per split; both need at least one")

    others = [k for k in kinds if k != "passkey"]
    words = retrieval_docs.training_words(texts, keys=keys) if others or copy_fraction or lookup_fraction else None
    tasks = retrieval_docs.ruler_tasks(others, tokenizer, words) if others else {}
    if lookup_fraction:
        tasks["lookup"] = lookup = retrieval_docs.Lookup()
        lookup.word_lists = words
    essay = [word for text in texts for word in text.split()]
    pieces = sorted(set(train) - {eos}) if copy_pieces else []
    rng = random.Random(seed)
    blocks: list[list[int]] = []
    opened: Counter[str] = Counter()  # the blocks each kind of document opens
    pos, passes, filled = 0, 1, 0
    while max_blocks is None or len(blocks) < max_blocks:
        block, kind = [], None
        draw = rng.random()
        looks = retrieval_fraction <= draw < retrieval_fraction + lookup_fraction
        opens = draw < retrieval_fraction or looks or draw >= 1.0 - copy_fraction  # a document, not text alone
        full = full_fraction > 0 and opens and rng.random() < full_fraction  # no draw at 0: the corpus of before
        if draw >= 1.0 - copy_fraction:  # the top of the draw: with copy_fraction 0, the draws of before
            kind = "copy"
            drawn = pieces if copy_pieces and rng.random() < copy_pieces else ()  # no draw at 0: the corpus of before
            kind = "copy_pieces" if drawn else kind
            block = retrieval_docs.copy_document(tokenizer, context - 1, rng, words=words.single, essay=essay, full=full,
                                                 pieces=drawn, names=copy_names) + [eos]
        elif draw < retrieval_fraction or looks:
            kind = "lookup" if looks else kinds[0] if len(kinds) == 1 else rng.choice(kinds)
            if kind == "passkey":
                block = passkey_document(tokenizer, context - 1, rng, full=full)[0] + [eos]
            else:
                start = rng.randrange(max(1, len(essay) - 4 * context))
                block = retrieval_docs.retrieval_document(tasks[kind], tokenizer, context - 1, rng,
                                                          seed=f"pretrain:{seed}:{len(blocks)}",
                                                          essay=essay[start : start + 4 * context], full=full) + [eos]
        take = context - len(block)
        if pos + take > len(train):
            if passes == text_passes:
                break
            passes, pos = passes + 1, 0  # the text again, with fresh documents
        blocks.append(block + train[pos : pos + take])
        opened[kind or "text"] += 1
        filled += full
        pos += take

    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    vocab = len(tokenizer)
    dtype = dtype_for(vocab)
    train_path = write_tokens(blocks, output_dir / "train.bin", dtype)
    val_path = write_token_file(np.asarray(val), output_dir / "val.bin", vocab, type(tokenizer).__name__)
    manifest = {
        "python": platform.python_version(),
        "modules": "all top-level stdlib modules" if modules is None else list(modules),
        "files": files, "context": context, "max_blocks": max_blocks, "dtype": dtype, "seed": seed,
        "retrieval_fraction": retrieval_fraction, "retrieval_tasks": kinds, "text_passes": text_passes,
        "copy_fraction": copy_fraction, "copy_blocks": opened["copy"] + opened["copy_pieces"], "copy_pieces": copy_pieces,
        "copy_pieces_blocks": opened["copy_pieces"], "copy_names": copy_names, "keys": keys, "lookup_fraction": lookup_fraction,
        "lookup_blocks": opened["lookup"], "full_fraction": full_fraction, "full_documents": filled,
        "val_percent": val_percent,
        "tokenizer": type(tokenizer).__name__, "vocab_size": vocab,
        "train_blocks": len(blocks), "passkey_blocks": opened["passkey"],
        "retrieval_blocks": {k: opened[k] for k in kinds}, "train_tokens": len(blocks) * context,
        "text_tokens_used": pos, "val_tokens": len(val),
        "sha256": {"train.bin": sha256_file(train_path), "val.bin": sha256_file(val_path)},
    }
    (output_dir / "corpus.json").write_text(json.dumps(manifest, indent=1))
    return manifest


def load_blocks(output_dir: Path) -> np.ndarray:
    """train.bin as a (blocks, context) memory map; a corpus whose manifest or train.bin does
    not fit fails naming the file."""
    manifest_path, train_path = Path(output_dir) / "corpus.json", Path(output_dir) / "train.bin"
    try:
        manifest = json.loads(manifest_path.read_text())
        dtype, context = TOKEN_DTYPES[manifest["dtype"]], int(manifest["context"])
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{manifest_path} is not a corpus manifest of scripts/build_corpus.py ({type(err).__name__}: {err})") from None
    size = train_path.stat().st_size if train_path.is_file() else 0
    if size == 0 or size % (np.dtype(dtype).itemsize * context):
        raise ValueError(f"{train_path} holds {size} bytes, not whole blocks of {context} {manifest['dtype']} tokens "
                         "(none, or cut short): build the corpus again")
    return np.memmap(train_path, dtype=dtype, mode="r").reshape(-1, context)


def write_jsonl(output_dir: Path, tokenizer, max_blocks: Optional[int] = None) -> Path:
    """train.bin's blocks as ``{"text"}`` documents of ``context - 1`` tokens (``train.jsonl``).

    The EOS between a passkey document and the text after it becomes a newline; a block whose
    text does not re-tokenise to the same length (a byte sequence cut inside a character) is
    left out rather than allowed to shift every later sample.
    """
    output_dir = Path(output_dir)
    blocks = load_blocks(output_dir)[:max_blocks]
    (newline,) = tokenizer("\n", add_special_tokens=False)["input_ids"]
    path, kept = output_dir / "train.jsonl", 0
    with atomic_file(path) as out:
        for block in tqdm(blocks, desc="write train.jsonl", unit="block"):
            ids = [newline if t == tokenizer.eos_token_id else int(t) for t in block[:-1]]
            text = tokenizer.decode(ids)
            if len(tokenizer(text, add_special_tokens=False)["input_ids"]) == len(ids):
                out.write(json.dumps({"text": text}) + "\n")
                kept += 1
    if kept == 0:
        raise ValueError(f"no block of {output_dir / 'train.bin'} survives decoding; is it from this tokenizer?")
    return path
