"""RULER's needle-in-a-haystack tasks: ``niah_single_1..3``, ``niah_multikey_1..3``,
``niah_multivalue``, ``niah_multiquery`` (RULER's ``scripts/synthetic.yaml`` settings).

A needle is "One of the special magic {numbers} for {key} is: {value}."; keys are
``adjective-noun`` words (``sparse_ft.evaluation.words``; RULER's come from ``wonderwords``), 7-digit
numbers or UUIDs. The haystack is one of

* ``noise``: the repeated sentence "The grass is green. The sky is blue. ..." (RULER's, which is
  landmark attention's passkey filler), one per line, needles between lines;
* ``needle``: distractor needles with random keys and values, one per line (never a key that
  is asked: RULER draws from a large enough word list not to check);
* ``essay``: words of a text (``--haystack``, by default the built-in corpus) cut into
  sentences, the needles inserted at depths drawn from RULER's 40 evenly spaced depths.

The question asks for the values of the queried keys; a sample scores the share of them the
answer contains (``string_match_all``). With one value asked, RULER's template turns singular
("A special magic number is hidden ...", "... the provided text is"), and so does this one.
"""

from __future__ import annotations

import random
import re
import uuid
from typing import Any, Sequence

from sparse_ft.evaluation.tasks.base import register
from sparse_ft.evaluation.tasks.generation import GenerationTask, Sample, split_template

# scripts/data/synthetic/constants.py: the task template, then the answer prefix
TEMPLATE = ("Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. "
            "I will quiz you about the {type_needle_v} afterwards.\n{context}\n"
            "What are all the special magic {type_needle_v} for {query} mentioned in the provided text?"
            " The special magic {type_needle_v} for {query} mentioned in the provided text are")
# one value asked: RULER turns the template singular
SINGULAR = TEMPLATE.replace("Some", "A").replace("are all", "is").replace("are", "is").replace("answers", "answer")
NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
DEPTHS = [round(100 * i / 39) for i in range(40)]  # numpy.linspace(0, 100, 40), rounded: RULER's insertion depths (%)


def draw(rng: random.Random, kind: str, keys: Sequence[str]) -> str:
    """A key or value of ``kind``: ``numbers`` (7 digits), ``words`` (one of ``keys``), ``uuids``."""
    if kind == "numbers":
        return str(rng.randint(10**6, 10**7 - 1))
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    return rng.choice(keys)


def split_sentences(text: str) -> list[str]:
    """Sentences at ``.``, ``!`` or ``?`` followed by white space (RULER uses nltk's punkt, a
    download; this rule gives the same cuts on plain prose and leaves ``os.path`` whole)."""
    return [s for s in re.split(r"(?<=[.!?])\s+", text.strip()) if s]


