"""``sparse_ft.experiment.heldout``: RULER's task on training words and text, the score a
pretraining phase may train toward. Its prompts fit their length and draw no evaluation word; it
tells the committed base (which picks one needle of four, RULER's niah_multikey_1 0.96) from
fresh weights; two builds hold the same prompts (a resumed curve compares like with like)."""

import re
from pathlib import Path

import pytest
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from sparse_ft.data.stdlib_text import iter_stdlib_documents
from sparse_ft.evaluation.words import EVALUATION
from sparse_ft.experiment.heldout import HeldOut
from sparse_ft.experiment.retrieval_docs import training_words
from sparse_ft.config.paths import BPE_BASE_DIR

MODULES = ("heapq", "textwrap", "string", "fractions", "queue", "bisect")


@pytest.fixture(scope="module")
def texts():
    return list(iter_stdlib_documents(MODULES))


@pytest.fixture(scope="module")
def held(texts):
    # 512 tokens, not C: the same check at half the cost of a test
    return HeldOut(AutoTokenizer.from_pretrained(BPE_BASE_DIR), ["niah_multikey_1"], length=512, samples=3, texts=texts)


def test_prompts_fit_and_ask_for_training_keys_only(held, texts):
    task, prompts = held.prompts["niah_multikey_1"]
    keys = set(training_words(texts, keys="rare").keys)  # a small text: the same as the frequent ones
    for prompt in prompts:
        assert prompt.tokens + task.tokens_to_generate <= 512
        asked = set(re.findall(r"for (\S+) is: \d+\.", prompt.sample.context))
        assert asked and asked <= keys and not asked & set(EVALUATION.keys)
    assert len({p.sample.answers for p in prompts}) == len(prompts)  # each its own draw
    again = HeldOut(AutoTokenizer.from_pretrained(BPE_BASE_DIR), ["niah_multikey_1"], length=512, samples=3, texts=texts)
    assert [p.context_ids for p in again.prompts["niah_multikey_1"][1]] == [p.context_ids for p in prompts]


def test_it_tells_a_retrieving_base_from_fresh_weights(held):
    base = AutoModelForCausalLM.from_pretrained(BPE_BASE_DIR)
    assert held.scores(base)["niah_multikey_1"] >= 2 / 3
    fresh = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(BPE_BASE_DIR))
    assert held.scores(fresh) == {"niah_multikey_1": 0.0}


def test_no_samples_is_refused(texts):
    with pytest.raises(ValueError, match="samples 0: must be >= 1"):
        HeldOut(AutoTokenizer.from_pretrained(BPE_BASE_DIR), ["niah_multikey_1"], length=1024, samples=0, texts=texts)


@pytest.mark.parametrize("flags, message", [
    (["--tasks", "niah_multikey_1,passkey"], r"--tasks passkey: not a RULER task; one of niah_single_1, "),
    (["--samples", "0"], r"--samples 0: must be >= 1"),
    ([], r"BASE no/such/base: no checkpoint there \(no config.json\)"),
])
def test_the_script_refuses_bad_flags_before_loading(monkeypatch, capsys, flags, message):
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location("heldout_check", Path(__file__).parents[2] / "scripts" / "heldout_check.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    monkeypatch.setattr(sys, "argv", ["heldout_check.py", "no/such/base", *flags])
    with pytest.raises(SystemExit):
        script.main()
    assert re.search(message, capsys.readouterr().err)


def test_rare_keys_split_as_finely_as_the_evaluations_and_leave_the_common_words_alone():
    """The gate's keys (scripts/pretrain_bpe_base.sh, phase 7): the frequent ones are ~4.8 BPE
    pieces, RULER's ~6.4, and a base can match the short and miss the long (seed 2: 0.98 / 0.79)."""
    import random
    import statistics

    from sparse_ft.experiment.tokenizer import training_texts

    texts = list(training_texts())
    frequent, rare = training_words(texts), training_words(texts, keys="rare")
    assert rare.single == frequent.single and not set(rare.keys) & set(frequent.keys)
    assert not set(rare.keys) & set(EVALUATION.keys)
    tokenizer = AutoTokenizer.from_pretrained(BPE_BASE_DIR)

    def pieces(keys) -> float:
        drawn = random.Random(0).sample(list(keys), 300)
        return statistics.mean(len(tokenizer(" " + k, add_special_tokens=False)["input_ids"]) for k in drawn)

    assert pieces(frequent.keys) < 5.2 and abs(pieces(rare.keys) - pieces(EVALUATION.keys)) < 0.4
    with pytest.raises(ValueError, match="keys='often': one of frequent, rare"):
        training_words(texts, keys="often")
