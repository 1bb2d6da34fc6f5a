"""The tiny base's corpus (``sparse_ft.experiment.corpus``): deterministic bytes for the same
settings, train/validation split and whole blocks, passkey documents that fit their block,
hold the needle and use the evaluator's own prompt, RULER's documents answered in the
training word lists; bad arguments named."""

import hashlib
import random
import string
from collections import Counter

import pytest

from sparse_ft.experiment.corpus import build_corpus, fits_one, is_validation, load_blocks
from sparse_ft.experiment.passkey_docs import passkey_document
from sparse_ft.evaluation.passkey_prompt import QUESTION, build_prompt, needle
from sparse_ft.data.stdlib_text import iter_stdlib_documents
from sparse_ft.evaluation.tokens import load_tokens
from sparse_ft.modeling.tiny import tiny_tokenizer

MODULES = ("heapq", "textwrap", "string", "fractions", "queue", "bisect")


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


def _val_percent() -> float:
    """Hold out exactly the module with the lowest hash bucket, whatever this Python's sources are."""
    buckets = sorted(int(hashlib.sha256(t.encode()).hexdigest()[:8], 16) % 10000 for t in iter_stdlib_documents(MODULES))
    return (buckets[0] + buckets[1]) / 200


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, tokenizer):
    out = tmp_path_factory.mktemp("corpus")
    return out, build_corpus(out, tokenizer, context=256, retrieval_fraction=0.5, val_percent=_val_percent(), modules=MODULES)


def test_corpus_is_deterministic(corpus, tokenizer, tmp_path):
    out, manifest = corpus
    again = build_corpus(tmp_path, tokenizer, context=256, retrieval_fraction=0.5, val_percent=_val_percent(), modules=MODULES)
    assert again == manifest
    for name in ("train.bin", "val.bin"):
        assert (tmp_path / name).read_bytes() == (out / name).read_bytes()
    other = build_corpus(tmp_path / "seed1", tokenizer, context=256, retrieval_fraction=0.5, val_percent=_val_percent(),
                         modules=MODULES, seed=1)
    assert other["sha256"]["train.bin"] != manifest["sha256"]["train.bin"]
    assert other["sha256"]["val.bin"] == manifest["sha256"]["val.bin"]  # the split does not depend on the seed


def test_splits_and_blocks(corpus, tokenizer):
    out, manifest = corpus
    assert manifest["files"] == {"train": len(MODULES) - 1, "validation": 1}
    blocks = load_blocks(out)
    assert blocks.shape == (manifest["train_blocks"], 256)
    starts = [tokenizer.decode(b[:60].tolist()) for b in blocks]
    questions = sum(("What is the pass key?" in tokenizer.decode(b.tolist())) for b in blocks)
    assert questions >= manifest["passkey_blocks"] > 0.3 * len(blocks)
    assert any(s.startswith("There is an important info") for s in starts)
    val = load_tokens(str(out / "val.bin"), tokenizer, 384)
    assert len(val) == manifest["val_tokens"] and "What is the pass key" not in tokenizer.decode(val[:5000].tolist())
    held_out = [t for t in iter_stdlib_documents(MODULES) if is_validation(t, _val_percent())]
    assert tokenizer.decode(val[:200].tolist()) == held_out[0][:200]


def test_passkey_documents_fit_and_hold_the_needle(tokenizer):
    rng = random.Random(0)
    with_task = 0
    for _ in range(100):
        ids, key = passkey_document(tokenizer, 255, rng)
        text = tokenizer.decode(ids)
        assert len(ids) <= 255
        assert needle(key) in text and text.endswith(f"{QUESTION} {key}.")
        with_task += text.startswith("There is an important info")
    assert 20 < with_task < 80


def test_passkey_documents_use_the_evaluators_prompt(tokenizer):
    rng = random.Random(3)
    for _ in range(20):
        ids, key = passkey_document(tokenizer, 255, rng)
        if tokenizer.decode(ids).startswith("There is"):
            prompt = build_prompt(tokenizer, len(ids) - 7, 0.0, key)
            assert ids[: len(prompt.ids)][:150] == prompt.ids[:150]
            return
    pytest.fail("no document kept the task header")


