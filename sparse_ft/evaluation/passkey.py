"""Passkey retrieval (the landmark-attention prompt): a 5-digit key hidden at a chosen depth
of filler text, recalled by greedy decoding with the KV cache, exact match.

The prompt is landmark-attention's (``run_test.py``, also LongLoRA's ``passkey_retrivial.py``):
task, filler, needle, filler, question, joined by newlines. Unlike theirs, the filler is cut
in tokens of the model's tokenizer, so the prompt has exactly the requested length and the
needle sits after exactly ``round(depth * filler_tokens)`` filler tokens; both fillers start
at the beginning of the repeated filler text, as landmark's do.
"""

from __future__ import annotations

import random
import re
import time
from dataclasses import dataclass

import torch
from tqdm import tqdm

from sparse_ft.methods import Method

TASK = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. "
        "I will quiz you about the important information there.")
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
QUESTION = "What is the pass key? The pass key is"


def needle(key: str) -> str:
    return f"The pass key is {key}. Remember it. {key} is the pass key."


@dataclass
class Prompt:
    """Context and question kept apart: ParallelComp ranks context chunks by the question."""

    context_ids: list[int]  # (BOS,) task, filler, needle, filler
    question_ids: list[int]
    key: str
    needle_token: int  # index in ``ids`` of the needle line (its leading newline)
    filler_tokens: int  # filler tokens in the whole prompt; the needle follows round(depth * this)

    @property
    def ids(self) -> list[int]:
        return self.context_ids + self.question_ids


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _leading_specials(tokenizer) -> list[int]:
    """The BOS (or similar) the tokenizer puts in front of a text, if it does; never the EOS
    some tokenizers append, which would end the prompt."""
    plain = _ids(tokenizer, "a")
    full = tokenizer("a")["input_ids"]
    for start in range(len(full) - len(plain) + 1):
        if full[start : start + len(plain)] == plain:
            return list(full[:start])
    return []


def _filler(tokenizer, count: int) -> list[int]:
    """The first ``count`` tokens of the filler sentence repeated (space-joined)."""
    per = max(1, len(_ids(tokenizer, FILLER + " ")))
    repeats = count // per + 2
    ids = _ids(tokenizer, " ".join([FILLER] * repeats))
    return ids[:count]


def build_prompt(tokenizer, length: int, depth: float, key: str) -> Prompt:
    """A prompt of exactly ``length`` tokens with the needle after ``depth`` (0..1) of the filler."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"needle depth={depth} must be within [0, 1]")
    head = _leading_specials(tokenizer) + _ids(tokenizer, TASK + "\n")
    hidden = _ids(tokenizer, "\n" + needle(key) + "\n")
    question = _ids(tokenizer, "\n" + QUESTION)
    room = length - len(head) - len(hidden) - len(question)
    if room < 0:
        raise ValueError(f"passkey length={length} is shorter than the prompt without filler ({length - room} tokens)")
    before = round(depth * room)
    context = head + _filler(tokenizer, before)
    position = len(context)
    context += hidden + _filler(tokenizer, room - before)
    return Prompt(context, question, key, position, room)


def retrieved(text: str, key: str) -> bool:
    """Exact match: the first number the model writes is the key (a longer number, or one with
    a wrong digit, is a miss)."""
    found = re.search(r"\d+", text)
    return found is not None and found.group() == key


def evaluate(model, tokenizer, lengths: list[int], depths: list[float], trials: int, method: Method, seed: int = 0) -> list[dict]:
    """One cell per (length, depth); every cell uses the same ``trials`` seeded keys, so cells
    differ only in length and depth."""
    rng = random.Random(seed)
    keys = [str(rng.randint(10000, 99999)) for _ in range(trials)]
    cells = []
    bar = tqdm(total=len(lengths) * len(depths) * trials, desc="passkey", unit="trial")
    for length in lengths:
        method.apply(model, length)
        for depth in depths:
            began, outputs, hits = time.perf_counter(), [], 0
            for key in keys:
                prompt = build_prompt(tokenizer, length, depth, key)
                budget = len(_ids(tokenizer, " " + key)) + 3
                with torch.inference_mode():
                    new = method.generate(model, tokenizer, prompt.context_ids, prompt.question_ids, budget)
                outputs.append(tokenizer.decode(new, skip_special_tokens=True))
                hits += retrieved(outputs[-1], key)
                bar.update()
            cells.append({"length": length, "depth": depth, "accuracy": hits / trials, "trials": trials,
                          "prompt_tokens": len(prompt.ids), "seconds": time.perf_counter() - began,
                          "keys": keys, "outputs": outputs})
    bar.close()
    return cells
