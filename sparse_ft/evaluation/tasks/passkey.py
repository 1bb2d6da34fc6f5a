"""``passkey``: a 5-digit key hidden at chosen depths of filler text, over lengths x depths
(landmark attention's prompt; the retrieval itself is ``sparse_ft.evaluation.passkey``)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from sparse_ft.evaluation.tasks.base import Task, lengths_flag, register


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
        lengths = lengths_flag(args.lengths)
        try:
            depths = [float(x) for x in args.depths.split(",") if x]
        except ValueError:
            depths = []
        if not depths or not all(0 <= d <= 1 for d in depths):
            raise ValueError(f"--depths {args.depths!r} must be a comma-separated list of numbers in [0, 1]")
        if args.trials < 1:
            raise ValueError(f"--trials {args.trials} must be >= 1")
        return cls(lengths, depths, trials=args.trials, seed=args.seed)

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
