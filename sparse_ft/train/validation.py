"""Validation during training: the recipe's ``validation`` section run through the evaluation
task registry (``sparse_ft.evaluation.tasks``) on the model as it trains, every
``validation.every_steps`` optimizer steps and, with ``validation.at_end``, after the last.

It must not change training, so a run with it has the loss curve of a run without it, bit for
bit: the model goes to eval mode (no dropout) under no_grad, its training attention and train
mode are restored afterwards, and every random generator a step draws from (torch's CPU and
CUDA generators, Python's, NumPy's) is put back as it was. Every rank runs the same forwards:
under ZeRO-3 each forward gathers parameters from all ranks, so none may sit one out; rank 0
logs. Generation stops where each rank's own tokens say, which under ZeRO-3 could leave one
rank waiting in a forward the others never run, so ZeRO-3 validates with ``ppl`` only.

Validation attends with full attention by default (``validation.attention: full``): that is
how the adapter is used after training and how the papers and ``sparse-ft experiment`` report
a fine-tuned model; ``training`` measures the pattern the run trains through instead.
"""

from __future__ import annotations

import contextlib
import random
import time
from typing import Any, Iterator, Optional

import numpy as np
import torch

from sparse_ft import methods
from sparse_ft.config import Recipe
from sparse_ft.config.bad_input import BadInput, fail
from sparse_ft.data.sources import Keys
from sparse_ft.evaluation import tasks
from sparse_ft.evaluation.names import BadParameter, Names
from sparse_ft.evaluation.tasks.generation import registered_ruler_tasks
from sparse_ft.methods import Method
from sparse_ft.modeling.attention import install_method

KEYS = Keys("validation.data", "data.text_column")  # what errors about the held-out data name

KIND = "validation"  # the ``kind`` of its lines in log.jsonl (a training step's line has none)
ZERO3_TASKS = ("ppl",)  # a fixed number of forwards on every rank, whatever the model answers
PASSKEY_DEPTHS = [0.0, 0.25, 0.5, 0.75, 1.0]  # as `eval passkey` by default
RULER_SUITE = ("samples", "seed", "haystack")  # a RULER task's parameters that are its suite's
METRICS = ("ppl", "accuracy", "score")  # the number a task's row reports, by task kind


def lengths(recipe: Recipe) -> list[int]:
    """``validation.lengths``, by default the length the run extends the model to."""
    return list(recipe.validation.lengths) or [recipe.model.target_length]


def _task_params(recipe: Recipe, name: str, held_out: Any) -> dict:
    """What ``tasks.get`` builds task ``name`` from: ``eval``'s defaults (the validation
    lengths, the held-out tokens for ``ppl`` with ``eval ppl``'s stride, ``eval passkey``'s
    depths), then the recipe's own ``validation.params.NAME`` over them. A RULER task runs as
    the ``ruler`` suite of that task alone (its own command line is that too), and its
    ``samples``, ``seed`` and ``haystack`` are the suite's; the suite runs every RULER task
    unless its params name some."""
    v = recipe.validation
    given = dict(v.params.get(name, {}))
    at = given.pop("lengths", None) or lengths(recipe)
    if name == "ppl":
        from sparse_ft.evaluation.tasks.perplexity import DEFAULT_STRIDE

        shortest = min(at) if isinstance(at, list) and all(isinstance(n, int) for n in at) and at else DEFAULT_STRIDE
        return {"lengths": at, "data": held_out, "stride": min(DEFAULT_STRIDE, shortest), **given}
    if name == "passkey":
        return {"lengths": at, "depths": PASSKEY_DEPTHS, **given}
    if name == "harness":  # lm-eval's tasks at the longest validation length
        longest = max(at) if isinstance(at, list) and at and all(isinstance(n, int) for n in at) else at
        return {"max_length": longest, **given}
    if name == "ruler":
        return {"lengths": at, "tasks": registered_ruler_tasks(), **given}
    if name in registered_ruler_tasks():
        suite = {key: given.pop(key) for key in RULER_SUITE if key in given}
        return {"lengths": at, "tasks": [tasks.get(name, **given)], **suite}
    return {"lengths": at, **given}


