"""Synthetic passkey documents for training: the evaluator's own prompt
(``sparse_ft.evaluation.passkey_prompt.build_prompt``) followed by its answer, sized to a window.

A model can only be asked to retrieve a passkey past its pretraining length if it retrieves
one inside it. At byte level the prompt's task header nearly fills a 256-token window, so
half of the documents drop the header, which leaves room for filler between needle and
question; lengths and needle depths are drawn uniformly from what fits.
"""

from __future__ import annotations

import random

from sparse_ft.evaluation.passkey_prompt import TASK, build_prompt
from sparse_ft.evaluation.prompt_tokens import token_ids


def answer_ids(tokenizer, key: str) -> list[int]:
    return token_ids(tokenizer, f" {key}.")


def passkey_document(tokenizer, max_tokens: int, rng: random.Random, *, full: bool = False) -> tuple[list[int], str]:
    """Token ids of one document of at most ``max_tokens`` tokens (prompt + answer; as long as
    the answer leaves room for when ``full``), and its key."""
    key = str(rng.randint(10000, 99999))
    answer = answer_ids(tokenizer, key)
    head = len(token_ids(tokenizer, TASK + "\n"))
    probe = build_prompt(tokenizer, 1024, 0.0, key)
    minimum = len(probe.ids) - probe.filler_tokens  # task, needle and question without filler
    keep_head = minimum + len(answer) <= max_tokens and rng.random() < 0.5
    if not keep_head:
        minimum -= head
    if minimum + len(answer) > max_tokens:
        raise ValueError(f"max_tokens={max_tokens} is too small for a passkey document "
                         f"(needs {minimum + len(answer)} tokens without filler)")
    length = max_tokens - len(answer) if full else rng.randint(minimum, max_tokens - len(answer))
    prompt = build_prompt(tokenizer, length + (0 if keep_head else head), rng.random(), key)
    ids = prompt.ids if keep_head else prompt.ids[head:]
    return ids + answer, key
