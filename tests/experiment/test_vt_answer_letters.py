"""scripts/vt_answer_letters.py groups the reference answer's tokens by variable and letter: a
stand-in model that always predicts the answer's next token pays nothing anywhere and puts all
its first-token mass on a variable's first token; one that predicts one fixed token pays the most."""

import math
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
from vt_answer_letters import GROUPS, letter_losses  # noqa: E402


class Knows:
    """A stand-in model that, given the prompt plus the answer, puts all mass on each next answer token."""

    def __init__(self, vocab: int, answer_from: int) -> None:
        self.vocab, self.answer_from = vocab, answer_from

    def __call__(self, ids: torch.Tensor) -> SimpleNamespace:
        ids = ids[0]
        logits = torch.full((1, len(ids), self.vocab), -1e4)
        for at in range(self.answer_from - 1, len(ids) - 1):
            logits[0, at, ids[at + 1]] = 1e4
        return SimpleNamespace(logits=logits)


def test_letters_are_grouped_by_variable_and_position():
    from sparse_ft.evaluation.tasks.variable_tracking import VariableTracking
    from sparse_ft.experiment.tokenizer import TOKENIZER_DIR
    from sparse_ft.modeling.model_io import load_tokenizer

    bpe = load_tokenizer(str(TOKENIZER_DIR))
    task = VariableTracking()
    task.setup(bpe, ())
    prompt = task.fit(bpe, 1024, seed="vt|1024|0")
    start = len(prompt.context_ids + prompt.question_ids)
    knows = letter_losses(Knows(len(bpe), start), bpe, task, 1024, samples=1)
    assert all(knows[g] == 0.0 for g in GROUPS) and math.isclose(knows["first-token mass"], 1.0)
    blind = letter_losses(lambda ids: SimpleNamespace(logits=torch.zeros(1, ids.shape[1], len(bpe))), bpe, task, 1024, samples=1)
    assert all(math.isclose(blind[g], math.log(len(bpe)), rel_tol=1e-4) for g in GROUPS)