def recipe_names(recipe: Recipe, name: str) -> Names:
    """What task ``name``'s checks call its parameters: its ``validation.params`` keys, and
    for its lengths the key they came from (its own, ``validation.lengths``, or their default
    ``model.target_length``)."""
    v = recipe.validation
    own = f"validation.params.{name}"
    at = (f"{own}.lengths" if "lengths" in v.params.get(name, {}) else
          "validation.lengths" if v.lengths else "model.target_length")
    return Names(lambda param: at if param == "lengths" else f"{own}.{param}", recipe=True)


def refused(err: BadParameter) -> BadInput:
    """A task check's refusal (its message starts with the key) as the recipe's one line."""
    return BadInput(f"recipe key {err}")


def build_tasks(recipe: Recipe, held_out: Any = "") -> dict[str, tasks.Task]:
    """The recipe's validation tasks by name, each built as :func:`_task_params` says and its
    parameters checked by the task's own check, the one ``sparse-ft eval`` runs on its flags;
    a bad name or parameter is a one-line :class:`BadInput` naming the recipe key."""
    built = {}
    for name in recipe.validation.tasks:
        if name not in tasks.names():
            fail("validation.tasks", recipe.validation.tasks, f"entries allowed: {', '.join(tasks.names())}")
        runs_as = "ruler" if name in registered_ruler_tasks() else name
        try:
            built[name] = tasks.get(runs_as, **_task_params(recipe, name, held_out))
        except (TypeError, ValueError) as err:
            fail(f"validation.params.{name}", recipe.validation.params.get(name, {}), str(err))
        try:
            built[name].check(recipe_names(recipe, name))
        except BadParameter as err:
            raise refused(err) from None
    return built


def check(recipe: Recipe, method: Method, zero_stage: Optional[int]) -> None:
    """What the validation section needs that the schema cannot see (task names and
    parameters, the held-out file, the method at the validation lengths), before anything
    loads; ``zero_stage``: the DeepSpeed config's ZeRO stage, None without DeepSpeed."""
    v = recipe.validation
    if not (v.every_steps or v.at_end):
        return
    built = build_tasks(recipe)
    if zero_stage == 3:
        generating = [name for name in v.tasks if name not in ZERO3_TASKS]
        if generating:
            fail("validation.tasks", v.tasks, f"under ZeRO-3 (deepspeed={recipe.deepspeed}) only {', '.join(ZERO3_TASKS)}: "
                 f"{', '.join(generating)} generate(s), and a rank that stops generating first would leave the others "
                 "waiting in a forward; validate with ppl, or train with a ZeRO-1/2 config")
    if "ppl" in v.tasks:
        from sparse_ft.evaluation.tokens import check_eval_data

        try:
            check_eval_data(v.data, keys=KEYS)
        except (ValueError, OSError) as err:
            fail(KEYS.source, v.data, str(err).replace(f"{KEYS.source} ", "", 1))
    validating = validation_method(recipe, method)
    for name, task in built.items():
        for length in task.lengths:
            try:
                validating.check_length(length)
            except ValueError as err:
                fail("validation.lengths", lengths(recipe), f"{err} ({name} through validation.attention="
                     f"{v.attention}: {validating.name})")


def validation_method(recipe: Recipe, method: Method) -> Method:
    """The method validation attends through: full attention, or the run's ``method``."""
    return method if recipe.validation.attention == "training" else methods.get("full")


def due(recipe: Recipe, step: int, last: int) -> bool:
    """Whether validation runs after optimizer step ``step`` of ``last``."""
    v = recipe.validation
    return bool(v.every_steps and step % v.every_steps == 0) or (v.at_end and step == last)


