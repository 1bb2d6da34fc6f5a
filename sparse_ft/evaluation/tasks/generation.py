"""Generation tasks: prompts answered by greedy decoding through a method and scored per sample,
all through one loop (:meth:`GenerationTask.answer`): passkey retrieval and RULER's tasks.

A RULER task composes its prompt from a random generator and a haystack size, fitted to a
length in the model's own tokens (the largest haystack whose prompt plus the task's generation
budget fits, as RULER's binary search over the haystack size does), scored by RULER's string
matching. Each is one module: ``niah``, ``variable_tracking``, ``common_words``,
``frequent_words``. The suite that runs them over lengths and reports the effective context
length is ``ruler``; each task's own sub-command is that suite on the task alone. ``passkey``
builds its prompts to an exact length itself and has a command of its own.

RULER's facts used here: the prompt a base model sees, template then answer prefix
(``scripts/data/prepare.py``, ``scripts/pred/call_api.py``); max_seq_length counting the
prompt and the tokens to generate (every generator in ``scripts/data/synthetic/``); the
metrics and the prediction clean-up (``scripts/eval/synthetic/constants.py``,
``scripts/eval/evaluate.py``).
"""

from __future__ import annotations

import argparse
import random
import re
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from sparse_ft.evaluation.names import FLAGS, BadParameter, Names
from sparse_ft.evaluation.tasks.base import TASKS, Task
from sparse_ft.evaluation.words import EVALUATION


# --- scoring (scripts/eval/synthetic/constants.py, scripts/eval/evaluate.py) -------------------
def postprocess(prediction: str) -> str:
    """RULER's ``postprocess_pred``: stripped, control characters turned into newlines."""
    return re.sub(r"[\x00-\x1f]", "\n", prediction.strip()).strip()


def string_match_all(prediction: str, references: Sequence[str]) -> float:
    """The share of the references found in the prediction (case-insensitive substring):
    RULER's metric of every synthetic task, per sample."""
    found = prediction.lower()
    return sum(r.lower() in found for r in references) / len(references)


def string_match_part(prediction: str, references: Sequence[str]) -> float:
    """1 when any reference is found: RULER's metric for its QA tasks, whose references are
    alternative answers."""
    found = prediction.lower()
    return float(any(r.lower() in found for r in references))


METRICS: dict[str, Callable[[str, Sequence[str]], float]] = {
    "string_match_all": string_match_all, "string_match_part": string_match_part}


# --- samples -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Sample:
    """One prompt as RULER writes it for a base model: the template with its haystack, then the
    answer prefix. Kept in two parts: ``context`` ends with the haystack, ``question`` holds the
    query and the answer prefix (ParallelComp ranks context chunks by the question)."""

    context: str
    question: str
    answers: tuple[str, ...]


@dataclass
class Prompt:
    """A sample fitted to a length: its token ids and the haystack size that fitted."""

    sample: Sample
    context_ids: list[int]
    question_ids: list[int]
    size: int

    @property
    def tokens(self) -> int:
        return len(self.context_ids) + len(self.question_ids)

    @property
    def answers(self) -> tuple[str, ...]:
        return self.sample.answers


def split_template(template: str, context: str, **fields: Any) -> tuple[str, str]:
    """``template`` (the task's template and answer prefix) filled, cut after ``{context}``."""
    head, tail = template.split("{context}")
    return head.format(**fields) + context, tail.format(**fields)


def largest_fitting(fits: Callable[[int], bool], low: int, high: int, hint: int) -> Optional[int]:
    """The largest size in ``[low, high]`` that ``fits`` (which holds up to some size and not
    beyond), searched outwards from ``hint`` and then halved: a few probes when the hint is a
    neighbour's size, ``2 log2(n)`` at worst. None when even ``low`` does not fit."""
    if not fits(low):
        return None
    good, bad, step = low, high + 1, 1
    probe = min(max(hint, low), high)
    if fits(probe):
        good = probe
        while good + step < bad and fits(good + step):
            good, step = good + step, step * 2
        bad = min(bad, good + step)
    else:
        bad = probe
        while bad - step > good and not fits(bad - step):
            bad, step = bad - step, step * 2
        good = max(good, bad - step)
    while bad - good > 1:
        middle = (good + bad) // 2
        good, bad = (middle, bad) if fits(middle) else (good, middle)
    return good


def _check_encoded(tokenizer: Any, ids: list[int], what: str) -> None:
    """A prompt with the tokenizer's unknown token asks the model about text it cannot see (a
    needle's key or value lost): refused, naming the first such place."""
    unknown = getattr(tokenizer, "unk_token_id", None)
    if unknown is not None and unknown in ids:
        at = ids.index(unknown)
        raise BadParameter(f"{what}: this tokenizer cannot encode the prompt's text ({ids.count(unknown)} unknown tokens, "
                           f"the first in {tokenizer.decode(ids[max(0, at - 6):at + 6])!r}); use a tokenizer that "
                           "encodes every character (a byte-level one)")


class TooShort(BadParameter):
    """A length below a task's shortest prompt (with the smallest haystack and its budget)."""

    def __init__(self, task: "GenerationTask", length: int, prompt: int, names: Names) -> None:
        self.task, self.length, self.need = task.name, length, prompt + task.tokens_to_generate
        super().__init__(f"{names.entry('lengths', length)} is shorter than the shortest {task.name} prompt: {self.need} "
                         f"tokens of this tokenizer ({prompt} with the smallest haystack, {task.min_size} {task.unit}, + "
                         f"{task.tokens_to_generate} to generate)")


