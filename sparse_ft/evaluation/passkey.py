"""Passkey retrieval (the landmark-attention prompt): a 5-digit key hidden at a chosen depth
of filler text, recalled by greedy decoding with the KV cache, exact match."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

import torch
from tqdm import tqdm

from sparse_ft.evaluation.methods import Method

TASK = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. "
        "I will quiz you about the important information there.")
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
QUESTION = "What is the pass key? The pass key is"


def needle(key: str) -> str:
    return f"The pass key is {key}. Remember it. {key} is the pass key."


@dataclass
class Prompt:
    context_ids: list[int]  # task, filler and needle: what a method may compress
    question_ids: list[int]
    key: str
    needle_token: int  # where the needle starts, in tokens from the start

    @property
    def ids(self) -> list[int]:
        return self.context_ids + self.question_ids


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def build_prompt(tokenizer, length: int, depth: float, key: str) -> Prompt:
    """A prompt of about ``length`` tokens with the needle after ``depth`` (0..1) of the filler."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"needle depth={depth} must be within [0, 1]")
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None and getattr(tokenizer, "add_bos_token", False) else []
    head = bos + _ids(tokenizer, TASK)
    filler = _ids(tokenizer, " " + FILLER)
    hidden = _ids(tokenizer, " " + needle(key))
    question = _ids(tokenizer, " " + QUESTION)
    room = length - len(head) - len(hidden) - len(question)
    if room < 0:
        raise ValueError(f"passkey length={length} is shorter than the prompt without filler ({length - room} tokens)")
    repeats = room // len(filler)
    before = round(depth * repeats)
    context = head + filler * before
    position = len(context)
    context += hidden + filler * (repeats - before)
    return Prompt(context, question, key, position)


def default_generate(model, tokenizer, context_ids: list[int], question_ids: list[int], max_new_tokens: int) -> list[int]:
    device = next(model.parameters()).device
    ids = torch.tensor([context_ids + question_ids], device=device)
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         do_sample=False, use_cache=True, pad_token_id=tokenizer.pad_token_id)
    return out[0, ids.shape[1]:].tolist()


def retrieved(text: str, key: str) -> bool:
    """Exact match: the first five digits the model writes are the key."""
    digits = "".join(ch for ch in text if ch.isdigit())
    return digits[: len(key)] == key


def evaluate(model, tokenizer, lengths: list[int], depths: list[float], trials: int, method: Method, seed: int = 0) -> list[dict]:
    generate = method.generate or default_generate
    rng = random.Random(seed)
    cells = []
    bar = tqdm(total=len(lengths) * len(depths) * trials, desc="passkey", unit="trial")
    for length in lengths:
        method.apply(model, length)
        for depth in depths:
            hits, began, sizes = 0, time.perf_counter(), []
            for _ in range(trials):
                key = str(rng.randint(10000, 99999))
                prompt = build_prompt(tokenizer, length, depth, key)
                sizes.append(len(prompt.ids))
                budget = len(_ids(tokenizer, " " + key)) + 2
                with torch.inference_mode():
                    new = generate(model, tokenizer, prompt.context_ids, prompt.question_ids, budget)
                hits += retrieved(tokenizer.decode(new, skip_special_tokens=True), key)
                bar.update()
            cells.append({"length": length, "depth": depth, "accuracy": hits / trials, "trials": trials,
                          "prompt_tokens": max(sizes), "seconds": time.perf_counter() - began})
    bar.close()
    return cells