@contextlib.contextmanager
def rng_untouched() -> Iterator[None]:
    """Every generator training draws from, as it was before the block: torch's CPU and
    current CUDA device's (dropout), Python's and NumPy's."""
    python, numpy = random.getstate(), np.random.get_state()
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        random.setstate(python)
        np.random.set_state(numpy)


def metrics(name: str, rows: list[dict]) -> dict[str, float]:
    """A task's rows as the scalars trackers plot, ``val/TASK/METRIC@LENGTH``: perplexity, a
    passkey accuracy averaged over depths, a RULER score per task and, for several tasks,
    their mean under the suite's name."""
    groups: dict[str, list[float]] = {}
    for row in rows:
        metric = next(m for m in METRICS if m in row)
        own = row.get("task", name)
        keys = [own] if own == name else [own, name]  # a suite's task, and the suite's mean
        for key in keys:
            groups.setdefault(f"val/{key}/{metric}@{row['length']}", []).append(float(row[metric]))
    return {key: sum(values) / len(values) for key, values in groups.items()}


def _brief(row: dict) -> dict:
    """A row without its per-sample lists (prompts, outputs, keys): what log.jsonl keeps."""
    return {k: v for k, v in row.items() if not isinstance(v, (list, dict))}


class Validation:
    """The validation of one run: its tasks prepared with the run's tokenizer before the
    model loads (the held-out tokens read, RULER's prompts fitted), then :meth:`run` on the
    model at each step :func:`due` names."""

    def __init__(self, recipe: Recipe, tokenizer: Any, method: Method) -> None:
        self.recipe, self.tokenizer, self.training_method = recipe, tokenizer, method
        self.method = validation_method(recipe, method)
        v = recipe.validation
        self.enabled = bool(v.every_steps or v.at_end)
        self.tasks = build_tasks(recipe, self._held_out()) if self.enabled else {}
        for name, task in self.tasks.items():
            try:
                task.prepare(tokenizer)
            except BadParameter as err:
                raise refused(err) from None
            except ValueError as err:
                fail(f"validation.params.{name}", v.params.get(name, {}), str(err))

    def _held_out(self) -> Any:
        """The held-out tokens ``ppl`` scores, read once (the tokens, not the path, go to the
        task: under ZeRO-3 the model's own vocabulary size is partitioned away)."""
        v = self.recipe.validation
        if "ppl" not in v.tasks:
            return None
        from sparse_ft.evaluation.tokens import load_tokens

        try:
            held_out = load_tokens(v.data, self.tokenizer, len(self.tokenizer), split=v.split,
                                   text_column=self.recipe.data.text_column, keys=KEYS)
        except (ValueError, OSError) as err:
            fail(KEYS.source, v.data, str(err).replace(f"{KEYS.source} ", "", 1))
        longest = max(_task_params(self.recipe, "ppl", None)["lengths"])
        if len(held_out) < longest:
            fail("validation.data", v.data, f"holds {len(held_out)} tokens, fewer than the longest validation length "
                 f"{longest}; add data or lower validation.lengths")
        return held_out

    def run(self, model: torch.nn.Module, autocast: Any, step: int) -> list[dict]:
        """Every task on ``model`` after optimizer step ``step``: one record each, for
        log.jsonl and the trackers. Training resumes exactly where it was."""
        records = []
        was_training = model.training
        model.eval()
        try:
            install_method(model, self.method)  # off the training pattern before any task runs
            with rng_untouched(), torch.no_grad(), autocast:
                for name, task in self.tasks.items():
                    began = time.perf_counter()
                    rows = task.evaluate(model, self.tokenizer, self.method)
                    records.append({"kind": KIND, "step": step, "task": name, "attention": self.method.name,
                                    "seconds": time.perf_counter() - began, "metrics": metrics(name, rows),
                                    "rows": [_brief(r) for r in rows]})
        finally:
            install_method(model, self.training_method)
            model.train(was_training)
        return records