class Niah(GenerationTask):
    """One RULER needle-in-a-haystack variant; the class attributes are its synthetic.yaml settings."""

    haystack = "noise"  # noise | needle | essay
    key_type = "words"
    value_type = "numbers"
    num_keys = 1  # needles' keys (num_needle_k)
    num_values = 1  # values per key (num_needle_v)
    num_queries = 1  # keys asked (num_needle_q)

    def __init__(self, *, tokens_to_generate: int = 128) -> None:
        from attn_patterns.checks import check_int

        self.tokens_to_generate = check_int("tokens_to_generate", tokens_to_generate, self.name)
        self.essay: Sequence[str] = ()

    @property
    def uses_essay(self) -> bool:
        return self.haystack == "essay"

    @property
    def unit(self) -> str:
        return "essay words" if self.uses_essay else "haystack lines"

    @property
    def min_size(self) -> int:
        """Needles go between haystack lines, one per line at least; an essay may be one word."""
        return 1 if self.uses_essay else max(self.num_keys, self.num_queries) * self.num_values

    def setup(self, tokenizer: Any, essay: Sequence[str]) -> None:
        self.essay = essay

    def needles(self, rng: random.Random, size: int) -> tuple[list[str], list[list[str]], str]:
        """Distinct keys (an asked key has one set of values), the values of each, and the
        haystack with the needles in it."""
        keys: list[str] = []
        values: list[list[str]] = []
        while len(keys) < max(self.num_keys, self.num_queries):
            key = draw(rng, self.key_type, self.word_lists.keys)
            if key not in keys:
                keys.append(key)
                values.append([draw(rng, self.value_type, self.word_lists.keys) for _ in range(self.num_values)])
        needles = [NEEDLE.format(type_needle_v=self.value_type, key=k, value=v) for k, vs in zip(keys, values) for v in vs]
        rng.shuffle(needles)
        return keys, values, self._haystack(rng, size, needles, keys)

    def compose(self, rng: random.Random, size: int, *, length: int) -> Sample:
        keys, values, context = self.needles(rng, size)
        asked = rng.sample(range(len(keys)), self.num_queries)
        queries = [keys[i] for i in asked]
        query = queries[0] if len(queries) == 1 else ", ".join(queries[:-1]) + ", and " + queries[-1]
        single = self.num_queries * self.num_values == 1
        head, question = split_template(SINGULAR if single else TEMPLATE, context,
                                        type_needle_v=self.value_type[:-1] if single else self.value_type, query=query)
        return Sample(head, question, tuple(v for i in asked for v in values[i]))

    def reference(self, sample: Sample) -> str:
        return " " + ", ".join(sample.answers) + "."

    def _haystack(self, rng: random.Random, size: int, needles: list[str], keys: list[str]) -> str:
        if self.uses_essay:
            words = list(self.essay) * (size // len(self.essay) + 1)
            sentences = split_sentences(" ".join(words[:size]))
            cuts = sorted(int(len(sentences) * depth / 100) for depth in rng.sample(DEPTHS, len(needles)))
            cuts = [0, *cuts, len(sentences)]
            parts = []
            for index in range(1, len(cuts)):
                parts.append(" ".join(sentences[cuts[index - 1]:cuts[index]]))
                if index - 1 < len(needles):
                    parts.append(needles[index - 1])
            return " ".join(parts)
        from sparse_ft.evaluation.passkey_prompt import FILLER  # RULER's noise: landmark's passkey filler

        lines = [FILLER] * size
        if self.haystack == "needle":
            for index in range(size):
                key = draw(rng, self.key_type, self.word_lists.keys)
                while key in keys:
                    key = draw(rng, self.key_type, self.word_lists.keys)
                lines[index] = NEEDLE.format(type_needle_v=self.value_type, key=key, value=draw(rng, self.value_type, self.word_lists.keys))
        for index, needle in zip(sorted(rng.sample(range(size), len(needles)), reverse=True), needles):
            lines.insert(index, needle)
        return "\n".join(lines)


# scripts/synthetic.yaml
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "niah_single_1": ("one needle (word key, 7-digit value) in noise sentences", {}),
    "niah_single_2": ("one needle (word key, 7-digit value) in essay text", {"haystack": "essay"}),
    "niah_single_3": ("one needle (word key, UUID value) in essay text", {"haystack": "essay", "value_type": "uuids"}),
    "niah_multikey_1": ("four needles in essay text, one asked", {"haystack": "essay", "num_keys": 4}),
    "niah_multikey_2": ("one needle among distractor needles (word keys, 7-digit values)", {"haystack": "needle"}),
    "niah_multikey_3": ("one needle among distractor needles (UUID keys and values)",
                        {"haystack": "needle", "key_type": "uuids", "value_type": "uuids"}),
    "niah_multivalue": ("one key with four values in essay text, all asked", {"haystack": "essay", "num_values": 4}),
    "niah_multiquery": ("four needles in essay text, all asked", {"haystack": "essay", "num_queries": 4}),
}

for _name, (_summary, _settings) in VARIANTS.items():
    register(type(_name, (Niah,), {"name": _name, "summary": f"RULER needle in a haystack: {_summary}",
                                   "__module__": __name__, "__qualname__": _name, **_settings}))
