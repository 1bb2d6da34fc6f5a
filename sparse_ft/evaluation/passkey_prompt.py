"""The passkey prompt (landmark attention's ``run_test.py``, also LongLoRA's
``passkey_retrivial.py``): task, filler, needle, filler, question, joined by newlines. The
evaluator asks it (``sparse_ft.evaluation.tasks.passkey``) and the tiny corpus trains on it
(``sparse_ft.experiment.passkey_docs``), so both see exactly the same text.

Unlike landmark's, the filler is cut in tokens of the model's tokenizer, so the prompt has
exactly the requested length and the needle sits after exactly ``round(depth * filler_tokens)``
filler tokens; both fillers start at the beginning of the repeated filler text, as landmark's do.
"""

from __future__ import annotations

from dataclasses import dataclass

from sparse_ft.evaluation.prompt_tokens import leading_specials, token_ids

TASK = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. "
        "I will quiz you about the important information there.")
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
QUESTION = "What is the pass key? The pass key is"


def needle(key: str) -> str:
    return f"The pass key is {key}. Remember it. {key} is the pass key."


@dataclass
class Prompt:
    """Context and question kept apart: ParallelComp ranks context chunks by the question."""

    context_ids: list[int]  # (BOS,) task, filler, needle, filler
    question_ids: list[int]
    key: str
    needle_token: int  # index in ``ids`` of the needle line (its leading newline)
    filler_tokens: int  # filler tokens in the whole prompt; the needle follows round(depth * this)

    @property
    def ids(self) -> list[int]:
        return self.context_ids + self.question_ids

    @property
    def answers(self) -> tuple[str, ...]:
        return (self.key,)


def _filler(tokenizer, count: int) -> list[int]:
    """The first ``count`` tokens of the filler sentence repeated (space-joined)."""
    per = max(1, len(token_ids(tokenizer, FILLER + " ")))
    repeats = count // per + 2
    ids = token_ids(tokenizer, " ".join([FILLER] * repeats))
    return ids[:count]


def _parts(tokenizer, key: str) -> tuple[list[int], list[int], list[int]]:
    """The prompt without filler: (BOS,) task; needle line; question."""
    return (leading_specials(tokenizer) + token_ids(tokenizer, TASK + "\n"), token_ids(tokenizer, "\n" + needle(key) + "\n"),
            token_ids(tokenizer, "\n" + QUESTION))


def shortest_prompt(tokenizer, keys: list[str]) -> int:
    """The tokens of the longest prompt without filler over ``keys`` (their digits may take
    more or fewer tokens): no shorter length can hold the prompt of every key."""
    return max(sum(map(len, _parts(tokenizer, key))) for key in keys)


def build_prompt(tokenizer, length: int, depth: float, key: str) -> Prompt:
    """A prompt of exactly ``length`` tokens with the needle after ``depth`` (0..1) of the filler."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"needle depth={depth} must be within [0, 1]")
    head, hidden, question = _parts(tokenizer, key)
    room = length - len(head) - len(hidden) - len(question)
    if room < 0:
        raise ValueError(f"passkey length={length} is shorter than the prompt without filler ({length - room} tokens)")
    before = round(depth * room)
    context = head + _filler(tokenizer, before)
    position = len(context)
    context += hidden + _filler(tokenizer, room - before)
    return Prompt(context, question, key, position, room)
