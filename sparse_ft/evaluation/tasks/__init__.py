"""Evaluation tasks, one module each, registered in ``TASKS`` where they are defined:
perplexity (``ppl``), passkey retrieval (``passkey``), RULER's synthetic tasks and their suite
(``ruler``: ``niah_*``, ``vt``, ``cwe``, ``fwe``), lm-evaluation-harness's tasks (``harness``).
``sparse-ft eval NAME`` runs any of them, and the experiment builds its evaluations here too.

    >>> from sparse_ft.evaluation import tasks
    >>> tasks.names()
    >>> tasks.get("passkey", lengths=[1024], depths=[0.5]).evaluate(model, tokenizer, method)

A new task is one module with a ``@register``-ed :class:`Task` subclass (a RULER-style one
subclasses :class:`GenerationTask` and only composes its samples), imported below.
"""

from __future__ import annotations

from sparse_ft.evaluation.tasks.base import TASKS, Task, register
from sparse_ft.evaluation.tasks.generation import GenerationTask, Sample

# the modules whose tasks register themselves on import, in the order `eval --help` lists them
from sparse_ft.evaluation.tasks import perplexity as _perplexity  # noqa: E402,F401
from sparse_ft.evaluation.tasks import passkey as _passkey  # noqa: E402,F401
from sparse_ft.evaluation.tasks import ruler as _ruler  # noqa: E402,F401
from sparse_ft.evaluation.tasks import niah as _niah  # noqa: E402,F401
from sparse_ft.evaluation.tasks import variable_tracking as _variable_tracking  # noqa: E402,F401
from sparse_ft.evaluation.tasks import common_words as _common_words  # noqa: E402,F401
from sparse_ft.evaluation.tasks import frequent_words as _frequent_words  # noqa: E402,F401
from sparse_ft.evaluation.tasks import harness as _harness  # noqa: E402,F401

get, names = TASKS.get, TASKS.names

__all__ = ["TASKS", "GenerationTask", "Sample", "Task", "get", "names", "register"]
