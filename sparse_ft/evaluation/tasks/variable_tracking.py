"""RULER's variable tracking (``vt``): chains of assignments ``VAR QPRNX = 41027``, ``VAR
ZKWAB = VAR QPRNX``, ... hidden one per line among noise lines; the answer is every variable
of the chain that holds the asked value (``string_match_all``). RULER's ``synthetic.yaml``: one
chain of four hops, noise haystack.

As RULER's generator does, each prompt starts with one worked example (``fewshot``): a chain
of 3-letter variables in noise, fitted to 500 tokens, followed by its answer. RULER makes the
example once and renames its variables and value per sample; here each sample draws its own.
"""

from __future__ import annotations

import random
import string
from typing import Any, Sequence

from sparse_ft.evaluation.tasks.base import register
from sparse_ft.evaluation.tasks.generation import GenerationTask, Sample, largest_fitting, split_template

# scripts/data/synthetic/constants.py: the task template, then the answer prefix
TEMPLATE = ("Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
            "Question: Find all variables that are assigned the value {query} in the text above."
            " Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are "
            "assigned the value {query}, they are: ")
EXAMPLE_TOKENS = 500  # RULER fits its worked example to 500 tokens
EXAMPLE_MIN_NOISE = 5  # and gives it at least 5 noise lines


@register
class VariableTracking(GenerationTask):
    name = "vt"
    summary = "RULER variable tracking: every variable a chain of assignments gives one value"
    unit = "noise lines"

    def __init__(self, *, num_chains: int = 1, num_hops: int = 4, fewshot: bool = True, tokens_to_generate: int = 30) -> None:
        from attn_patterns.checks import check_int

        self.num_chains = check_int("num_chains", num_chains, self.name)
        self.num_hops = check_int("num_hops", num_hops, self.name)
        self.tokens_to_generate = check_int("tokens_to_generate", tokens_to_generate, self.name)
        if not isinstance(fewshot, bool):
            raise ValueError(f"{self.name}: fewshot={fewshot!r} must be true or false")
        self.fewshot = fewshot
        self.example_noise = EXAMPLE_MIN_NOISE

    @property
    def min_size(self) -> int:
        """A chain's assignments go between noise lines, one per line at least."""
        return self.num_hops + 1

    def setup(self, tokenizer: Any, essay: Sequence[str]) -> None:
        """The example's noise: the most lines that keep it within 500 tokens (at least 5)."""
        from sparse_ft.evaluation.prompt_tokens import token_ids

        def fits(size: int) -> bool:
            context, question = self._prompt(random.Random("vt example"), size, example=True)[:2]
            return len(token_ids(tokenizer, context + question)) <= EXAMPLE_TOKENS

        self.example_noise = largest_fitting(fits, EXAMPLE_MIN_NOISE, EXAMPLE_TOKENS, EXAMPLE_MIN_NOISE) or EXAMPLE_MIN_NOISE

    def _prompt(self, rng: random.Random, size: int, *, example: bool) -> tuple[str, str, tuple[str, ...]]:
        """Context, question and answer of a prompt with ``size`` noise lines; an example has
        3-letter variables and at most 10 hops, as RULER's."""
        hops = min(10, self.num_hops) if example else self.num_hops
        chains = self.chains(rng, self.num_chains, hops, letters=3 if example else 5)
        context, question = split_template(TEMPLATE, self.hide(rng, chains, size), query=chains[0][1], num_v=hops + 1)
        return context, question, chains[0][0]

    @staticmethod
    def chains(rng: random.Random, count: int, hops: int, *, letters: int = 5) -> list[tuple[tuple[str, ...], str]]:
        """``count`` chains of ``hops`` assignments: each chain's variables (distinct across
        chains, never ``VAR``) and the value its first one is assigned."""
        names: list[str] = []
        while len(names) < count * (hops + 1):
            name = "".join(rng.choices(string.ascii_uppercase, k=letters))
            if name not in names and name != "VAR":
                names.append(name)
        return [(tuple(names[first:first + hops + 1]), str(rng.randint(10000, 99999))) for first in range(0, len(names), hops + 1)]

    @staticmethod
    def hide(rng: random.Random, chains: Sequence[tuple[tuple[str, ...], str]], size: int) -> str:
        """``chains``' assignments, ``VAR A = value`` then ``VAR B = VAR A`` ..., each chain in
        order at random places among ``size`` noise lines."""
        from sparse_ft.evaluation.passkey_prompt import FILLER  # RULER's noise: landmark's passkey filler

        lines = [FILLER] * size
        for names, value in chains:
            chain = [f"VAR {names[0]} = {value}"] + [f"VAR {names[j + 1]} = VAR {names[j]} " for j in range(len(names) - 1)]
            for offset, position in enumerate(sorted(rng.sample(range(len(lines)), len(chain)))):
                lines.insert(position + offset, chain[offset])
        return "\n".join(lines).replace(". \n", ".\n")

    def compose(self, rng: random.Random, size: int, *, length: int) -> Sample:
        shot = ""
        if self.fewshot:
            context, question, answer = self._prompt(rng, self.example_noise, example=True)
            shot = context + question + " " + " ".join(answer) + "\n\n"
        context, question, answer = self._prompt(rng, size, example=False)
        return Sample(shot + context, question, answer)
