"""Retrieval documents for the tiny base's pretraining corpus: RULER's prompts, answered.

A base forms retrieval heads only if its pretraining asks it to retrieve, at every depth and
distance it will be evaluated at (issue 33: a base trained on passkeys alone copied from a few
tokens back and retrieved by luck of the seed). So besides passkey documents the corpus may
hold every RULER task's prompt, in the evaluation's own templates, followed by its answer as
the prompt's examples write it (:meth:`GenerationTask.reference`): the needle tasks, variable
tracking, common and frequent words. What keeps training and evaluation apart:

- other words: needle keys and common-words pools come from :func:`training_words`, words of
  the standard library's text that none of the evaluation's lists holds;
- other draws: a document's random stream is seeded ``"pretrain:{seed}:{index}"``, a space
  the evaluation's seeds (``task|length|sample``) never take;
- lengths drawn uniformly up to the block (from the task's shortest prompt), so needles sit at
  every depth and distance inside the context.

Answers are a few tokens per document, too sparse a signal to form copy heads from scratch: the
first BPE base, trained on every kind above for 13M tokens, copied nothing at all (its loss on
the second copy of a repeated span was its loss on the first). :func:`copy_document` is the
dense signal: text, then a span of training words and numbers repeated to the document's end,
every token of which past the first copy is predictable only by finding it in the copy before.
The numbers matter: a base whose spans were words only copied words and not a passkey's digits
(each digit is one token, common everywhere, so copying one needs the tokens before it too).
"""

from __future__ import annotations

import copy
import functools
import math
import random
import re
import string
from collections import Counter
from typing import Any, Iterable, Sequence

from sparse_ft.evaluation.tasks.generation import Sample, split_template
from sparse_ft.evaluation.tasks import common_words, variable_tracking
from sparse_ft.evaluation.tasks.niah import SINGULAR, TEMPLATE, Niah
from sparse_ft.evaluation.words import EVALUATION, Words

# single words and keys of each kind: RULER's pools are ~800 words and ~90k keys
SINGLE_WORDS = 600
KEY_PARTS = 300
RARE_KEYS_FROM = 3300  # of the ~7,300 usable words of the standard library (training_words)
KEY_RANKS = {"frequent": 0, "rare": RARE_KEYS_FROM}  # where each kind of key's parts begin (before: the common words)
DRILL = SINGULAR.split("?")[-1]  # RULER's answer sentence: " The special magic {type_needle_v} for {query} ... is"
DRILL_SHARE = 0.85  # of what a lookup document's head, needles and question leave: the rest haystack


