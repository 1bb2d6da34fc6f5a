"""A small byte-level BPE tokenizer for the tiny base, trained offline on the corpus's text.

The byte tokenizer of ``assets/tiny-base`` spends one token per character, so RULER's
shortest prompts (351-1,716 bytes before the answer's budget) cannot fit a 256-token context.
A BPE of 4,096 ids learned from the standard-library text the base is pretrained on packs 3.5
characters of held-out stdlib into a token (1.5-2.3 on RULER's variable names and word lists,
which it has not seen). Choices, and why:

- byte-level (GPT-2's pre-tokenizer and decoder): every text encodes, nothing is unknown, and
  ``decode(encode(text)) == text``, as the corpus's ``train.jsonl`` round trip needs;
- digits one per token: a passkey or a RULER value is the same tokens wherever it stands, so
  copying it is the same skill at every depth;
- only the training split (the modules ``is_validation`` holds out are unseen), so the held-out
  PPL is measured on text the tokenizer was not fitted to;
- ``<pad>`` = 0 and ``</s>`` = 1 as in the byte tokenizer, no BOS added.

Deterministic: the documents come in a fixed order and the saved files carry no date; a
retrain gives the same bytes (checked across runs and thread counts) from the same Python.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Iterator, Optional

from sparse_ft.config.paths import REPO_ROOT
from sparse_ft.data.stdlib_text import iter_stdlib_documents
from sparse_ft.experiment.corpus import is_validation

TOKENIZER_DIR = REPO_ROOT / "assets" / "tiny-bpe"
VOCAB_SIZE = 4096
SPECIAL_TOKENS = ("<pad>", "</s>")  # ids 0 and 1


def training_texts(modules: Optional[Iterable[str]] = None, val_percent: float = 5.0) -> Iterator[str]:
    """The corpus's training split: every stdlib module (``modules=None``) the validation split
    does not hold out, in a fixed order."""
    return (text for text in iter_stdlib_documents(modules) if not is_validation(text, val_percent))


def train_bpe(texts: Iterable[str], vocab_size: int = VOCAB_SIZE):
    """A ``PreTrainedTokenizerFast`` of ``vocab_size`` ids (specials and the 256 bytes
    included) learned from ``texts``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    minimum = len(SPECIAL_TOKENS) + 256
    if vocab_size < minimum:
        raise ValueError(f"vocab_size {vocab_size} must be >= {minimum} (the special tokens and the 256 bytes)")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                       pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(texts, trainer=trainer)
    pad, eos = SPECIAL_TOKENS
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token=pad, eos_token=eos,
                                   clean_up_tokenization_spaces=False)


def save(tokenizer, output: Path, writer: str) -> Path:
    """``tokenizer.json`` and its transformers config under ``output`` (``AutoTokenizer`` loads
    it), put in place whole (a folder ``writer`` or another sparse-ft command wrote is replaced,
    any other non-empty one refused)."""
    from sparse_ft.files.outputs import atomic_directory

    with atomic_directory(Path(output), writer, flag="--output") as tmp:
        tokenizer.save_pretrained(str(tmp))
    return Path(output)
