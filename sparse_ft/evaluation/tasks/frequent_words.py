"""RULER's frequent-words extraction (``fwe``): coded words (random lowercase strings) whose
counts follow a Zipf law, count(k) = int(n k^-alpha / zeta(alpha)) for rank k; the most
frequent "word" is ``...`` (noise the prompt says to ignore), and the answer names ranks 2-4
(``string_match_all``). RULER's settings: alpha 2, 6-letter words, a vocabulary of one word
per 50 tokens of the length.
"""

from __future__ import annotations

import math
import random
import string
from typing import Optional

from sparse_ft.evaluation.tasks.base import register
from sparse_ft.evaluation.tasks.generation import GenerationTask, Sample, split_template

# scripts/data/synthetic/constants.py: the task template, then the answer prefix
TEMPLATE = ("Read the following coded text and track the frequency of each coded word. Find the three most frequently "
            "appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore the dots '....'. "
            "What are the three most frequently appeared words in the above coded text?"
            " Answer: According to the coded text above, the three most frequently appeared words are:")
NOISE = "..."


def zeta(alpha: float, terms: int = 1000) -> float:
    """Riemann's zeta for alpha > 1 (RULER calls scipy's): the first terms summed, the tail by
    Euler-Maclaurin, exact to about 1e-15 for alpha >= 1.1."""
    head = math.fsum(k ** -alpha for k in range(1, terms))
    return head + terms ** (1 - alpha) / (alpha - 1) + terms ** -alpha / 2 + alpha * terms ** (-alpha - 1) / 12


@register
class FrequentWords(GenerationTask):
    name = "fwe"
    summary = "RULER frequent-words extraction: the three most frequent coded words of a Zipf-distributed text"
    unit = "coded words"

    def __init__(self, *, alpha: float = 2.0, coded_wordlen: int = 6, vocab_size: "int | None" = None,
                 tokens_to_generate: int = 50) -> None:
        from attn_patterns.checks import check_int

        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not alpha > 1:
            raise ValueError(f"{self.name}: alpha={alpha!r} must be a number > 1")
        self.alpha = float(alpha)
        self.coded_wordlen = check_int("coded_wordlen", coded_wordlen, self.name, least=2)
        self.vocab_size = None if vocab_size is None else check_int("vocab_size", vocab_size, self.name, least=4)
        if self.vocab_size is not None and self.vocab_size > self.words:
            raise ValueError(f"{self.name}: vocab_size={vocab_size} must be <= {self.words:,}, half of the "
                             f"{self.coded_wordlen}-letter words")
        self.tokens_to_generate = check_int("tokens_to_generate", tokens_to_generate, self.name)

    @property
    def min_size(self) -> int:
        """The fewest words in which the answer's last word (rank 4) still appears."""
        return math.ceil(4 ** self.alpha * zeta(self.alpha))

    @property
    def words(self) -> int:
        """The distinct coded words a vocabulary may draw: half of those of ``coded_wordlen``
        letters (drawn at random until distinct, the last of all of them would take forever)."""
        return 26 ** self.coded_wordlen // 2

    def longest(self) -> Optional[tuple[int, str]]:
        """Without ``vocab_size`` the vocabulary is a word per 50 tokens of the length."""
        if self.vocab_size is not None:
            return None
        return (50 * (self.words + 1) + self.tokens_to_generate - 1,
                f"a coded word per 50 tokens, and {self.coded_wordlen}-letter words give {self.words:,} (half of 26^"
                f"{self.coded_wordlen}); raise coded_wordlen or set vocab_size")

    def compose(self, rng: random.Random, size: int, *, length: int) -> Sample:
        count = self.vocab_size or max(4, (length - self.tokens_to_generate) // 50)
        vocab: set[str] = set()
        while len(vocab) < count:
            vocab.add("".join(rng.choices(string.ascii_lowercase, k=self.coded_wordlen)))
        ranked = sorted(vocab)
        rng.shuffle(ranked)
        ranked[0] = NOISE
        norm = zeta(self.alpha)
        words = [word for rank, word in enumerate(ranked, 1) for _ in range(int(size * rank ** -self.alpha / norm))]
        rng.shuffle(words)
        head, question = split_template(TEMPLATE, " ".join(words))
        return Sample(head, question, tuple(ranked[1:4]))