def training_words(texts: Iterable[str], *, keys: str = "frequent") -> Words:
    """The most frequent lowercase words (4-10 letters) of ``texts`` (the corpus's training
    split) that the evaluation's lists do not hold, ranked by count then spelling (the same
    on every machine with the same Python): the first ``SINGLE_WORDS`` as common words, keys
    as pairs of ``2 × KEY_PARTS`` more (first half, second half), like ``adjective-noun``
    (fewer of each from a small text). ``keys``: ``frequent`` takes the parts right after the
    common words; ``rare`` from rank ``RARE_KEYS_FROM`` on, words seen 3-6 times in the
    standard library, which the base's BPE splits as finely as the evaluation's English keys
    (6.4 pieces a key, as the evaluation's, against 4.8 for ``frequent``): a base that matches
    the short keys can still miss RULER's long ones (seed 2: 0.98 against 0.79)."""
    if keys not in KEY_RANKS:
        raise ValueError(f"keys={keys!r}: one of {', '.join(KEY_RANKS)}")
    taken = set(EVALUATION.single) | {part for key in EVALUATION.keys for part in key.split("-")}
    counts: Counter[str] = Counter()
    for text in texts:
        counts.update(w for w in re.findall(r"\b[a-z]{4,10}\b", text) if w not in taken)
    ranked = sorted(counts, key=lambda w: (-counts[w], w))
    cut = min(SINGLE_WORDS, len(ranked) // 3)  # a small text (tests) still gives all three lists
    part = min(KEY_PARTS, (len(ranked) - cut) // 2)
    if part < 2:
        raise ValueError(f"the training text holds {len(ranked)} usable words; RULER's documents need a dozen at least")
    start = max(cut, min(KEY_RANKS[keys], len(ranked) - 2 * part))
    first, second = ranked[start : start + part], ranked[start + part : start + 2 * part]
    return Words(single=tuple(ranked[:cut]), keys=tuple(f"{a}-{b}" for a in first for b in second))


def ruler_tasks(names: Sequence[str], tokenizer, words: Words) -> dict[str, Any]:
    """The RULER tasks ``names`` (registered names, or :data:`TRAINING_ONLY`'s) with their
    defaults, drawing ``words``, set up for ``tokenizer`` (the essay haystack is set per document)."""
    from sparse_ft.evaluation.tasks import TASKS

    built = {}
    for name in names:
        task = built[name] = TRAINING_ONLY[name]() if name in TRAINING_ONLY else TASKS.get(name)
        task.word_lists = words
        task.setup(tokenizer, ())
    return built


def retrieval_document(task: Any, tokenizer, max_tokens: int, rng: random.Random, *, seed: str,
                       essay: Sequence[str], full: bool = False) -> list[int]:
    """Token ids of ``task``'s prompt fitted to a length drawn in ``[max_tokens / 4,
    max_tokens]`` (its shortest prompt at least; ``max_tokens`` itself when ``full``), then its
    reference answer. ``seed`` names the sample's stream; ``essay`` the words an essay haystack
    starts from. Raises ``ValueError`` when even ``max_tokens`` cannot hold the task's shortest
    prompt."""
    from sparse_ft.evaluation.names import BadParameter

    if task.uses_essay:
        task.setup(tokenizer, essay)
    length = max_tokens if full else rng.randint(max_tokens // 4 + 1, max_tokens)
    for tried in (length, max_tokens):
        try:
            prompt = task.fit(tokenizer, tried, seed=seed)
            break
        except BadParameter:  # shorter than the task's shortest prompt, or longer than its words fill
            continue
    else:
        raise ValueError(f"{task.name}: no prompt of it fits {max_tokens} tokens of this tokenizer; raise the context")
    answer = tokenizer(task.reference(prompt.sample), add_special_tokens=False)["input_ids"]
    return prompt.context_ids + prompt.question_ids + answer


class Lookup(Niah):
    """Training only, never registered: 2 to 8 needles of RULER's form (keys and values of a
    kind drawn per document; 4 to 8 where they fit in a third of the document) in a haystack
    of a kind drawn per document, then one key asked in RULER's words, then drills: RULER's
    answer sentence for every key in turn and then keys drawn at random, each with its value,
    over about ``DRILL_SHARE`` of what the needles leave. A RULER document trains one lookup in
    a thousand tokens; this one trains a dozen or more among many needles, most of them not the
    nearest: the dense signal for matching a key with the needle that holds it (a base trained on
    RULER's documents alone answered niah_multikey_1 with a needle at random, 0.2-0.3), as copy
    documents are the dense signal for copying. Mixed into pretraining they did not form key
    matching on their own (niah_multikey_1 0.35-0.55); after a phase of drills alone
    (``scripts/probe_drills.py``), which forms it, they carried it to 1.00 (docs/experiment.md,
    "A drills phase")."""

    name = "lookup"
    haystack = "essay"  # the task's: essay words are set up for it; each document draws its own kind
    min_size = 1

    def __init__(self) -> None:
        super().__init__(tokens_to_generate=1)  # nothing is generated: the document fills its length

    def compose(self, rng: random.Random, size: int, *, length: int) -> Sample:
        shape = copy.copy(self)  # this document's kinds, drawn from its own stream
        shape.haystack = rng.choice(("noise", "needle", "essay"))
        shape.key_type = rng.choice(("words", "words", "uuids"))
        shape.value_type = rng.choice(("numbers", "numbers", "uuids", "words"))
        # BPE tokens of a needle: 26 with a word key and a number, a UUID key or value adds 28;
        # a drill 4 more, the question 25 more than a drill; 150 for the template's head; a noise
        # or needle haystack holds a line per needle at least (half as much again)
        needle = 26 + 28 * (shape.key_type == "uuids") + 28 * (shape.value_type == "uuids")
        room = length - 150 - needle - 29
        line = needle * (2 if shape.uses_essay else 3) // 2
        shape.num_keys = max(2, min(rng.randint(4, 8), room // (3 * line)))
        drills = max(shape.num_keys, int(DRILL_SHARE * (room - shape.num_keys * line)) // (needle + 4))
        keys, values, context = shape.needles(rng, size if shape.uses_essay else max(size, shape.num_keys))
        head, _ = split_template(TEMPLATE, context, type_needle_v=shape.value_type, query="")
        one = shape.value_type[:-1]
        first = rng.randrange(len(keys))
        order = rng.sample(range(len(keys)), len(keys)) + rng.choices(range(len(keys)), k=drills - len(keys))
        asked = [split_template(SINGULAR, "", type_needle_v=one, query=keys[first])[1] + f" {values[first][0]}."]
        asked += [DRILL.format(type_needle_v=one, query=keys[i]) + f" {values[i][0]}." for i in order]
        return Sample(head, "".join(asked), ())

    def reference(self, sample: Sample) -> str:
        return ""  # the answers are in the questions' text


class VariableDrills(variable_tracking.VariableTracking):
    """Training only, never registered: 2 to 4 chains of RULER's variable tracking (2 to 4
    hops) among noise lines, then RULER's question for one chain's value with its answer, then
    drills: the same question for every chain in turn and then chains at random, each answered,
    over about ``DRILL_SHARE`` of what the chains and the least noise leave. A RULER ``vt``
    document trains one value-to-variables lookup in a thousand tokens, and every base trained
    on them answered vt with variables of the right form but not the prompt's (0.0 on every
    seed): this one trains several, as :class:`Lookup` does for the needles."""

    name = "vt_drills"

    def __init__(self) -> None:
        super().__init__(fewshot=False, tokens_to_generate=1)  # nothing is generated: the document fills its length

    def compose(self, rng: random.Random, size: int, *, length: int) -> Sample:
        hops, count = rng.choice((2, 3, 4, 4)), rng.randint(2, 4)
        chains = self.chains(rng, count, hops)
        # BPE tokens: the template's head 25, a noise line 38, an assignment 13, the question
        # with its value twice 80, a variable in the answer 5
        room = length - 25 - count * (hops + 1) * 13 - self.min_size * 38
        drills = max(count, int(DRILL_SHARE * room) // (80 + 5 * (hops + 1)))
        order = rng.sample(range(count), count) + rng.choices(range(count), k=drills - count)
        head, _ = split_template(variable_tracking.TEMPLATE, self.hide(rng, chains, size), query="", num_v=0)
        asked = [split_template(variable_tracking.TEMPLATE, "", query=chains[i][1], num_v=hops + 1)[1]
                 + " " + " ".join(chains[i][0]) + "\n" for i in [rng.randrange(count), *order]]
        return Sample(head, "".join(asked), ())

    def reference(self, sample: Sample) -> str:
        return ""  # the answers are in the questions' text


@functools.lru_cache(maxsize=4)
def every_word(words: Words) -> tuple[str, ...]:
    """``words``' single words, then the halves of its keys, each once."""
    return tuple(dict.fromkeys(words.single + tuple(part for key in words.keys for part in key.split("-"))))


class CommonWordsDrills(common_words.CommonWords):
    """Training only, never registered: RULER's common-words question asked of numbered lists
    one after another, each answered in RULER's words. A list has ``num_cw`` + 2 to 20 words
    (RULER's example has 20; its own list at 1,024 BPE tokens 14 to 21), the common ones listed
    3 times (as in the example) or 6 (as in its lists below 4,096 tokens) and the others once.

    Its words are the training words (single words and the keys' halves) that the tokenizer
    writes in two tokens or more. The evaluation's are such words (91 % of them with the
    committed BPE tokenizer), and answering with one means copying its pieces in order; RULER's
    ``cwe`` documents drew the most frequent training words, 95 % of them one token each, and
    every base trained on those answered cwe with training words not in the list (0.0 on every
    seed). A full block of 1,024 BPE tokens holds two lists."""

    name = "cwe_drills"
    unit = "lists"
    max_size = 64  # lists: more than any context this tiny base is pretrained at holds

    def __init__(self) -> None:
        super().__init__(num_fewshot=0, tokens_to_generate=1)  # nothing is generated: the document fills its length
        self.words: tuple[str, ...] = ()

    @property
    def min_size(self) -> int:
        return 1

    def setup(self, tokenizer: Any, essay: Sequence[str]) -> None:
        from sparse_ft.evaluation.prompt_tokens import token_ids

        self.words = tuple(w for w in every_word(self.word_lists) if len(token_ids(tokenizer, " " + w)) > 1)
        if len(self.words) < self.num_cw + 20:
            raise ValueError(f"{self.name}: {len(self.words)} training words take two tokens or more with this tokenizer; "
                             f"a list needs {self.num_cw + 20}")

    def pool(self, count: int) -> tuple[str, ...]:
        return self.words

    def compose(self, rng: random.Random, size: int, *, length: int) -> Sample:
        lists = []
        for _ in range(size):
            context, answer = self.listing(rng, self.num_cw + rng.randint(2, 20), rng.choice((3, 6)), 1)
            head, question = split_template(common_words.TEMPLATE, context, num_cw=self.num_cw)
            lists.append(head + question + " " + common_words.numbered(answer) + "\n")
        return Sample("".join(lists), "", ())

    def reference(self, sample: Sample) -> str:
        return ""  # the answers are in the document's text


class PseudoWordsDrills(CommonWordsDrills):
    """Training only: :class:`CommonWordsDrills` on made-up words, a piece that starts a word and
    one to three that continue one, drawn from the tokenizer's own lowercase pieces (the
    evaluation's words are written so: " sweater" is " s", "we", "ater"). Drilled on training
    words, a base wrote the ten common words about half the time on new lists of those words and
    never on the evaluation's: it had learned the words, not to copy from the list. With thousands
    of words each seen in a few lists, copying a listed word's pieces is the only answer."""

    name = "cwe_pseudo_drills"
    count = 20_000

    def setup(self, tokenizer: Any, essay: Sequence[str]) -> None:
        from sparse_ft.evaluation.prompt_tokens import token_ids

        pieces = [tokenizer.decode([i]) for i in range(len(tokenizer))]
        starts = [p[1:] for p in pieces if re.fullmatch(" [a-z]{1,3}", p)]
        follows = [p for p in pieces if re.fullmatch("[a-z]{1,4}", p)]
        if not starts or not follows:
            raise ValueError(f"{self.name}: the tokenizer has no short lowercase pieces that start a word (' ab') and "
                             "continue one ('ab'); made-up words need both")
        rng, taken, words = random.Random(self.name), set(every_word(EVALUATION)), set()
        while len(words) < self.count:  # the evaluation's words: 3 to 10 letters, 2 to 4 tokens
            word = rng.choice(starts) + "".join(rng.choices(follows, k=rng.randint(1, 3)))
            if 3 <= len(word) <= 10 and word not in taken and 2 <= len(token_ids(tokenizer, " " + word)) <= 4:
                words.add(word)
        self.words = tuple(sorted(words))


# documents a corpus may mix in by name (``--retrieval-tasks``) that evaluation never asks: not in ``all``
TRAINING_ONLY = {task.name: task for task in (VariableDrills, CommonWordsDrills, PseudoWordsDrills)}


COPY_NAMES = 0.5  # the share of names in a piece span: half, as every piece span drew before it could be set


def copy_document(tokenizer, max_tokens: int, rng: random.Random, *, words: Sequence[str],
                  essay: Sequence[str], full: bool = False, pieces: Sequence[int] = (),
                  names: float = COPY_NAMES) -> list[int]:
    """Token ids of essay text, then a span of random ``words`` and numbers (half each, 1 to 7
    digits: the keys and values the evaluation asks for) repeated to the end: ``max_tokens / 4``
    to ``max_tokens`` tokens, the span from 4 tokens to half of them (log-uniform, so that short
    spans repeated many times are as common as long ones repeated twice), so that most of the
    document is predictable by copying, from every distance the context allows. ``full``: exactly
    ``max_tokens`` tokens. ``pieces``: the span is ids drawn uniformly from these and names of 3
    to 5 random capital letters (half each) instead, any token after any other (copy heads formed
    on words copied only the words trained on: none of the evaluation's unseen words, written in
    pieces never seen in that order) and runs of a few letters repeated across the span (vt's
    variables: a base copying random ids still wrote no variable's letters after its first).
    ``names``: the share of the span's items that are names; at 0 the span is ids alone, the form
    that makes copying generic fastest (a name's letters recur within a span, so the token before
    a letter does not say which comes next). Every item draws a name, used or not, so that
    ``COPY_NAMES`` draws what was drawn before the share existed."""
    length = max_tokens if full else rng.randint(max_tokens // 4 + 1, max_tokens)
    span = max(4, int(math.exp(rng.uniform(math.log(4), math.log(max(4, length // 2))))))
    if pieces:
        ids = []
        while len(ids) < span:
            name = " " + "".join(rng.choices(string.ascii_uppercase, k=rng.randint(3, 5)))
            ids += [rng.choice(pieces)] if rng.random() < 1 - names else tokenizer(name, add_special_tokens=False)["input_ids"]
        ids = ids[:span]
    else:
        items = (rng.choice(words) if rng.random() < 0.5 else str(rng.randrange(10 ** rng.randint(1, 7))) for _ in range(span))
        draws = " " + " ".join(items)  # a word or number is at least one token
        ids = tokenizer(draws, add_special_tokens=False)["input_ids"][:span]
    text = rng.randint(0, length - 2 * len(ids))
    start = rng.randrange(max(1, len(essay) - text))
    filler = tokenizer(" " + " ".join(essay[start : start + text]), add_special_tokens=False)["input_ids"][:text]
    copies = -(-(length - len(filler)) // len(ids))
    return filler + (ids * copies)[: length - len(filler)]
