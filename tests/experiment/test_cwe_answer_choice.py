"""scripts/cwe_answer_choice.py sorts each word a base writes into a cwe answer slot by whole
words: a base that writes one common word everywhere lands on "common", and one that writes a
word missing from the list, whose first token starts a common word, lands on "no listed word"."""

import sys
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
from cwe_answer_choice import choices, greedy_word  # noqa: E402


class Writes:
    """A stand-in model whose next token spells ``word`` (then a space) wherever it stands."""

    def __init__(self, tokenizer, word: str) -> None:
        self.spelled = tokenizer(" " + word, add_special_tokens=False)["input_ids"]
        self.space = tokenizer(" ", add_special_tokens=False)["input_ids"][0]
        self.vocab = len(tokenizer)

    def __call__(self, ids: torch.Tensor) -> SimpleNamespace:
        ids = ids[0].tolist()
        done = max((k for k in range(len(self.spelled) + 1) if k == 0 or ids[-k:] == self.spelled[:k]), default=0)
        logits = torch.zeros(1, len(ids), self.vocab)
        logits[0, -1, self.space if done == len(self.spelled) else self.spelled[done]] = 1.0
        return SimpleNamespace(logits=logits)


def test_answer_slots_are_judged_by_the_whole_word_written():
    from sparse_ft.evaluation.tasks.common_words import CommonWords
    from sparse_ft.experiment.tokenizer import TOKENIZER_DIR
    from sparse_ft.modeling.model_io import load_tokenizer

    bpe = load_tokenizer(str(TOKENIZER_DIR))
    task = CommonWords()
    task.setup(bpe, ())
    prompt = task.fit(bpe, 1024, seed="cwe|1024|0")
    first = {w: bpe(" " + w, add_special_tokens=False)["input_ids"][0] for w in task.word_lists.single}
    common, stranger = next((c, w) for c in prompt.sample.answers for w in task.word_lists.single
                            if w not in prompt.sample.context and first[w] == first[c])
    assert greedy_word(Writes(bpe, common), bpe, [bpe.eos_token_id]) == common
    shares = choices(Writes(bpe, common), bpe, task, 1024, samples=1)
    assert (shares["common"], shares["listed"], shares["other"]) == (1.0, 0.0, 0.0) and shares["loss"] > 0
    assert choices(Writes(bpe, stranger), bpe, task, 1024, samples=1)["other"] == 1.0  # its first token starts a common word
