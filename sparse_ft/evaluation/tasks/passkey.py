"""``passkey``: a 5-digit key hidden at chosen depths of filler text, over lengths x depths,
recalled by greedy decoding with the KV cache through the generation tasks' one loop, exact
match. The prompt is landmark attention's (``sparse_ft.evaluation.passkey_prompt``)."""

from __future__ import annotations

import argparse
import random
import re
import time
from pathlib import Path
from typing import Any, Sequence

from sparse_ft.evaluation.names import FLAGS, BadParameter, Names
from sparse_ft.evaluation.tasks.base import check_memory, check_number, lengths_flag, register
from sparse_ft.evaluation.tasks.generation import GenerationTask


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


@register
class Passkey(GenerationTask):
    """Its prompts are built to an exact length (not fitted from a haystack size), so it is no
    RULER task: it has its own flags and rows, one per (length, depth)."""

    ruler_task = False
    name = "passkey"
    summary = "passkey retrieval over lengths x needle depths"
    description = "passkey retrieval over lengths x needle depths (landmark attention's prompt)"
    picture = "heatmap"

    def __init__(self, lengths: list[int], depths: list[float], *, trials: int = 5, seed: int = 0) -> None:
        self.lengths, self.depths, self.trials, self.seed = lengths, depths, trials, seed

    @classmethod
    def configure(cls, p: argparse.ArgumentParser) -> None:
        p.add_argument("--lengths", default="1024,2048,4096,8192", help="prompt lengths in the model's tokens (comma list)")
        p.add_argument("--depths", default="0,0.25,0.5,0.75,1", help="needle depths in [0, 1] (comma list)")
        p.add_argument("--trials", type=int, default=5, help="random keys per cell, the same keys in every cell")
        p.add_argument("--seed", type=int, default=0, help="seed of the keys")
        p.add_argument("--heatmap", type=Path, default=None, help="accuracy heatmap PNG (default: none)")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "Passkey":
        try:
            depths = [float(x) for x in args.depths.split(",") if x]
        except ValueError:
            raise ValueError(f"--depths {args.depths!r} must be a comma-separated list of numbers in [0, 1]") from None
        task = cls(lengths_flag(args.lengths), depths, trials=args.trials, seed=args.seed)
        task.check(FLAGS)
        return task

    def check(self, names: Names) -> None:
        """Depths in [0, 1], at least one trial, and prompts that fit in memory (one is built
        at a time); the shortest prompt needs the tokenizer (:meth:`prepare`)."""
        super().check(names)
        if not isinstance(self.depths, list) or not self.depths:
            raise BadParameter(f"{names.say('depths', self.depths)} must list needle depths in [0, 1]")
        for depth in self.depths:
            if isinstance(depth, bool) or not isinstance(depth, (int, float)) or not 0 <= depth <= 1:
                raise BadParameter(f"{names.entry('depths', depth)} must be a number in [0, 1]")
        check_number(names, "trials", self.trials)
        check_number(names, "seed", self.seed, least=float("-inf"))
        check_memory(self.lengths, names, kept=0)

    def prepare(self, tokenizer: Any) -> None:
        """Every length holds the prompt without filler (task, needle, question)."""
        from sparse_ft.evaluation.passkey_prompt import shortest_prompt

        shortest = shortest_prompt(tokenizer, keys(self.trials, self.seed))
        for length in self.lengths:
            if length < shortest:
                raise BadParameter(f"{self.names.entry('lengths', length)} is shorter than the passkey prompt without "
                                   f"filler: {shortest} tokens of this tokenizer")

    def score(self, prediction: str, answers: Sequence[str]) -> float:
        return float(retrieved(prediction, answers[0]))

    def budget(self, tokenizer: Any, prompt: Any) -> int:
        """The key's tokens and three more."""
        from sparse_ft.evaluation.prompt_tokens import token_ids

        return len(token_ids(tokenizer, " " + prompt.key)) + 3

    def evaluate(self, model: Any, tokenizer: Any, method: Any) -> list[dict]:
        """One cell per (length, depth); every cell uses the same ``trials`` seeded keys, so cells
        differ only in length and depth."""
        from tqdm import tqdm

        from sparse_ft import console
        from sparse_ft.evaluation.passkey_prompt import build_prompt

        asked = keys(self.trials, self.seed)
        cells = []
        bar = tqdm(total=len(self.lengths) * len(self.depths) * self.trials, desc=console.bar_label("passkey"),
                   unit="trial")
        for length in self.lengths:
            method.apply(model, length)
            for depth in self.depths:
                began, outputs, hits = time.perf_counter(), [], 0.0
                for key in asked:  # one prompt built at a time (check_memory counts one)
                    prompt = build_prompt(tokenizer, length, depth, key)
                    said, scores = self.answer(model, tokenizer, method, [prompt], advance=bar.update)
                    outputs += said
                    hits += scores[0]
                cells.append({"length": length, "depth": depth, "accuracy": hits / self.trials, "trials": self.trials,
                              "prompt_tokens": len(prompt.ids), "seconds": time.perf_counter() - began,
                              "keys": asked, "outputs": outputs})
        bar.close()
        return cells

    def table(self, rows: list[dict], label: str) -> str:
        from sparse_ft.evaluation import report

        return report.passkey_table(rows)

    def draw(self, rows: list[dict], output: Path, *, label: str, model: str, writer: str) -> Path:
        from sparse_ft.evaluation import plots

        return plots.plot_passkey(rows, output, f"passkey retrieval: {model}, {label}", writer=writer)