def test_bad_arguments_name_the_value(tokenizer, tmp_path):
    with pytest.raises(ValueError, match="retrieval_fraction=2"):
        build_corpus(tmp_path, tokenizer, retrieval_fraction=2, modules=MODULES)
    with pytest.raises(ValueError, match="max_tokens=50"):
        passkey_document(tokenizer, 50, random.Random(0))


def test_ruler_documents_open_blocks_with_their_answers_and_training_words(tmp_path):
    """With RULER's kinds (BPE: their prompts need ~1k tokens) every block opens with a prompt in
    the evaluation's template and its reference answer, then EOS; keys and word pools are the
    training lists, disjoint from every word the evaluation draws."""
    from sparse_ft.evaluation.words import EVALUATION
    from sparse_ft.experiment.pretrain import PretrainConfig, tokenizer_for
    from sparse_ft.experiment.retrieval_docs import training_words

    words = training_words(t for t in iter_stdlib_documents(MODULES) if not is_validation(t, _val_percent()))
    assert not set(words.single) & set(EVALUATION.pool) and not set(words.keys) & set(EVALUATION.keys)
    bpe = tokenizer_for(PretrainConfig(tokenizer="bpe"))
    kinds = ["niah_single_1", "vt", "cwe"]
    manifest = build_corpus(tmp_path, bpe, context=1024, retrieval_fraction=1.0, modules=MODULES, val_percent=_val_percent(),
                            max_blocks=6, retrieval_tasks=kinds, seed=3)
    assert manifest["retrieval_tasks"] == kinds and sum(manifest["retrieval_blocks"].values()) == 6
    for block in load_blocks(tmp_path):
        ids = list(block)
        text = bpe.decode(ids[: ids.index(bpe.eos_token_id)])
        if "special magic number" in text:
            key = text.rsplit("for ", 1)[1].split(" mentioned")[0]
            assert key in words.keys and text.endswith(".") and text.rsplit(" ", 1)[1][:-1].isdigit()
        elif "VAR " in text:
            assert text.rstrip().split()[-1].isupper()
        else:
            assert "most common words" in text and text.split()[-1] in words.single


def test_text_passes_lay_the_text_out_again_with_fresh_documents(corpus, tokenizer, tmp_path):
    _, once = corpus
    twice = build_corpus(tmp_path, tokenizer, context=256, retrieval_fraction=0.5, val_percent=_val_percent(), modules=MODULES,
                         text_passes=2)
    assert twice["text_passes"] == 2 and abs(twice["train_blocks"] - 2 * once["train_blocks"]) <= 0.05 * once["train_blocks"]
    blocks = load_blocks(tmp_path)
    half = len(blocks) // 2
    assert not any((blocks[i] == blocks[half + i]).all() for i in range(half))  # the second pass draws anew
    with pytest.raises(ValueError, match=r"^text_passes=0 must be an integer >= 1$"):
        build_corpus(tmp_path / "x", tokenizer, context=256, modules=MODULES, val_percent=_val_percent(), text_passes=0)


