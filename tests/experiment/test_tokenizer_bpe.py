"""The tiny BPE tokenizer (assets/tiny-bpe, scripts/train_tokenizer.py): loaded offline as any
transformers tokenizer, the same bytes when retrained, and prompts that fit the base's 256."""

import hashlib

import pytest

from sparse_ft.experiment.tokenizer import SPECIAL_TOKENS, TOKENIZER_DIR, VOCAB_SIZE, save, train_bpe, training_texts

MODULES = ["heapq", "textwrap", "bisect", "string", "fractions"]


@pytest.fixture(scope="module")
def committed():
    from sparse_ft.modeling.model_io import load_tokenizer

    return load_tokenizer(str(TOKENIZER_DIR))  # offline: conftest sets HF_HUB_OFFLINE


def test_it_loads_offline_through_autotokenizer(committed):
    assert len(committed) == VOCAB_SIZE and [committed.pad_token, committed.eos_token] == list(SPECIAL_TOKENS)
    assert [committed.pad_token_id, committed.eos_token_id] == [0, 1]
    text = "def f(x):\n    return x ** 2  # the pass key is 68271 ü\n"
    ids = committed(text, add_special_tokens=False)["input_ids"]
    assert committed.decode(ids) == text and len(ids) < len(text.encode()) / 2  # byte-level, no unknowns, shorter
    assert [committed.decode([i]) for i in committed("68271", add_special_tokens=False)["input_ids"]] == list("68271")


def test_a_retrain_writes_the_same_bytes(tmp_path):
    """Deterministic training and saving (a small slice of the corpus here; the committed one is
    all of this Python's stdlib); another vocabulary size gives another tokenizer."""
    def digest(name: str, vocab_size: int) -> str:
        out = save(train_bpe(training_texts(MODULES, val_percent=20), vocab_size), tmp_path / name, "test")
        return hashlib.sha256((out / "tokenizer.json").read_bytes() + (out / "tokenizer_config.json").read_bytes()).hexdigest()

    first = digest("a", 1024)
    assert digest("b", 1024) == first and digest("c", 1000) != first
    with pytest.raises(ValueError, match="vocab_size 100 must be >= 258"):
        train_bpe([], 100)


def test_passkey_and_the_shortest_ruler_prompts_at_256(committed):
    """The passkey prompt fits C = 256 with room for filler; of RULER's tasks with their
    generation budgets, niah_single_2 and fwe fit at 256 (the others need 260-928 tokens:
    docs/experiment.md)."""
    from sparse_ft.evaluation.passkey_prompt import shortest_prompt
    from sparse_ft.evaluation.tasks.passkey import keys
    from sparse_ft.evaluation.tasks.ruler import Ruler

    assert shortest_prompt(committed, keys(5, 0)) <= 128
    Ruler([256], ["niah_single_2", "fwe"], samples=1, seed=0).prepare(committed)
