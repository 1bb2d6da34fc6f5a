"""A prompt tokenised in pieces: every task that builds a prompt from parts (passkey, RULER's
tasks, ``generate``, the harness's requests) tokenises each part alone and joins the ids, so a
part's tokens do not depend on its neighbours and the BOS is added once, in front."""

from __future__ import annotations

from typing import Any


def token_ids(tokenizer: Any, text: str) -> list[int]:
    """The text's ids alone: no BOS or EOS, so pieces join into one prompt."""
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def leading_specials(tokenizer: Any) -> list[int]:
    """The BOS (or similar) the tokenizer puts in front of a text, if it does; never the EOS
    some tokenizers append, which would end the prompt."""
    plain = token_ids(tokenizer, "a")
    full = tokenizer("a")["input_ids"]
    for start in range(len(full) - len(plain) + 1):
        if full[start : start + len(plain)] == plain:
            return list(full[:start])
    return []
