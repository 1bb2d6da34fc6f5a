"""``ppl``: sliding-window perplexity at several lengths (the windows and their scoring are
``sparse_ft.evaluation.windows`` and ``ppl``; docs/evaluation.md says exactly which tokens
count)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Optional

from sparse_ft.evaluation.names import BadParameter, Names, flags
from sparse_ft.evaluation.tasks.base import Task, check_number, lengths_flag, register

DEFAULT_STRIDE = 256
FLAGS = flags({"max_windows": "--num-windows"})


@register
class Perplexity(Task):
    name = "ppl"
    summary = "sliding-window perplexity at several lengths"
    description = "sliding-window perplexity at several lengths (docs/evaluation.md says exactly which tokens are scored)"
    picture = "plot"

    def __init__(self, lengths: list[int], data: Any, *, stride: int = DEFAULT_STRIDE, scoring: str = "standard",
                 batch_size: int = 1, max_windows: Optional[int] = None, max_tokens: Optional[int] = None,
                 data_dtype: Optional[str] = None, split: str = "validation", text_column: str = "text") -> None:
        """``data``: a path or dataset id as ``--data`` takes it, or the tokens themselves (an
        array: the experiment reads its validation tokens once for every row)."""
        self.lengths, self.data, self.stride, self.scoring = lengths, data, stride, scoring
        self.batch_size, self.max_windows, self.max_tokens = batch_size, max_windows, max_tokens
        self.data_dtype, self.split, self.text_column = data_dtype, split, text_column
        self.tokens = None if isinstance(data, (str, Path)) else data

    @classmethod
    def configure(cls, p: argparse.ArgumentParser) -> None:
        p.add_argument("--data", required=True, help=".bin token file (with its .json sidecar), a text/jsonl/json/parquet "
                       "file or directory (any other file is read as UTF-8 text), or an HF dataset id")
        p.add_argument("--data-dtype", default=None, choices=["uint16", "uint32"],
                       help=".bin token width (default: from the file's JSON sidecar, else uint16)")
        p.add_argument("--split", default="validation", help="split of an HF dataset id")
        p.add_argument("--text-column", default="text", help="column holding the text (jsonl/json/parquet, HF datasets)")
        p.add_argument("--lengths", default="1024,2048,4096,8192", help="window lengths (comma list)")
        p.add_argument("--stride", type=int, default=None,
                       help="window step, at most the shortest window (default: 256, or the shortest --lengths when shorter)")
        p.add_argument("--scoring", default="standard", choices=["standard", "longlora"],
                       help="standard: every token once; longlora: LongLoRA eval.py's numbers")
        p.add_argument("--max-tokens", type=int, default=None, help="use only the first N tokens of --data (default: all)")
        p.add_argument("--num-windows", type=int, default=None, help="at most N windows per length (default: all)")
        p.add_argument("--batch-size", type=int, default=1, help="windows per forward")
        p.add_argument("--plot", type=Path, default=None, help="PPL-vs-length PNG (default: none)")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "Perplexity":
        lengths = lengths_flag(args.lengths)
        if args.stride is None:
            args.stride = min([DEFAULT_STRIDE, *lengths])
        task = cls(lengths, args.data, stride=args.stride, scoring=args.scoring, batch_size=args.batch_size,
                   max_windows=args.num_windows, max_tokens=args.max_tokens, data_dtype=args.data_dtype,
                   split=args.split, text_column=args.text_column)
        task.check(FLAGS)
        return task

    def check(self, names: Names) -> None:
        from sparse_ft.evaluation import windows

        super().check(names)
        windows.check(self.lengths, self.stride, names)
        if self.scoring not in windows.SCORINGS:
            raise BadParameter(f"{names.say('scoring', self.scoring)} is unknown; allowed: {', '.join(windows.SCORINGS)}")
        check_number(names, "batch_size", self.batch_size)
        for param in ("max_windows", "max_tokens"):
            if getattr(self, param) is not None:
                check_number(names, param, getattr(self, param))
        if self.data_dtype not in (None, "uint16", "uint32"):
            raise BadParameter(f"{names.say('data_dtype', self.data_dtype)} is unknown; allowed: uint16, uint32")
        for param in ("split", "text_column"):
            if not isinstance(getattr(self, param), str) or not getattr(self, param):
                raise BadParameter(f"{names.say(param, getattr(self, param))} must be a name")

    def inputs(self) -> dict[str, Any]:
        return {"--data": self.data} if isinstance(self.data, (str, Path)) else {}

    def check_method(self, method: Any) -> None:
        if not method.supports.ppl:
            raise ValueError(f"--method {method.name} cannot report perplexity: {method.supports.no_ppl_reason}")

    def needs_tokenizer(self) -> bool:
        """Text needs the model's tokenizer; a token file (or tokens given) none."""
        from sparse_ft.evaluation import tokens

        return self.tokens is None and not tokens.check_eval_data(str(self.data), self.data_dtype)

    def prepare(self, tokenizer: Any) -> None:
        """The data read before the weights load: a file without text costs seconds, not a load."""
        from sparse_ft.evaluation import tokens

        if self.tokens is not None:
            return
        self.tokens = tokens.load_tokens(str(self.data), tokenizer, None, self.data_dtype, split=self.split,
                                         text_column=self.text_column, max_tokens=self.max_tokens)
        too_long = [n for n in self.lengths if n > len(self.tokens)]
        if too_long:
            raise ValueError(f"--lengths {','.join(map(str, too_long))} longer than the {len(self.tokens)} tokens of "
                             "--data (lower it or add data)")

    def evaluate(self, model: Any, tokenizer: Any, method: Any) -> list[dict]:
        from sparse_ft.evaluation import tokens, window_perplexity

        if self.tokens is None:
            self.prepare(tokenizer)
        if isinstance(self.data, (str, Path)):  # read for this model: its ids must be in its vocabulary
            tokens.check_vocabulary(self.tokens, model.get_output_embeddings().weight.shape[0], str(self.data))
        return [window_perplexity.evaluate_length(model, self.tokens, n, self.stride, scoring=self.scoring,
                                                  method=method, batch_size=self.batch_size,
                                                  max_windows=self.max_windows)
                for n in self.lengths]

    def table(self, rows: list[dict], label: str) -> str:
        from sparse_ft.evaluation import report

        return report.ppl_table(rows, label)

    def draw(self, rows: list[dict], output: Path, *, label: str, model: str, writer: str) -> Path:
        from sparse_ft.evaluation import plots

        return plots.plot_ppl([(label, rows)], output, title=f"perplexity: {model}, {label}", writer=writer)
