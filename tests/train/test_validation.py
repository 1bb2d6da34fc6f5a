"""Validation during training (issue 21, part 5): a run that validates every two steps has the
loss curve of the run that does not, exactly; its results are in log.jsonl and TensorBoard;
a run that crashed resumes with them, each step's once. The recipe's bad validation keys are
in test_bad_inputs.py's table; ZeRO-3 validation in test_train_deepspeed.py."""

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.train.helpers_train import SimulatedCrash, common, curve, losses, one_thread, reference, write_held_out  # noqa: F401
from sparse_ft.config import load_recipe
from sparse_ft.train import checkpoint
from sparse_ft.train.trainer import train
from sparse_ft.train.validation import metrics, rng_untouched


@pytest.fixture(scope="module")
def held_out(tmp_path_factory):
    return write_held_out(tmp_path_factory.mktemp("held-out") / "held_out.jsonl")


def validating(held_out, *extra):
    """Validation every two steps and after the last: PPL through full attention, passkey
    retrieval through the training pattern (a forward per generated token)."""
    return ["validation.every_steps=2", "validation.at_end=true", f"validation.data={held_out}",
            "validation.tasks=[ppl,passkey]", "validation.params={ppl: {max_windows: 2}, passkey: {depths: [0.5], trials: 1}}",
            *extra]


def records(out):
    lines = [json.loads(line) for line in (Path(out) / "log.jsonl").read_text().splitlines()]
    return [r for r in lines if r.get("kind") == "validation"]


@pytest.mark.slow
def test_validation_leaves_the_loss_curve_exactly_as_without_it(tmp_path, common, reference, held_out):
    """Passkey generation runs through the training pattern, the ppl through full attention:
    a switch left behind, eval mode left on (no LoRA dropout) or a draw from a generator
    training uses would each change the losses."""
    out = tmp_path / "validated"
    summary = train(load_recipe("tiny", [*common, f"train.output_dir={out}", "train.report_to=[tensorboard]",
                                         *validating(held_out)]))
    assert curve(summary) == curve(reference[1])  # exact, not approximate
    assert losses(out) == losses(reference[0])
    found = records(out)
    assert [(r["step"], r["task"]) for r in found] == [(s, t) for s in (2, 4, 6, 8) for t in ("ppl", "passkey")]
    ppl = [r["metrics"]["val/ppl/ppl@512"] for r in found if r["task"] == "ppl"]
    assert all(1 < p < 1e4 for p in ppl) and ppl[-1] < ppl[0]  # it learns the corpus's style
    assert {r["attention"] for r in found} == {"full"} and summary["validation"] == found
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard")).Reload()
    assert [e.step for e in events.Scalars("val/ppl/ppl@512")] == [2, 4, 6, 8]
    assert [e.value for e in events.Scalars("val/ppl/ppl@512")] == pytest.approx(ppl)
    assert "val/passkey/accuracy@512" in events.Tags()["scalars"]


@pytest.mark.slow
def test_a_crashed_validating_run_resumes_with_each_steps_results_once(tmp_path, common, reference, held_out, monkeypatch):
    """Validation runs before its step's checkpoint, which keeps the results: the resumed run's
    log has them from the checkpoint and its own after, each step's once."""
    out = tmp_path / "crashed"
    real_write = checkpoint.write_synced

    def crash_in_save_6(path, data):
        if path.parent.name.startswith("checkpoint-6"):
            raise SimulatedCrash("while writing checkpoint-6")
        real_write(path, data)

    recipe = [*common, f"train.output_dir={out}", *validating(held_out, "validation.tasks=[ppl]", "validation.params={}",
                                                              "validation.attention=training")]
    monkeypatch.setattr(checkpoint, "write_synced", crash_in_save_6)
    with pytest.raises(SimulatedCrash):
        train(load_recipe("tiny", recipe))
    monkeypatch.undo()
    assert [r["step"] for r in records(out)] == [2, 4, 6]
    resumed = train(load_recipe("tiny", recipe))
    assert curve(resumed) == curve(reference[1])
    assert [r["step"] for r in records(out)] == [2, 4, 6, 8] and records(out) == resumed["validation"]
    assert {r["attention"] for r in records(out)} == {"scca_flow"}


