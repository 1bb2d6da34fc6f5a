"""A run with dense layers and a dense tail (``attention.dense_layers``,
``train.dense_final_fraction``): every step's attention calls, layer by layer, are the ones
the keys name (the tail from step ceil((1 - f) * steps) on), a run resumed past the switch
trains the tail with full attention to the uninterrupted run's loss curve, a changed value is
refused on resume by name, and the run's summary says both."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.train.helpers_train import curve, one_thread, overrides  # noqa: F401
from sparse_ft.config import load_recipe
from sparse_ft.methods import DenseLayers
from sparse_ft.train.trainer import Trainer, train


@pytest.fixture
def spied(monkeypatch):
    """Per step (1-based), the layers that attended fully and those that did not."""
    steps: dict[int, dict[bool, set[int]]] = {}
    current = {"step": 0}
    step, call = Trainer._step, DenseLayers.__call__

    def spy_step(self, index):
        current["step"] = index + 1
        return step(self, index)

    def spy_call(self, module, *args, **kwargs):
        steps.setdefault(current["step"], {True: set(), False: set()})[self.attends_fully(module)].add(module.layer_idx)
        return call(self, module, *args, **kwargs)

    monkeypatch.setattr(Trainer, "_step", spy_step)
    monkeypatch.setattr(DenseLayers, "__call__", spy_call)
    return steps


def test_dense_layers_and_the_tail_switch_at_their_step_and_after_resume(tmp_path, spied, capsys):
    run = [*overrides("unset", tmp_path / "cache"), "deepspeed=null", "train.max_steps=4", "train.save_steps=2",
           "train.gradient_accumulation_steps=1", "data.seq_len=128", "train.warmup_steps=0",
           "attention.dense_layers=[0]", "train.dense_final_fraction=0.75"]
    out = tmp_path / "run"
    summary = train(load_recipe("tiny", [*run, f"train.output_dir={out}"]))
    # ceil(0.25 * 4) = 1: step 1 runs the pattern in layer 1, steps 2-4 attend fully everywhere
    assert spied == {1: {True: {0}, False: {1}}, **{s: {True: {0, 1}, False: set()} for s in (2, 3, 4)}}
    assert summary["full_attention"] == {"layers": [0], "every_layer_from_step": 2}
    assert json.loads((out / "train_summary.json").read_text())["full_attention"]["every_layer_from_step"] == 2
    printed = capsys.readouterr().out
    assert "full attention in layers [0], full attention in every layer from step 2 of 4 (train.dense_final_fraction=0.75)" in printed
    assert "step 2: full attention in every layer to the end" in printed
    meta = json.loads((out / "adapter" / "sparse_ft.json").read_text())
    assert meta["train_full_attention"] == {"dense_layers": [0], "dense_final_fraction": 0.75}

    spied.clear()
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copytree(out / "checkpoint-2", resumed / "checkpoint-2")
    assert curve(train(load_recipe("tiny", [*run, f"train.output_dir={resumed}"]))) == curve(summary)
    assert spied == {s: {True: {0, 1}, False: set()} for s in (3, 4)}  # resumed past the switch: dense from its first step

    other = tmp_path / "other"
    other.mkdir()
    shutil.copytree(out / "checkpoint-2", other / "checkpoint-2")
    changed = [*run, f"train.output_dir={other}", "train.dense_final_fraction=0.5", "attention.dense_layers=last 1"]
    with pytest.raises(ValueError, match=r"attention.dense_layers: \[0\] then, 'last 1' now; "
                                         r"train.dense_final_fraction: 0.75 then, 0.5 now"):
        train(load_recipe("tiny", changed))
