"""``harness``: tasks of lm-evaluation-harness (the optional extra ``sparse-ft[harness]``;
lm-eval 0.4.13 is the version tested) through a method, with an adapter's RoPE restored:
LongBench, RULER with its downloads, and every other task of its index or of a local folder
of task YAML files (``--include-path``).

A task folder is code: lm-eval imports the Python files its YAML names (``!function
utils.process_docs``) when it reads the folder. So ``--include-path`` is refused unless
``--trust-remote-code`` is given too, the flag that already allows code from outside this
toolkit and lm-eval to run (a model repository's).

The harness is the harness's: task configurations, prompts, few-shot, requests, metrics and
their standard errors come from lm-eval, run through lm-eval's own ``HFLM``
(``sparse_ft.evaluation.method_hflm`` says where and why it steps in). Ours: the model as
every ``eval`` task loads it, the method applied at ``--max-length``, the checks before the
weights load, the results JSON and markdown table.
"""

from __future__ import annotations

import argparse
import difflib
import json
from pathlib import Path
from typing import Any, Optional

from sparse_ft.files.strict import json_value
from sparse_ft.evaluation.names import FLAGS, BadParameter, Names
from sparse_ft.evaluation.tasks.base import Task, check_number, register

SUPPORTED = ">=0.4.13,<0.5"  # pyproject.toml's harness extra (tests/evaluation/test_harness.py checks they agree)
INSTALL = "pip install '.[harness]' in a checkout of sparse-ft (no release exists yet)"


def lm_eval_version() -> str:
    """The installed lm-eval's version, or a one-line error saying how to install a supported one."""
    from importlib import metadata

    from packaging.specifiers import SpecifierSet

    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise ValueError(f"eval harness needs lm-evaluation-harness, an optional extra: {INSTALL}") from None
    version = metadata.version("lm-eval")
    if version not in SpecifierSet(SUPPORTED):
        raise ValueError(f"lm-eval {version} is installed; eval harness supports lm-eval{SUPPORTED}: {INSTALL}")
    return version


def _number(value: Any) -> Optional[float]:
    """A metric as JSON holds it; lm-eval's "N/A" (no standard error) is None."""
    return None if value is None or isinstance(value, str) else float(value)


def result_rows(results: dict) -> list[dict]:
    """One row per task (or group), metric and filter of lm-eval's ``results``."""
    rows = []
    for name, entry in results["results"].items():
        samples = results.get("n-samples", {}).get(name, {}).get("effective")
        for key, value in entry.items():
            metric, _, where = key.partition(",")
            if where and not metric.endswith("_stderr"):
                rows.append({"task": name, "metric": metric, "filter": where, "value": _number(value),
                             "stderr": _number(entry.get(f"{metric}_stderr,{where}")), "samples": samples})
    return rows


def _json_object(text: Optional[str]) -> Optional[dict]:
    if text is None:
        return None
    try:
        value = json_value(text, f"--metadata {text!r}")
    except json.JSONDecodeError as err:
        raise ValueError(f"--metadata {text!r} is not JSON ({err.msg}); give an object, e.g. '{{\"max_seq_lengths\": [4096]}}'") from None
    if not isinstance(value, dict):
        raise ValueError(f"--metadata {text!r} is a JSON {type(value).__name__}, not an object")
    return value