def test_rng_untouched_puts_every_generator_back():
    def draws():
        return torch.rand(3).tolist(), random.random(), float(np.random.rand())

    state = torch.get_rng_state(), random.getstate(), np.random.get_state()
    expected = draws()
    torch.set_rng_state(state[0]), random.setstate(state[1]), np.random.set_state(state[2])
    with rng_untouched():
        assert draws() == expected  # the block draws from the same generators...
        draws()
    assert draws() == expected  # ...and leaves them where they were


def test_metrics_name_task_metric_and_length():
    assert metrics("ppl", [{"length": 512, "ppl": 9.5}, {"length": 1024, "ppl": 12.0}]) == {
        "val/ppl/ppl@512": 9.5, "val/ppl/ppl@1024": 12.0}
    passkey = [{"length": 512, "depth": d, "accuracy": a} for d, a in ((0.0, 1.0), (1.0, 0.5))]
    assert metrics("passkey", passkey) == {"val/passkey/accuracy@512": 0.75}
    ruler = [{"task": "vt", "length": 512, "score": 40.0}, {"task": "cwe", "length": 512, "score": 60.0}]
    assert metrics("ruler", ruler) == {"val/vt/score@512": 40.0, "val/cwe/score@512": 60.0, "val/ruler/score@512": 50.0}
    assert metrics("vt", ruler[:1]) == {"val/vt/score@512": 40.0}


def test_a_ruler_task_validates_through_the_suite_and_the_model_is_left_training(held_out):
    """A RULER task by name (a single needle in noise, two samples) runs as the suite of that
    task alone; afterwards the model trains again, through its training pattern."""
    from contextlib import nullcontext

    from sparse_ft.modeling.attention import pretrained
    from sparse_ft.modeling.tiny import tiny_llama, tiny_tokenizer
    from sparse_ft.train.model_setup import training_method, train_through
    from sparse_ft.train.validation import Validation

    recipe = load_recipe("tiny", ["deepspeed=null", "validation.at_end=true", "validation.tasks=[niah_single_1]",
                                  "validation.params={niah_single_1: {samples: 2}}", "validation.lengths=[600]"])
    method = training_method(recipe)
    model = train_through(tiny_llama(), method, gradient_checkpointing=False).train()
    (record,) = Validation(recipe, tiny_tokenizer(), method).run(model, nullcontext(), step=3)
    assert record["step"] == 3 and record["task"] == "niah_single_1"
    assert list(record["metrics"]) == ["val/niah_single_1/score@600"] and record["rows"][0]["samples"] == 2
    assert 0 <= record["metrics"]["val/niah_single_1/score@600"] <= 100
    assert model.training and pretrained(model).config._attn_implementation != "sdpa"


def test_held_out_data_or_a_prompt_longer_than_the_validation_length_is_one_line(held_out):
    from sparse_ft.config.bad_input import BadInput
    from sparse_ft.modeling.tiny import tiny_tokenizer
    from sparse_ft.train.model_setup import training_method
    from sparse_ft.train.validation import Validation

    recipe = load_recipe("tiny", ["deepspeed=null", "validation.at_end=true", f"validation.data={held_out}",
                                  "validation.lengths=[100000]"])
    with pytest.raises(BadInput, match=r"^recipe key validation.data='.*held_out.jsonl' is invalid: holds \d+ tokens, fewer "
                                       r"than the longest validation length 100000; add data or lower validation.lengths$"):
        Validation(recipe, tiny_tokenizer(), training_method(recipe))
    recipe = load_recipe("tiny", ["deepspeed=null", "validation.at_end=true", "validation.tasks=[niah_single_1]",
                                  "validation.lengths=[100]"])
    with pytest.raises(BadInput, match=r"^recipe key validation.lengths entry 100 is shorter than the shortest "
                                       r"niah_single_1 prompt: \d+ tokens of this tokenizer"):
        Validation(recipe, tiny_tokenizer(), training_method(recipe))
