"""Passkey retrieval: the landmark-attention prompt (``sparse_ft.data.passkey_prompt``) with a
5-digit key hidden at a chosen depth of filler text, recalled by greedy decoding with the KV
cache, exact match."""

from __future__ import annotations

import random
import re
import time

import torch
from tqdm import tqdm

from sparse_ft import console
from sparse_ft.data.passkey_prompt import build_prompt, token_ids
from sparse_ft.methods import Method


def retrieved(text: str, key: str) -> bool:
    """Exact match: the first number the model writes is the key (a longer number, or one with
    a wrong digit, is a miss)."""
    found = re.search(r"\d+", text)
    return found is not None and found.group() == key


def keys(trials: int, seed: int) -> list[str]:
    """The ``trials`` 5-digit keys of ``seed``: every cell asks the same ones."""
    if trials < 1:  # a cell of no trials has no accuracy
        raise ValueError(f"passkey: trials={trials} must be >= 1")
    rng = random.Random(seed)
    return [str(rng.randint(10000, 99999)) for _ in range(trials)]


def evaluate(model, tokenizer, lengths: list[int], depths: list[float], *, trials: int, method: Method,
             seed: int = 0) -> list[dict]:
    """One cell per (length, depth); every cell uses the same ``trials`` seeded keys, so cells
    differ only in length and depth."""
    asked = keys(trials, seed)
    cells = []
    bar = tqdm(total=len(lengths) * len(depths) * trials, desc=console.bar_label("passkey"), unit="trial")
    for length in lengths:
        method.apply(model, length)
        for depth in depths:
            began, outputs, hits, tokens = time.perf_counter(), [], 0, 0
            for key in asked:
                prompt = build_prompt(tokenizer, length, depth, key)
                tokens = len(prompt.ids)
                budget = len(token_ids(tokenizer, " " + key)) + 3
                with torch.inference_mode():
                    new = method.generate(model, tokenizer, context_ids=prompt.context_ids, question_ids=prompt.question_ids,
                                          max_new_tokens=budget)
                outputs.append(tokenizer.decode(new, skip_special_tokens=True))
                hits += retrieved(outputs[-1], key)
                bar.update()
            cells.append({"length": length, "depth": depth, "accuracy": hits / trials, "trials": trials,
                          "prompt_tokens": tokens, "seconds": time.perf_counter() - began,
                          "keys": asked, "outputs": outputs})
    bar.close()
    return cells
