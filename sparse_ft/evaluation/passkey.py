"""Passkey retrieval: the landmark-attention prompt (``sparse_ft.data.passkey_prompt``) with a
5-digit key hidden at a chosen depth of filler text, recalled by greedy decoding with the KV
cache, exact match."""

from __future__ import annotations

import random
import re
import time

import torch
from tqdm import tqdm

from sparse_ft.data.passkey_prompt import build_prompt, token_ids
from sparse_ft.methods import Method


def retrieved(text: str, key: str) -> bool:
    """Exact match: the first number the model writes is the key (a longer number, or one with
    a wrong digit, is a miss)."""
    found = re.search(r"\d+", text)
    return found is not None and found.group() == key


def evaluate(model, tokenizer, lengths: list[int], depths: list[float], *, trials: int, method: Method,
             seed: int = 0) -> list[dict]:
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
                budget = len(token_ids(tokenizer, " " + key)) + 3
                with torch.inference_mode():
                    new = method.generate(model, tokenizer, context_ids=prompt.context_ids, question_ids=prompt.question_ids,
                                          max_new_tokens=budget)
                outputs.append(tokenizer.decode(new, skip_special_tokens=True))
                hits += retrieved(outputs[-1], key)
                bar.update()
            cells.append({"length": length, "depth": depth, "accuracy": hits / trials, "trials": trials,
                          "prompt_tokens": len(prompt.ids), "seconds": time.perf_counter() - began,
                          "keys": keys, "outputs": outputs})
    bar.close()
    return cells