class GenerationTask(Task):
    """A task whose prompts the method answers by greedy decoding, each answer scored
    (:meth:`answer`, :meth:`score`). A RULER task (``ruler_task``) says how a sample is
    composed (:meth:`compose`) and takes its settings (RULER's arguments,
    ``tokens_to_generate``) as constructor parameters; on the command line each is also
    ``sparse-ft eval NAME``: the suite run on that task alone."""

    ruler_task = True  # the ruler suite runs it; False: a task with prompts and a command of its own
    metric = "string_match_all"
    unit = "sentences"  # what the haystack size counts, for messages
    uses_essay = False  # draws its haystack from --haystack (RULER's Paul Graham essays)
    tokens_to_generate = 32
    picture = "heatmap"
    word_lists = EVALUATION  # what it draws words from (an instance may take others: Words)

    @property
    def min_size(self) -> int:
        """The smallest haystack a sample can have."""
        return 1

    @property
    def max_size(self) -> Optional[int]:
        """The largest haystack its words allow (None: it repeats, and memory bounds it)."""
        return None

    def longest(self) -> Optional[tuple[int, str]]:
        """The longest length its settings can build a prompt of, known without a tokenizer,
        and why (None: no bound but memory and :attr:`max_size`)."""
        return None

    @classmethod
    def configure(cls, parser: argparse.ArgumentParser) -> None:
        TASKS.factory("ruler").add_flags(parser, suite=False)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Task:
        return TASKS.factory("ruler").from_args(args, names=[cls.name])

    def setup(self, tokenizer: Any, essay: Sequence[str]) -> None:
        """Before any sample: what depends on the tokenizer or the essay words."""

    def compose(self, rng: random.Random, size: int, *, length: int) -> Sample:
        """One sample with a haystack of ``size`` units, every draw from ``rng`` (fresh for each
        size, so a sample keeps its needles while its haystack is fitted)."""
        raise NotImplementedError

    def fit(self, tokenizer: Any, length: int, *, seed: str, hint: Optional[int] = None, names: Names = FLAGS) -> Prompt:
        """The sample of ``seed`` with the largest haystack whose prompt (a BOS the tokenizer adds
        counted) plus ``tokens_to_generate`` is at most ``length`` tokens. Only the prompts'
        sizes are kept while searching (the one that fits is built again), so a search takes
        the memory of one prompt. ``names``: what a refusal calls the length."""
        from sparse_ft.evaluation.prompt_tokens import leading_specials, token_ids

        specials, tokens = leading_specials(tokenizer), {}

        def build(size: int) -> Prompt:
            sample = self.compose(random.Random(seed), size, length=length)
            prompt = Prompt(sample, specials + token_ids(tokenizer, sample.context), token_ids(tokenizer, sample.question), size)
            tokens[size] = prompt.tokens
            return prompt

        def fits(size: int) -> bool:
            return (tokens[size] if size in tokens else build(size).tokens) + self.tokens_to_generate <= length

        # a unit adds about a token at least: far fewer than 4 x length units fit
        high = 4 * length + self.min_size
        size = largest_fitting(fits, self.min_size, min(high, self.max_size or high), hint or self.min_size)
        if size is None:
            raise TooShort(self, length, tokens[self.min_size], names)
        if size == self.max_size:
            raise BadParameter(f"{names.entry('lengths', length)} is longer than {self.name} can fill: its {size} {self.unit} "
                               f"make prompts of at most {tokens[size] + self.tokens_to_generate} tokens of this tokenizer")
        prompt = build(size)
        _check_encoded(tokenizer, prompt.context_ids + prompt.question_ids, f"{self.name} at {names.entry('lengths', length)}")
        return prompt

    def reference(self, sample: Sample) -> str:
        """The answer as the prompt's own example writes it after the answer prefix: what a
        model trained on such documents learns to generate."""
        return " " + " ".join(sample.answers)

    def score(self, prediction: str, answers: Sequence[str]) -> float:
        """The sample's score in [0, 1], RULER's metric on RULER's clean-up of the prediction."""
        return METRICS[self.metric](postprocess(prediction), answers)

    def budget(self, tokenizer: Any, prompt: Any) -> int:
        """The most tokens the method may generate for ``prompt``."""
        return self.tokens_to_generate

    def answer(self, model: Any, tokenizer: Any, method: Any, prompts: Sequence[Any], *,
               advance: Callable[[], Any] = lambda: None) -> tuple[list[str], list[float]]:
        """The method's greedy answer to each prompt (anything with ``context_ids``,
        ``question_ids`` and ``answers``: a :class:`Prompt`, a passkey prompt), at most
        :meth:`budget` new tokens, and its :meth:`score`: the one generation loop of every
        generation task."""
        import torch

        outputs, scores = [], []
        for prompt in prompts:
            with torch.inference_mode():
                new = method.generate(model, tokenizer, context_ids=prompt.context_ids,
                                      question_ids=prompt.question_ids, max_new_tokens=self.budget(tokenizer, prompt))
            outputs.append(tokenizer.decode(new, skip_special_tokens=True))
            scores.append(self.score(outputs[-1], prompt.answers))
            advance()
        return outputs, scores


def registered_ruler_tasks() -> list[str]:
    """The registered RULER tasks, in registration order (RULER's)."""
    return [n for n in TASKS.names() if getattr(TASKS.factory(n), "ruler_task", False)]