@register
class Harness(Task):
    name = "harness"
    summary = "lm-evaluation-harness tasks (LongBench, RULER, ...) through the method"
    description = ("tasks of lm-evaluation-harness (the optional extra: pip install '.[harness]' in a checkout; lm-eval 0.4.13 "
                   "tested) through the method, an adapter's RoPE restored (docs/evaluation.md)")

    def __init__(self, tasks: Optional[list[str]] = None, *, include_path: Optional[str] = None, limit: Optional[float] = None,
                 num_fewshot: Optional[int] = None, batch_size: int = 1, max_length: Optional[int] = None,
                 metadata: Optional[dict] = None) -> None:
        self.tasks, self.include_path, self.limit, self.num_fewshot = tasks, include_path, limit, num_fewshot
        self.metadata = metadata
        self.batch_size, self.max_length = batch_size, max_length
        self.lengths = [max_length] if max_length else []
        self.version = lm_eval_version()
        self.manager: Any = None
        self.loaded: list[Any] = []
        self.details: dict = {}

    @classmethod
    def configure(cls, p: argparse.ArgumentParser) -> None:
        p.add_argument("--tasks", required=True, help="comma list of lm-eval task, group or tag names (e.g. longbench, ruler)")
        p.add_argument("--include-path", default=None,
                       help="folder of lm-eval task YAML files, searched besides lm-eval's own; lm-eval imports the "
                       "Python they name (!function), so it needs --trust-remote-code (default: none)")
        p.add_argument("--limit", type=float, default=None,
                       help="at most N documents per task, or that fraction of each when below 1 (default: all)")
        p.add_argument("--num-fewshot", type=int, default=None, help="few-shot examples (default: each task's own)")
        p.add_argument("--batch-size", type=int, default=1, help="requests per forward (above 1 only with --method full)")
        p.add_argument("--max-length", type=int, default=None,
                       help="the length the method is applied at; longer prompts lose their start, as lm-eval truncates "
                       "(default: the model's context, an adapter's included)")
        p.add_argument("--metadata", default=None, metavar="JSON",
                       help="JSON object lm-eval hands to every task, as its --metadata (RULER: "
                       "'{\"tokenizer\": \"MODEL\", \"max_seq_lengths\": [4096]}'; default: none)")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "Harness":
        names = [n.strip() for n in args.tasks.split(",") if n.strip()]
        if not names:
            raise ValueError(f"--tasks {args.tasks!r} names no task")
        if args.include_path is not None and not Path(args.include_path).expanduser().is_dir():
            raise FileNotFoundError(f"--include-path {args.include_path}: no such directory")
        if args.include_path is not None and not args.trust_remote_code:
            raise ValueError(f"--include-path {args.include_path}: lm-eval imports and runs the Python its task YAML files "
                             "name (!function); give --trust-remote-code to allow that")
        task = cls(names, include_path=args.include_path, limit=args.limit, num_fewshot=args.num_fewshot,
                   batch_size=args.batch_size, max_length=args.max_length, metadata=_json_object(args.metadata))
        task.check(FLAGS)
        return task

    def check(self, names: Names) -> None:
        """The parameters' bounds, checked alike for eval's flags and a recipe's
        ``validation.params.harness``: lm-eval task names, ``limit`` a whole number >= 1 or a
        fraction in (0, 1), ``num_fewshot`` >= 0, ``batch_size`` >= 1, and ``max_length``
        >= 2 and a length a model can be asked for. No lengths otherwise: lm-eval's tasks
        bring their own, cut at the model's context."""
        from attn_patterns.checks import length_rule

        self.names = names
        if not isinstance(self.tasks, list) or not self.tasks or not all(isinstance(t, str) and t for t in self.tasks):
            raise BadParameter(f"{names.say('tasks', self.tasks)} must list lm-eval task, group or tag names")
        limit = self.limit
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, (int, float))
                                  or not (0 < limit < 1 or (limit >= 1 and limit == int(limit)))):
            raise BadParameter(f"{names.say('limit', limit)} must be a whole number >= 1 or a fraction in (0, 1)")
        if self.num_fewshot is not None:
            check_number(names, "num_fewshot", self.num_fewshot, least=0)
        check_number(names, "batch_size", self.batch_size)
        if self.max_length is not None:
            check_number(names, "max_length", self.max_length, least=2)
            why = length_rule(self.max_length)
            if why:
                raise BadParameter(f"{names.say('max_length', self.max_length)} is invalid: {why}")

    @property
    def samples(self) -> Optional[float]:
        """``limit`` as lm-eval takes it: a count as an integer, a fraction as it is."""
        return int(self.limit) if self.limit is not None and self.limit >= 1 else self.limit

    def inputs(self) -> dict[str, Any]:
        return {"--include-path": self.include_path}

    def check_method(self, method: Any) -> None:
        from sparse_ft.evaluation.method_hflm import check_batch

        if not method.supports.ppl:
            raise ValueError(f"--method {method.name} cannot run harness tasks, which score and answer whole prompts: "
                             f"{method.supports.no_ppl_reason}")
        check_batch(method, self.batch_size)

    def prepare(self, tokenizer: Any) -> None:
        """The tasks found and their data loaded (a download, or a local file that is missing,
        fails here, before the weights); lm-eval's index of its own tasks is read only when a
        name is not in ``--include-path``."""
        from lm_eval.tasks import TaskManager

        local = Path(self.include_path).expanduser() if self.include_path else None
        self.manager = TaskManager(include_path=str(local), include_defaults=False, metadata=self.metadata) if local else None
        if self.manager is None or not set(self.tasks) <= set(self.manager.all_tasks):
            self.manager = TaskManager(include_path=str(local) if local else None, metadata=self.metadata)
        known = self.manager.all_tasks
        for name in self.tasks:
            if name not in known:
                where = f"lm-eval {self.version}" + (f" or --include-path {self.include_path}" if local else "")
                close = difflib.get_close_matches(name, known, n=3)
                hint = f"; close: {', '.join(close)}" if close else ""
                raise ValueError(f"--tasks {name}: no task, group or tag of that name in {where}{hint} "
                                 "(`lm-eval ls tasks` lists them)")
        try:
            loaded = self.manager.load(self.tasks)
        except Exception as err:  # noqa: BLE001 - datasets, YAML and lm-eval each raise their own
            first = str(err).strip().splitlines()[0] if str(err).strip() else ""
            raise ValueError(f"--tasks {','.join(self.tasks)}: lm-eval cannot load them: {type(err).__name__}: {first}") from None
        for name, task in loaded["tasks"].items():
            if task.get_config("output_type") == "generate_until" and (task.get_config("generation_kwargs") or {}).get("do_sample"):
                raise ValueError(f"--tasks {name} samples its answers (do_sample: true); methods answer greedily")
        children = {child for group in loaded["group_map"].values() for child in group}
        self.loaded = [item for name, item in (*loaded["groups"].items(), *loaded["tasks"].items()) if name not in children]

    def evaluate(self, model: Any, tokenizer: Any, method: Any) -> list[dict]:
        from sparse_ft.evaluation import method_hflm
        from sparse_ft.modeling.attention import pretrained

        length = self.max_length or int(pretrained(model).config.max_position_embeddings)
        results = method_hflm.evaluate(model, tokenizer, method, tasks=self.loaded, task_manager=self.manager,
                                      max_length=length, limit=self.samples, batch_size=self.batch_size,
                                      num_fewshot=self.num_fewshot)
        self.details = {"lm_eval": self.version, "max_length": length, "n_shot": results.get("n-shot", {}),
                        "task_versions": results.get("versions", {})}
        return result_rows(results)

    def table(self, rows: list[dict], label: str) -> str:
        lines = ["| method | task | metric | filter | value | ± stderr | samples |", "|---|---|---|---|---:|---:|---:|"]
        for r in rows:
            value = "n/a" if r["value"] is None else f"{r['value']:.4g}"
            stderr = "" if r["stderr"] is None else f"{r['stderr']:.4g}"
            lines.append(f"| {label} | {r['task']} | {r['metric']} | {r['filter']} | {value} | {stderr} | {r['samples'] or ''} |")
        return "\n".join(lines)

    def summary_of(self, rows: list[dict]) -> dict:
        return self.details
