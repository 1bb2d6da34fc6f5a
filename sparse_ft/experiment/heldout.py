"""RULER's tasks on training-space documents: a score a pretraining phase may train toward.

Issue 33's bar is RULER's own samples at C, which pretraining must never see or tune on. A
phase that trains "until it retrieves" needs a score of its own: the same task, prompt
templates, fitting and greedy scoring as ``sparse-ft eval ruler``, but every word from the
corpus's training split (:func:`retrieval_docs.training_words`), every haystack from its text,
and samples from the seed space ``heldout|...``, which neither the evaluation
(``task|length|sample``) nor the pretraining corpus (``pretrain:{seed}:{index}``) draws from.
"""

from __future__ import annotations

import random
from typing import Any, Optional, Sequence

from sparse_ft.experiment import retrieval_docs
from sparse_ft.experiment.tokenizer import training_texts

TASKS = ("niah_multikey_1",)  # the bar's task that seeds miss (docs/experiment.md: seed 2)


class HeldOut:
    """``samples`` prompts of each task in ``names`` fitted to ``length`` tokens, built once
    (so every call scores the same prompts: a curve, not noise). ``keys``: the needles' keys
    (:func:`retrieval_docs.training_words`), ``rare`` by default: as many BPE pieces as the
    evaluation's keys, where the ``frequent`` ones read seed 2's base 0.98 and RULER 0.79."""

    def __init__(self, tokenizer: Any, names: Sequence[str], *, length: int, samples: int,
                 texts: Optional[Sequence[str]] = None, keys: str = "rare") -> None:
        if samples < 1:
            raise ValueError(f"samples {samples}: must be >= 1")
        texts = list(training_texts()) if texts is None else list(texts)
        essay = [word for text in texts for word in text.split()]
        tasks = retrieval_docs.ruler_tasks(names, tokenizer, retrieval_docs.training_words(texts, keys=keys))
        rng = random.Random("heldout")
        self.tokenizer = tokenizer
        self.prompts: dict[str, tuple[Any, list]] = {}
        for name, task in tasks.items():
            prompts = []
            for index in range(samples):
                if task.uses_essay:
                    start = rng.randrange(max(1, len(essay) - 4 * length))
                    task.setup(tokenizer, essay[start : start + 4 * length])
                prompts.append(task.fit(tokenizer, length, seed=f"heldout|{name}|{length}|{index}"))
            self.prompts[name] = (task, prompts)

    def scores(self, model: Any) -> dict[str, float]:
        """Each task's mean score in [0, 1] for ``model`` with its own (full) attention."""
        from sparse_ft import methods

        full, out = methods.get("full"), {}
        was_training = model.training
        model.eval()
        for name, (task, prompts) in self.prompts.items():
            _, scores = task.answer(model, self.tokenizer, full, prompts)
            out[name] = round(sum(scores) / len(scores), 4)
        model.train(was_training)
        return out