def test_copy_documents_repeat_a_span_of_training_words_and_numbers_after_text(corpus, tokenizer, tmp_path):
    """A copy block opens with text, then a span of training words and numbers repeated at least twice to
    the document's end, then EOS; with copy_fraction 0 the corpus is the one drawn before copy
    documents existed (the fixture's)."""
    from sparse_ft.experiment.retrieval_docs import copy_document, training_words

    words = training_words(t for t in iter_stdlib_documents(MODULES) if not is_validation(t, _val_percent()))
    rng = random.Random(5)
    essay = "one two three four".split() * 100
    numbers = 0
    for _ in range(20):
        ids = copy_document(tokenizer, 255, rng, words=words.single, essay=essay)
        assert 255 // 4 < len(ids) <= 255
        period = next(p for p in range(4, len(ids) // 2 + 1) if ids[-2 * p : -p] == ids[-p:])
        pieces = tokenizer.decode(ids[-2 * period :]).split()
        assert all(piece.isdigit() or any(w.find(piece) >= 0 for w in words.single) for piece in pieces)  # words, or parts where cut
        numbers += sum(piece.isdigit() for piece in pieces)
    assert numbers > 20  # digits to copy, as a passkey's
    manifest = build_corpus(tmp_path, tokenizer, context=256, retrieval_fraction=0.25, copy_fraction=0.5, modules=MODULES,
                            val_percent=_val_percent())
    assert manifest["copy_blocks"] > 0.4 * manifest["train_blocks"] and manifest["copy_fraction"] == 0.5
    assert corpus[1]["copy_blocks"] == 0
    with pytest.raises(ValueError, match=r"^copy_fraction=0.6 must be within \[0, 1 - retrieval_fraction=0.5\]$"):
        build_corpus(tmp_path / "x", tokenizer, context=256, retrieval_fraction=0.5, copy_fraction=0.6, modules=MODULES)


def test_piece_copies_repeat_a_span_of_any_training_ids(corpus, tokenizer, tmp_path):
    """With copy_pieces 1 every copy document repeats a span of ids drawn from the training text's
    own ids, in any order, and of names of capital letters (vt's variables); the manifest counts
    them among the copy blocks; with 0 nothing is drawn for it (the fixture's corpus, unchanged)."""
    from sparse_ft.experiment.retrieval_docs import copy_document

    rng = random.Random(3)
    pool = list(range(300, 400))
    letters = set(tokenizer(" " + string.ascii_uppercase, add_special_tokens=False)["input_ids"])
    drawn: Counter[str] = Counter()
    for _ in range(10):
        ids = copy_document(tokenizer, 255, rng, words=["unused"], essay="one two three four".split() * 100, pieces=pool)
        period = next(p for p in range(4, len(ids) // 2 + 1) if ids[-2 * p : -p] == ids[-p:])
        assert set(ids[-period:]) <= set(pool) | letters
        drawn.update("piece" if i in pool else "letter" for i in ids[-period:])
    assert drawn["piece"] > 10 and drawn["letter"] > 2 * drawn["piece"]  # half the items; a name is a space and 3 to 5 letters
    for _ in range(5):  # names=0: ids alone, the span that makes copying generic fastest
        ids = copy_document(tokenizer, 255, rng, words=["unused"], essay=["one"] * 400, pieces=pool, names=0.0)
        period = next(p for p in range(4, len(ids) // 2 + 1) if ids[-2 * p : -p] == ids[-p:])
        assert set(ids[-period:]) <= set(pool)
    assert corpus[1]["copy_pieces"] == 0.0 and corpus[1]["copy_pieces_blocks"] == 0
    manifest = build_corpus(tmp_path, tokenizer, context=256, retrieval_fraction=0.25, copy_fraction=0.5, copy_pieces=1.0,
                            modules=MODULES, val_percent=_val_percent())
    assert manifest["copy_pieces_blocks"] == manifest["copy_blocks"] > 0.4 * manifest["train_blocks"]
    with pytest.raises(ValueError, match=r"^copy_pieces=-1 must be within \[0, 1\]$"):
        build_corpus(tmp_path / "x", tokenizer, context=256, copy_fraction=0.5, copy_pieces=-1, modules=MODULES)


def test_full_documents_fill_their_block(corpus, tokenizer, tmp_path):
    """With full_fraction 1 every passkey and copy document is as long as its block allows (a
    needle a whole context before its question: depth 0 at the full length); with 0 nothing is
    drawn for it, so the corpus is the one drawn before the option existed (the fixture's)."""
    assert corpus[1]["full_documents"] == 0 and corpus[1]["full_fraction"] == 0.0
    manifest = build_corpus(tmp_path, tokenizer, context=256, retrieval_fraction=0.5, copy_fraction=0.3, full_fraction=1.0,
                            modules=MODULES, val_percent=_val_percent())
    opened = manifest["passkey_blocks"] + manifest["copy_blocks"]
    assert manifest["full_documents"] == opened > 0
    ends = [list(block).index(tokenizer.eos_token_id) for block in load_blocks(tmp_path) if tokenizer.eos_token_id in block]
    assert ends.count(255) == opened  # a document of 255 tokens, then EOS: the block's last token
    with pytest.raises(ValueError, match=r"^full_fraction=-0.1 must be within \[0, 1\]$"):
        build_corpus(tmp_path / "x", tokenizer, context=256, modules=MODULES, full_fraction=-0.1)


def test_lookup_documents_drill_every_needle_and_answer_it(tmp_path):
    """A lookup document holds 2 to 8 needles of distinct keys (4 or more when its kinds are
    short and it is full), asks one key in RULER's words, then drills every key and then keys at
    random, each question and drill followed by the value its needle holds: no drill without its
    needle, none unanswered, two drills a needle or more (when full); it fits its length (the
    whole of it when full). In a corpus lookup_fraction of the blocks open with one, drawn apart
    from the retrieval and copy shares."""
    import re

    from sparse_ft.evaluation.words import Words
    from sparse_ft.experiment.retrieval_docs import Lookup, retrieval_document
    from sparse_ft.experiment.tokenizer import TOKENIZER_DIR
    from sparse_ft.modeling.model_io import load_tokenizer

    bpe = load_tokenizer(str(TOKENIZER_DIR))
    lookup = Lookup()
    lookup.word_lists = Words(single=tuple(f"word{i}" for i in range(20)), keys=tuple(f"red-fox{i}" for i in range(40)))
    essay = "The cat sat on the mat. It was warm.".split() * 400
    rng, drilled, kinds, haystacks = random.Random(3), [], set(), set()
    for index in range(12):
        full = index % 2 == 0
        ids = retrieval_document(lookup, bpe, 1023, rng, seed=f"pretrain:0:{index}", essay=essay, full=full)
        assert len(ids) <= 1023 and (not full or len(ids) >= 1023 - 100)  # full: to a haystack line (~90 tokens of UUIDs)
        text = bpe.decode(ids)
        needles = dict(re.findall(r"One of the special magic \w+ for (\S+) is: (\S+)\.", text))
        answers = re.findall(r"The special magic \w+ for (\S+) mentioned in the provided text is (\S+)\.", text)
        questions = re.findall(r"What is the special magic \w+ for (\S+) mentioned", text)
        keys = {k for k, _ in answers}  # every needle drilled, beside distractors in a needle haystack
        assert len(questions) == 1 and questions[0] in keys and all(needles[k] == v for k, v in answers)
        assert 2 <= len(keys) <= 8 and len(answers) >= len(keys) + 1
        short = not re.search(r"[0-9a-f]{8}-[0-9a-f]{4}-", answers[0][0] + answers[0][1])  # no UUID key or value
        assert not full or len(answers) >= 2 * len(keys) and (not short or len(keys) >= 4)
        assert keys == set(needles) or "The grass is green" not in text and "The cat sat" not in text
        assert text.index("What is") > max(text.index(f"for {k} is:") for k in keys)  # questions after every needle
        drilled.append(len(keys))
        kinds.add(re.search(r"Some special magic (\w+)", text).group(1))
        haystacks.add("essay" if "The cat sat" in text else "noise" if "The grass is green" in text else "needle")
    assert len(set(drilled)) >= 2 and kinds == {"numbers", "uuids", "words"} and haystacks == {"essay", "noise", "needle"}
    tokenizer = tiny_tokenizer()
    with pytest.raises(ValueError, match=r"^lookup_fraction=0.6 must be within \[0, 1 - retrieval_fraction=0.5\]$"):
        build_corpus(tmp_path / "x", tokenizer, context=256, retrieval_fraction=0.5, lookup_fraction=0.6, modules=MODULES)
    with pytest.raises(ValueError, match=r"^copy_fraction=0.3 must be within \[0, 1 - retrieval_fraction=0.5 - lookup_fraction=0.3\]$"):
        build_corpus(tmp_path / "x", tokenizer, context=256, retrieval_fraction=0.5, lookup_fraction=0.3, copy_fraction=0.3,
                     modules=MODULES)
    # shares that sum to 1 in decimals are taken, though 1 - 0.9 < 0.1 in floats
    assert fits_one(0.3, 0.6, 0.1) and not fits_one(0.3, 0.6, 0.2)
    build_corpus(tmp_path / "sum1", tokenizer, context=256, retrieval_fraction=0.9, copy_fraction=0.1, modules=MODULES,
                 val_percent=_val_percent(), max_blocks=4)
    manifest = build_corpus(tmp_path, bpe, context=1024, retrieval_fraction=0.0, lookup_fraction=0.5, modules=MODULES,
                            val_percent=_val_percent(), max_blocks=40)
    assert 10 < manifest["lookup_blocks"] < 30 and manifest["lookup_fraction"] == 0.5 and manifest["keys"] == "frequent"
    with pytest.raises(ValueError, match=r"^keys='often': one of frequent, rare$"):
        build_corpus(tmp_path / "y", bpe, context=1024, retrieval_fraction=0.0, lookup_fraction=0.5, modules=MODULES, keys="often")


def test_variable_drills_ask_every_chain_and_answer_it_with_its_variables(tmp_path):
    """A vt_drills document hides 2 to 4 chains of RULER's assignments among noise lines, then
    asks RULER's question for their values: every chain asked at least once, every answer the
    variables of the chain the value starts, in chain order, so no drill is answerable but by
    following the chain; it fits its block. ``--retrieval-tasks`` takes it by name, ``all``
    (RULER's tasks) leaves it out, and a corpus built with it opens blocks with one."""
    import re

    from sparse_ft.experiment.pretrain import retrieval_kinds
    from sparse_ft.experiment.retrieval_docs import VariableDrills, retrieval_document
    from sparse_ft.experiment.tokenizer import TOKENIZER_DIR
    from sparse_ft.modeling.model_io import load_tokenizer

    bpe = load_tokenizer(str(TOKENIZER_DIR))
    drills = VariableDrills()
    drills.setup(bpe, ())
    rng, counts = random.Random(5), set()
    for index in range(10):
        ids = retrieval_document(drills, bpe, 1023, rng, seed=f"pretrain:0:{index}", essay=[], full=index % 2 == 0)
        assert len(ids) <= 1023
        text = bpe.decode(ids)
        assigned = dict(re.findall(r"VAR ([A-Z]{5}) = (\d+|VAR [A-Z]{5})", text))
        chains = {}
        for name, value in assigned.items():
            if value.isdigit():
                chain, last = [name], name
                while (after := [n for n, v in assigned.items() if v == f"VAR {last}"]):
                    last = after[0]
                    chain.append(last)
                chains[value] = chain
        asked = re.findall(r"assigned the value (\d+), they are: +([A-Z ]+)\n", text)
        assert {value for value, _ in asked} == set(chains) and len(asked) > len(chains)
        assert all(names.split() == chains[value] for value, names in asked)
        assert text.startswith("Memorize and track the chain(s)") and "Question: Find all variables" in text
        counts.add(len(chains))
    assert counts == {2, 3, 4}
    assert "vt_drills" not in retrieval_kinds(["all"]) and retrieval_kinds(["vt_drills", "cwe"]) == ["vt_drills", "cwe"]
    manifest = build_corpus(tmp_path, bpe, context=1024, retrieval_fraction=1.0, retrieval_tasks=["vt_drills"], modules=MODULES,
                            val_percent=_val_percent(), max_blocks=3)
    assert manifest["retrieval_blocks"] == {"vt_drills": 3}


def test_common_words_drills_answer_each_list_with_its_ten_most_listed_words(tmp_path):
    """A cwe_drills document asks RULER's common-words question of one list after another: each
    answer names exactly the ten words listed most (3 or 6 times, the others once), every word
    one the tokenizer writes in two tokens or more and none of the evaluation's; a full block
    holds two lists, most often. ``all`` leaves it out, a corpus built with it opens blocks with one, and a
    tokenizer that writes every word whole is refused by name."""
    import re

    from sparse_ft.evaluation.words import EVALUATION
    from sparse_ft.experiment.pretrain import retrieval_kinds
    from sparse_ft.experiment.retrieval_docs import CommonWordsDrills, retrieval_document, ruler_tasks, training_words
    from sparse_ft.experiment.tokenizer import TOKENIZER_DIR
    from sparse_ft.modeling.model_io import load_tokenizer

    bpe = load_tokenizer(str(TOKENIZER_DIR))
    words = training_words(iter_stdlib_documents(MODULES))
    drills = ruler_tasks(["cwe_drills"], bpe, words)["cwe_drills"]
    assert drills.words and all(len(bpe(" " + w, add_special_tokens=False)["input_ids"]) > 1 for w in drills.words)
    rng, lists = random.Random(3), []
    for index in range(8):
        full = index % 2 == 0
        ids = retrieval_document(drills, bpe, 1023, rng, seed=f"pretrain:0:{index}", essay=[], full=full)
        assert len(ids) <= 1023
        for listed, answered in re.findall(r"most often\.\n(.*?)\nQuestion: .*? are: (.*?)\n", bpe.decode(ids)):
            counts = Counter(re.findall(r"\d+\. (\S+)", listed))
            answer = re.findall(r"\d+\. (\S+)", answered)
            assert len(answer) == 10 and {counts[w] for w in answer} in ({3}, {6})
            assert set(counts) - set(answer) and {counts[w] for w in set(counts) - set(answer)} == {1}
            assert not set(counts) & set(EVALUATION.single) and set(counts) <= set(drills.words)
            lists.append(full)
    assert lists.count(True) > 4 and lists.count(False) >= 4  # a full block holds two lists, most often
    assert "cwe_drills" not in retrieval_kinds(["all"])
    manifest = build_corpus(tmp_path, bpe, context=1024, retrieval_fraction=1.0, retrieval_tasks=["cwe_drills"], modules=MODULES,
                            val_percent=_val_percent(), max_blocks=3)
    assert manifest["retrieval_blocks"] == {"cwe_drills": 3}
    whole = CommonWordsDrills()
    whole.word_lists = words
    with pytest.raises(ValueError, match=r"cwe_drills: 0 training words take two tokens or more with this tokenizer; a list needs 30"):
        whole.setup(_WholeWords(), ())


def test_pseudo_words_drills_list_made_up_words_written_as_the_evaluations_are():
    """cwe_pseudo_drills' words are made of the tokenizer's own lowercase pieces, 3 to 10 letters
    in 2 to 4 tokens as the evaluation's words are, none of them an evaluation word, the same on
    every setup; its documents are cwe_drills' (each list answered by its ten most
    listed words). A tokenizer with no lowercase pieces (the byte tokenizer) is refused by name."""
    import re

    from sparse_ft.evaluation.words import EVALUATION
    from sparse_ft.experiment.pretrain import retrieval_kinds
    from sparse_ft.experiment.retrieval_docs import PseudoWordsDrills, every_word, retrieval_document
    from sparse_ft.experiment.tokenizer import TOKENIZER_DIR
    from sparse_ft.modeling.model_io import load_tokenizer

    bpe = load_tokenizer(str(TOKENIZER_DIR))
    made = []
    for _ in range(2):
        drills = PseudoWordsDrills()
        drills.count = 300
        drills.setup(bpe, ())
        made.append(drills.words)
    assert made[0] == made[1] and len(made[0]) == 300
    assert not set(made[0]) & set(every_word(EVALUATION))
    assert all(3 <= len(w) <= 10 and w.isalpha() and 2 <= len(bpe(" " + w, add_special_tokens=False)["input_ids"]) <= 4
               for w in made[0])
    text = bpe.decode(retrieval_document(drills, bpe, 1023, random.Random(1), seed="pretrain:0:0", essay=[], full=True))
    lists = re.findall(r"most often\.\n(.*?)\nQuestion: .*? are: (.*?)\n", text)
    assert lists
    for listed, answered in lists:
        counts = Counter(re.findall(r"\d+\. (\S+)", listed))
        answer = re.findall(r"\d+\. (\S+)", answered)
        assert len(answer) == 10 and {counts[w] for w in answer} in ({3}, {6}) and set(counts) <= set(made[0])
    assert "cwe_pseudo_drills" not in retrieval_kinds(["all"])
    with pytest.raises(ValueError, match=r"^cwe_pseudo_drills: the tokenizer has no short lowercase pieces that start a word"):
        PseudoWordsDrills().setup(tiny_tokenizer(), ())


class _WholeWords:
    """A tokenizer that writes every word as one id."""

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        return {"input_ids": [hash(w) % 1000 for w in text.split()]}
