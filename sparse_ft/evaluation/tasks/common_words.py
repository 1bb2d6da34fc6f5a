"""RULER's common-words extraction (``cwe``): a numbered list of words in which ten appear
often and the rest rarely; the answer names the ten (``string_match_all``). RULER's settings:
below 4096 tokens each common word appears 6 times and each other word once, from 4096 on 30
and 3 times (``freq_cw``, ``freq_ucw``); one worked example comes first (20 words, 3 and 1
times; 40 words, 10 and 3 from 4096 on).

Words come from ``sparse_ft.evaluation.words`` (RULER's from the ``wonderwords`` package, a
download here); a list longer than its single words also draws ``adjective-noun`` pairs.
"""

from __future__ import annotations

import random

from sparse_ft.evaluation.tasks.base import register
from sparse_ft.evaluation.tasks.generation import GenerationTask, Sample, split_template

# scripts/data/synthetic/constants.py: the task template, then the answer prefix ("10" there is num_cw)
TEMPLATE = ("Below is a numbered list of words. In these words, some appear more often than others. Memorize the ones "
            "that appear most often.\n{context}\nQuestion: What are the {num_cw} most common words in the above list?"
            " Answer: The top {num_cw} words that appear most often in the list are:")
LONG = 4096  # RULER's repeats change at this length
EXAMPLE_WORDS = {False: (20, 3, 1), True: (40, 10, 3)}  # (words, common repeats, other repeats), by length >= LONG


def numbered(words: list[str]) -> str:
    return " ".join(f"{index}. {word}" for index, word in enumerate(words, 1))


@register
class CommonWords(GenerationTask):
    name = "cwe"
    summary = "RULER common-words extraction: the ten most frequent words of a long list"
    unit = "distinct words"

    def __init__(self, *, freq_cw: int = 30, freq_ucw: int = 3, num_cw: int = 10, num_fewshot: int = 1,
                 tokens_to_generate: int = 120) -> None:
        from attn_patterns.checks import check_int

        self.freq_cw = check_int("freq_cw", freq_cw, self.name)
        self.freq_ucw = check_int("freq_ucw", freq_ucw, self.name)
        self.num_cw = check_int("num_cw", num_cw, self.name)
        self.num_fewshot = check_int("num_fewshot", num_fewshot, self.name, least=0)
        self.tokens_to_generate = check_int("tokens_to_generate", tokens_to_generate, self.name)
        if num_cw > EXAMPLE_WORDS[False][0]:
            raise ValueError(f"{self.name}: num_cw={num_cw} must be <= {EXAMPLE_WORDS[False][0]}, the words of its example")

    @property
    def min_size(self) -> int:
        return self.num_cw

    @property
    def max_size(self) -> int:
        """Every word it draws from, each listed once at least."""
        return len(self.word_lists.pool)

    def pool(self, count: int) -> tuple[str, ...]:
        """What a list of ``count`` distinct words draws from: the single words, and the keys too
        when the single words are too few."""
        words = self.word_lists
        return words.single if count <= len(words.single) else words.pool

    def listing(self, rng: random.Random, count: int, common: int, other: int) -> tuple[str, list[str]]:
        """A numbered list of ``count`` words drawn from :meth:`pool`, the first ``num_cw`` of
        them listed ``common`` times and the rest ``other`` times, shuffled; and those first."""
        chosen = rng.sample(self.pool(count), count)
        listed = chosen[:self.num_cw] * common + chosen[self.num_cw:] * other
        rng.shuffle(listed)
        return numbered(listed), chosen[:self.num_cw]

    def compose(self, rng: random.Random, size: int, *, length: int) -> Sample:
        shots = ""
        for _ in range(self.num_fewshot):
            context, answer = self.listing(rng, *EXAMPLE_WORDS[length >= LONG])
            shots += "".join(split_template(TEMPLATE, context, num_cw=self.num_cw)) + " " + numbered(answer) + "\n"
        repeats = (self.freq_cw, self.freq_ucw) if length >= LONG else (6, 1)
        context, answer = self.listing(rng, size, *repeats)
        head, question = split_template(TEMPLATE, context, num_cw=self.num_cw)
        return Sample(shots + head, question, tuple(answer))

    def reference(self, sample: Sample) -> str:
        return " " + numbered(list(sample.answers))
