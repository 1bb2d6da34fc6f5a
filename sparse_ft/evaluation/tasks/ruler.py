"""``ruler``: RULER's synthetic tasks (Hsieh et al., 2024, "RULER: What's the Real Context Size
of Your Long-Context Language Models?") over lengths through one method, and the effective
context length they give: the tasks are ``sparse_ft.evaluation.tasks.generation``'s; this
suite builds every prompt before the weights load, answers them, averages over tasks per
length and reports the effective length for RULER's threshold and relative to the base model
(``sparse_ft.evaluation.effective_length``). docs/evaluation.md lists where it follows RULER
and where it departs.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from sparse_ft import console
from sparse_ft.evaluation.effective_length import RULER_THRESHOLD
from sparse_ft.evaluation.names import BadParameter, Names, flags
from sparse_ft.evaluation.tasks.base import TASKS, Task, check_memory, check_number, lengths_flag, register
from sparse_ft.evaluation.tasks.generation import GenerationTask, Prompt, TooShort, registered_ruler_tasks

LENGTHS = "4096,8192,16384,32768,65536,131072"  # RULER's table
FLAGS = flags({"fraction": "--relative-threshold"})


def essay_words(path: Optional[str]) -> list[str]:
    """The essay haystack as RULER splits it (on whitespace): ``path``'s text, or by default the
    built-in corpus (the standard library's module sources, ``sparse_ft.data.stdlib_text``)."""
    if path is None:
        from sparse_ft.data.stdlib_text import iter_stdlib_documents

        text = "\n".join(iter_stdlib_documents())
    else:
        text = Path(path).expanduser().read_text(encoding="utf-8")
    return text.split()


def _check_haystack(path: Any, names: Names) -> None:
    said = names.say("haystack", path)
    if not isinstance(path, str):
        raise BadParameter(f"{said} must be the path of a UTF-8 text file")
    file = Path(path).expanduser()
    if not file.is_file():
        raise BadParameter(f"{said} does not exist" if not file.exists() else f"{said} is not a file")
    try:
        words = file.read_text(encoding="utf-8").split()
    except UnicodeDecodeError as err:
        raise BadParameter(f"{said} is not UTF-8 text (byte {err.start})") from None
    if not words:
        raise BadParameter(f"{said} holds no words")


# --- the suite -----------------------------------------------------------------------------------
@register
class Ruler(Task):
    """Tasks x lengths through one method, and the effective context length."""

    name = "ruler"
    summary = "RULER's synthetic tasks (needles, variable tracking, word extraction) and the effective context length"
    picture = "heatmap"

    def __init__(self, lengths: list[int], tasks: Sequence["GenerationTask | str"], *, samples: int = 25, seed: int = 0,
                 haystack: Optional[str] = None, threshold: float = RULER_THRESHOLD, fraction: float = 0.9,
                 base: Optional[dict] = None, base_note: Optional[str] = None) -> None:
        """``base``: the base model's mean at its pretraining length, from an earlier run
        (``--reference``) or an earlier ``measure_base``; None measures it in this run when
        the model carries no adapter, unless ``base_note`` says why there is none (then the
        relative effective length is n/a without another attempt)."""
        self.lengths, self.samples, self.seed, self.haystack = lengths, samples, seed, haystack
        self.tasks = [TASKS.get(t) if isinstance(t, str) else t for t in tasks]
        self.threshold, self.fraction, self.base = threshold, fraction, base
        self.prompts: dict[tuple[str, int], list[Prompt]] = {}
        self.tokenizer: Any = None
        self.essay: list[str] = []
        self.base_note = base_note or "no base measurement"  # why there is none, when there is none
        self.measure = base is None and base_note is None

    # --- command line --------------------------------------------------------------------------
    @classmethod
    def configure(cls, parser: argparse.ArgumentParser) -> None:
        cls.add_flags(parser, suite=True)

    @staticmethod
    def add_flags(p: argparse.ArgumentParser, *, suite: bool) -> None:
        """The suite's flags; a single task's sub-command has all but ``--tasks``."""
        p.add_argument("--lengths", default=LENGTHS, help="lengths in the model's tokens, prompt plus the tokens a task "
                       "may generate, as RULER counts them (comma list)")
        if suite:
            p.add_argument("--tasks", default=None, help="comma list (default: every RULER task: "
                           f"{', '.join(registered_ruler_tasks())})")
        p.add_argument("--samples", type=int, default=25, help="samples per task and length (RULER's runs use 500)")
        p.add_argument("--seed", type=int, default=0, help="seed of the samples: the same seed gives the same samples")
        p.add_argument("--haystack", default=None, help="UTF-8 text file the essay-haystack tasks (niah_single_2/3, "
                       "niah_multikey_1, niah_multivalue, niah_multiquery) hide needles in (default: the built-in "
                       "corpus, the standard library's module sources)")
        p.add_argument("--task-arg", action="append", default=[], metavar="TASK.KEY=VALUE",
                       help="a task's setting, repeatable, e.g. vt.num_hops=2; values are YAML scalars "
                            "(default: RULER's settings)")
        p.add_argument("--threshold", type=float, default=RULER_THRESHOLD,
                       help="score the mean must reach for the effective length (RULER's: Llama-2-7B's at 4K)")
        p.add_argument("--relative-threshold", type=float, default=0.9,
                       help="the second effective length: this fraction of the base model's mean at its pretraining length")
        p.add_argument("--reference", type=Path, default=None,
                       help="results JSON of an earlier eval ruler of the base model, whose base measurement sets the "
                            "relative threshold (default: measured in this run, full attention at the pretraining "
                            "length, when there is no --adapter)")
        p.add_argument("--heatmap", type=Path, default=None, help="task x length score heatmap PNG (default: none)")

    @classmethod
    def from_args(cls, args: argparse.Namespace, names: Optional[list[str]] = None) -> "Ruler":
        from sparse_ft.files.keyvalue import parse_assignments

        lengths = lengths_flag(args.lengths)
        allowed = registered_ruler_tasks()
        if names is None:
            names = [n for n in (args.tasks or ",".join(allowed)).split(",") if n]
            for name in names:
                if name not in allowed:
                    raise ValueError(f"--tasks {name!r} is unknown; allowed: {', '.join(allowed)}")
            if not names or len(set(names)) < len(names):
                raise ValueError(f"--tasks {args.tasks!r} must name each task once")
        params: dict[str, dict] = {name: {} for name in names}
        for key, value in parse_assignments(args.task_arg, "--task-arg", "TASK.KEY=VALUE"):
            name, _, param = key.partition(".")
            if name not in params or not param:
                raise ValueError(f"--task-arg {key}={value}: must be TASK.KEY=VALUE with TASK among the tasks run "
                                 f"({', '.join(names)})")
            params[name][param] = value
        try:
            tasks = [TASKS.get(name, **params[name]) for name in names]
        except (TypeError, ValueError) as err:
            raise ValueError(f"--task-arg: {err}") from None
        suite = cls(lengths, tasks, samples=args.samples, seed=args.seed, haystack=args.haystack,
                    threshold=args.threshold, fraction=args.relative_threshold)
        suite.check(FLAGS)
        if args.reference is not None:
            suite.base, suite.measure = read_base(args.reference, names), False
        return suite

    def check(self, names: Names) -> None:
        """RULER tasks, each once; the suite's numbers; the haystack file, read by a task; and
        lengths each task can build, whose prompts (all kept until the weights load) fit in
        memory. The shortest prompt needs the tokenizer (:meth:`prepare`)."""
        super().check(names)
        allowed = registered_ruler_tasks()
        if not self.tasks:
            raise BadParameter(f"{names.say('tasks', [])} must name RULER tasks: {', '.join(allowed)}")
        for task in self.tasks:
            if not isinstance(task, GenerationTask) or not task.ruler_task:
                raise BadParameter(f"{names.entry('tasks', task.name)} is not a RULER task; allowed: {', '.join(allowed)}")
        run = [t.name for t in self.tasks]
        if len(set(run)) < len(run):
            raise BadParameter(f"{names.say('tasks', run)} must name each task once")
        check_number(names, "samples", self.samples)
        check_number(names, "seed", self.seed, least=float("-inf"))
        for param, low, high, what in (("threshold", 0, 100, "a score in (0, 100]"),
                                       ("fraction", 0, float("inf"), "> 0 (a fraction of the base's score)")):
            value = getattr(self, param)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not low < value <= high:
                raise BadParameter(f"{names.say(param, value)} must be {what}")
        if self.haystack is not None:
            if not any(t.uses_essay for t in self.tasks):
                raise BadParameter(f"{names.say('haystack', self.haystack)} is read by the essay-haystack tasks only, and "
                                   f"none is run ({', '.join(run)})")
            _check_haystack(self.haystack, names)
        check_memory(self.lengths, names, kept=self.samples * len(self.tasks))
        for task in self.tasks:
            bound = task.longest()
            if bound is not None and max(self.lengths) > bound[0]:
                raise BadParameter(f"{names.entry('lengths', max(self.lengths))} is longer than {task.name} can build: at "
                                   f"most {bound[0]:,} tokens ({bound[1]})")

    def inputs(self) -> dict[str, Any]:
        return {"--haystack": self.haystack, "--reference": self.base and self.base.get("file")}

    # --- prompts, before the weights load ------------------------------------------------------
    def check_model(self, config: Any) -> None:
        """The relative effective length is measured against the base at its pretraining
        length: a config that does not say it is refused, unless ``--reference`` gives the base."""
        from sparse_ft.modeling.rope import original_context

        if self.measure:
            original_context(config)

    def prepare(self, tokenizer: Any) -> None:
        """Every prompt, fitted: a length too short for a task fails here, not after the weights load."""
        from tqdm import tqdm

        self.tokenizer = tokenizer
        if any(t.uses_essay for t in self.tasks):
            self.essay = essay_words(self.haystack)
        for task in self.tasks:
            task.setup(tokenizer, self.essay)
        # transient: a length too short ends it with the error line alone
        with tqdm(total=len(self.tasks) * len(self.lengths) * self.samples, desc="building prompts", unit="prompt",
                  leave=False) as bar:
            for length in self.lengths:
                for task in self.tasks:
                    self.prompts[(task.name, length)] = self._fit(task, length, bar.update)

    def _fit(self, task: GenerationTask, length: int, advance: Callable[[], Any] = lambda: None) -> list[Prompt]:
        """``samples`` prompts of ``task`` at ``length``; sample ``i`` draws from a generator
        seeded by (seed, task, i), so its needles are the same at every length."""
        prompts: list[Prompt] = []
        for index in range(self.samples):
            hint = prompts[-1].size if prompts else None
            prompts.append(task.fit(self.tokenizer, length, seed=f"{self.seed}:{task.name}:{index}", hint=hint,
                                    names=self.names))
            advance()
        return prompts

    # --- running ---------------------------------------------------------------------------------
    def evaluate(self, model: Any, tokenizer: Any, method: Any) -> list[dict]:
        from tqdm import tqdm

        if self.measure:
            self.base = self.measure_base(model, tokenizer, method)
        rows = []
        bar = tqdm(total=len(self.tasks) * len(self.lengths) * self.samples, desc=console.bar_label("ruler"), unit="sample")
        for length in self.lengths:
            method.apply(model, length)
            for task in self.tasks:
                rows.append(self._run(model, tokenizer, method, task=task, length=length,
                                      prompts=self.prompts[(task.name, length)], advance=bar.update))
        bar.close()
        if self.base is not None and self.base.get("from_rows"):
            self.base = self._base_from(rows, self.base["length"], "this run: its rows at the pretraining length")
        return rows

    def _run(self, model: Any, tokenizer: Any, method: Any, *, task: GenerationTask, length: int, prompts: list[Prompt],
             advance: Callable[[], Any] = lambda: None) -> dict:
        """One task at one length: greedy answers through the method, each scored."""
        began = time.perf_counter()
        outputs, scores = task.answer(model, tokenizer, method, prompts, advance=advance)
        return {"task": task.name, "length": length, "score": 100 * sum(scores) / len(scores), "samples": len(prompts),
                "prompt_tokens": [p.tokens for p in prompts], "haystack": [p.size for p in prompts],
                "tokens_to_generate": task.tokens_to_generate, "seconds": time.perf_counter() - began,
                "answers": [list(p.sample.answers) for p in prompts], "outputs": outputs, "scores": scores}

    def measure_base(self, model: Any, tokenizer: Any, method: Any) -> Optional[dict]:
        """The base model's mean at its pretraining length C, with full attention: from this
        run's own rows when they are that (method ``full``, C among the lengths), else measured
        first. None with an adapter (the loaded model is no longer the base) or when C is
        shorter than a task's shortest prompt; ``self.base_note`` says which."""
        from sparse_ft import methods
        from sparse_ft.modeling.attention import pretrained
        from sparse_ft.modeling.rope import original_context

        config = pretrained(model).config
        context = original_context(config)
        if hasattr(model, "peft_config"):
            self.base_note = "the model carries an adapter: pass --reference with an eval ruler of its base"
            return None
        if method.name == "full" and context in self.lengths:
            return {"length": context, "from_rows": True}
        try:
            prompts = {task.name: self._fit(task, context) for task in self.tasks}
        except TooShort as err:
            self.base_note = (f"the base's pretraining length {context} is shorter than the shortest {err.task} prompt "
                              f"({err.need} tokens)")
            return None
        full = methods.get("full")
        full.apply(model, context)
        rows = [self._run(model, tokenizer, full, task=task, length=context, prompts=prompts[task.name]) for task in self.tasks]
        return self._base_from(rows, context, "this run: full attention at the pretraining length") | {"rows": rows}

    def _base_from(self, rows: list[dict], length: int, source: str) -> dict:
        scores = {r["task"]: r["score"] for r in rows if r["length"] == length}
        return {"source": source, "length": length, "scores": scores, "mean": sum(scores.values()) / len(scores)}

    # --- report ----------------------------------------------------------------------------------
    def summary_of(self, rows: list[dict]) -> dict:
        from sparse_ft.evaluation.effective_length import means_by_length, summarise

        base = self._base_over_tasks()
        means = means_by_length(rows)
        effective = summarise(means, threshold=self.threshold, fraction=self.fraction,
                              base_mean=base and base["mean"], note=self.base_note)
        return {"tasks": [t.name for t in self.tasks], "seed": self.seed,
                "means": [{"length": n, "mean": m} for n, m in means.items()], "base": base,
                "effective_length": effective}

    def _base_over_tasks(self) -> Optional[dict]:
        """The base measurement averaged over this run's tasks (a reference file may hold more)."""
        if self.base is None or "scores" not in self.base:
            return None
        scores = {t.name: self.base["scores"][t.name] for t in self.tasks}
        return {**self.base, "scores": scores, "mean": sum(scores.values()) / len(scores)}

    def table(self, rows: list[dict], label: str) -> str:
        from sparse_ft.evaluation.effective_length import describe

        lengths = sorted({r["length"] for r in rows})
        score = {(r["task"], r["length"]): r["score"] for r in rows}
        summary = self.summary_of(rows)
        lines = [f"| {label} | " + " | ".join(str(n) for n in lengths) + " |", "|---|" + "---:|" * len(lengths)]
        lines += [f"| {t.name} | " + " | ".join(f"{score[(t.name, n)]:.1f}" for n in lengths) + " |" for t in self.tasks]
        lines.append("| **mean** | " + " | ".join(f"**{m['mean']:.1f}**" for m in summary["means"]) + " |")
        ruler, relative = summary["effective_length"]["ruler"], summary["effective_length"]["relative"]
        lines += ["", f"Effective length, mean >= {ruler['threshold']:g} (RULER's threshold): {describe(ruler)}"]
        base = summary["base"]
        if relative["threshold"] is None:
            lines.append(f"Effective length relative to the base: n/a ({relative['note']})")
        else:
            lines.append(f"Effective length, mean >= {relative['fraction']:g} x the base's {base['mean']:.1f} at "
                         f"{base['length']} = {relative['threshold']:.1f}: {describe(relative)}")
        return "\n".join(lines)

    def draw(self, rows: list[dict], output: Path, *, label: str, model: str, writer: str) -> Path:
        from sparse_ft.evaluation import plots
        from sparse_ft.evaluation.effective_length import brief

        effective = self.summary_of(rows)["effective_length"]
        ruler, relative = effective["ruler"], effective["relative"]
        title = (f"RULER: {model}, {label}\neffective length {brief(ruler)} (mean ≥ {ruler['threshold']:g}), "
                 f"{brief(relative)} (≥ {relative['fraction']:g} × base)")
        return plots.plot_scores(rows, [t.name for t in self.tasks], output, title, writer=writer)


def read_base(path: Path, names: list[str]) -> dict:
    """The base measurement an earlier ``eval ruler --output`` recorded, checked to cover ``names``."""
    import json

    if not Path(path).is_file():
        raise FileNotFoundError(f"--reference {path} does not exist")
    try:
        base = json.loads(Path(path).read_text())["summary"]["base"]
        scores, length = base["scores"], base["length"]
    except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError):
        raise ValueError(f"--reference {path} is not a results file of `sparse-ft eval ruler --output` with a base "
                         "measurement (one of the base model without --adapter)") from None
    missing = [n for n in names if n not in scores]
    if missing:
        raise ValueError(f"--reference {path} has no base score of {', '.join(missing)}; it measured {', '.join(scores)}")
    return {"source": f"--reference {path}", "file": str(path), "length": length, "scores": scores}
