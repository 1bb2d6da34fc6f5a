"""``passkey``: a 5-digit key hidden at chosen depths of filler text, over lengths x depths
(landmark attention's prompt; the retrieval itself is ``sparse_ft.evaluation.passkey``)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from sparse_ft.evaluation.names import FLAGS, BadParameter, Names
from sparse_ft.evaluation.tasks.base import Task, check_memory, check_number, lengths_flag, register


@register
class Passkey(Task):
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
        from sparse_ft.data.passkey_prompt import shortest_prompt
        from sparse_ft.evaluation.passkey import keys

        shortest = shortest_prompt(tokenizer, keys(self.trials, self.seed))
        for length in self.lengths:
            if length < shortest:
                raise BadParameter(f"{self.names.entry('lengths', length)} is shorter than the passkey prompt without "
                                   f"filler: {shortest} tokens of this tokenizer")

    def evaluate(self, model: Any, tokenizer: Any, method: Any) -> list[dict]:
        from sparse_ft.evaluation import passkey

        return passkey.evaluate(model, tokenizer, self.lengths, self.depths, trials=self.trials, method=method,
                                seed=self.seed)

    def table(self, rows: list[dict], label: str) -> str:
        from sparse_ft.evaluation import report

        return report.passkey_table(rows)

    def draw(self, rows: list[dict], output: Path, *, label: str, model: str, writer: str) -> Path:
        from sparse_ft.evaluation import plots

        return plots.plot_passkey(rows, output, f"passkey retrieval: {model}, {label}", writer=writer)
