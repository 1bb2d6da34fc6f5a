"""A quiet console: a run prints a short summary of its recipe (the whole of it with -v),
-q / -v set how much, and the library warnings that do not concern the user are dropped,
narrowly: any other warning still shows."""

import logging
import warnings

import pytest

from sparse_ft import console
from sparse_ft.cli import main, script
from sparse_ft.config import load_recipe, summarize_recipe


@pytest.fixture(autouse=True)
def restored(monkeypatch):
    """What set_verbosity changes, put back after each test."""
    monkeypatch.setattr(console, "_level", console.NORMAL)
    monkeypatch.delenv("TQDM_DISABLE", raising=False)


def test_the_summary_is_five_lines_naming_what_a_run_does():
    recipe = load_recipe("tiny", ["train.output_dir=runs/x"])
    lines = summarize_recipe(recipe, steps=8, samples=21).splitlines()
    assert len(lines) == 5
    for said in ("tiny (random weights) (float32) extended to 512 tokens, RoPE linear", "attention scca_flow {chunks: 4}", "LoRA r=8",
                 "21 samples of 512 tokens", "8 steps", "output runs/x", "recipe.resolved.yaml"):
        assert any(said in line for line in lines), said
    pretraining = summarize_recipe(recipe, steps=8, samples=21, adapters=False).splitlines()
    assert "every weight trained, no adapters" in pretraining[1] and "LoRA" not in "".join(pretraining)


@pytest.mark.slow
def test_a_run_prints_its_summary_and_with_v_the_whole_recipe(tmp_path, capsys):
    """Without -v the YAML lines are not printed (``say`` at VERBOSE, tested below): a run's
    stdout is then the summary and the adapter's line."""
    argv = ["-v", "train", "recipe=tiny", "deepspeed=null", "train.max_steps=1", "train.report_to=[none]",
            f"train.output_dir={tmp_path / 'run'}", f"data.cache_dir={tmp_path / 'cache'}"]
    assert main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    assert (out[0].startswith("recipe tiny: tiny (random weights) (float32) extended to 512 tokens")
            and out[-1].startswith("adapter saved to"))
    assert out[5:7] == ["model:", "  name_or_path: tiny"] and "  gradient_accumulation_steps: 2" in out


def test_q_and_v_are_taken_before_or_after_the_command_and_by_train_py(monkeypatch):
    for argv, level in ((["-q", "train", "recipe=tiny", "--print-recipe"], console.QUIET),
                        (["train", "recipe=tiny", "-v", "--print-recipe"], console.VERBOSE),
                        (["train", "recipe=tiny", "--print-recipe"], console.NORMAL)):
        assert main(argv) == 0 and console.verbosity() == level, argv
    assert script("train", "train.py", ["-q", "recipe=tiny", "--print-recipe"]) == 0 and console.verbosity() == console.QUIET
    import os

    assert os.environ["TQDM_DISABLE"] == "1"  # every library's progress bar off
    with pytest.raises(SystemExit):
        main(["-q", "-v", "train", "recipe=tiny"])


def test_say_prints_at_its_level_and_quieter_lowers_it(capsys):
    console.say("normal")
    console.say("verbose", console.VERBOSE)
    with console.quieter():
        console.say("inside")
    console.say("after")
    assert capsys.readouterr().out == "normal\nafter\n"


def test_a_filtered_warning_is_gone_and_an_unrelated_one_still_shows():
    from sparse_ft.modeling.tiny import tiny_llama

    model = tiny_llama()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        console.set_verbosity(console.NORMAL)
        assert model.is_activation_checkpointing is False
        model.is_gradient_checkpointing  # transformers' FutureWarning, raised when PEFT probes it
        warnings.warn_explicit("something else is deprecated", FutureWarning, "modeling_utils.py", 1,
                               module="transformers.modeling_utils")
        warnings.warn("`is_gradient_checkpointing` is deprecated", FutureWarning)  # the same words from elsewhere
    assert [str(w.message) for w in caught] == ["something else is deprecated", "`is_gradient_checkpointing` is deprecated"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        console.set_verbosity(console.VERBOSE)  # -v: every warning
        model.is_gradient_checkpointing
    assert len(caught) == 1


def test_a_filtered_log_record_is_gone_and_the_rest_of_its_logger_still_shows(caplog):
    logger = logging.getLogger("bitsandbytes.backends.cpu.ops")
    console.set_verbosity(console.QUIET)
    logger.warning("Failed to load CPU gemm_4bit_forward from kernels-community: %s. Please ...", "no kernels")
    logger.warning("something that matters")
    assert [r.getMessage() for r in caplog.records] == ["something that matters"]
    console.set_verbosity(console.VERBOSE)
    logger.warning("Failed to load CPU gemm_4bit_forward from kernels-community: %s. Please ...", "no kernels")
    assert len(caplog.records) == 2


def test_progress_bars_name_the_row_they_run_for(capsys):
    """The experiment runs every bar inside console.row: each says which row it trains or measures."""
    import numpy as np

    from sparse_ft import methods
    from sparse_ft.evaluation.window_perplexity import evaluate_length
    from sparse_ft.modeling.tiny import tiny_llama

    assert console.bar_label("ppl @ 64") == "ppl @ 64"
    with console.row("scca_flow-seed0"):
        assert console.bar_label("train tiny_4x") == "scca_flow-seed0: train tiny_4x"
        evaluate_length(tiny_llama(), np.arange(3, 200) % 380, 64, 64, scoring="standard", method=methods.get("full"), max_windows=1)
    assert console.bar_label("passkey") == "passkey"
    assert "scca_flow-seed0: ppl @ 64" in capsys.readouterr().err


def test_the_experiment_runs_each_row_inside_its_label(monkeypatch, tmp_path):
    from sparse_ft.experiment import report
    from sparse_ft.experiment.run import ExperimentConfig, Runner

    runner = Runner.__new__(Runner)  # the schedule only: no base, no data
    runner.cfg = ExperimentConfig(patterns=["s2"], variants=["dense_tail"], seeds=[0, 1], free_methods=["vanilla"])
    runner.out, runner.context, runner.target = tmp_path, 256, 1024
    runner.data = lambda: None
    runner.fine_tuned = lambda pattern, seed, val, variant=None: {"name": f"{pattern}{variant}{seed}", "step_seconds": 1.0,
                                                                  "bar": console.bar_label("train"), "eval_seconds": 0.0}
    runner.training_free = lambda label, val: {"bar": console.bar_label("ppl"), "eval_seconds": 0.0}
    timed = []
    runner.step_cost = lambda options: timed.append(options)  # after the rows: each variant with its plain pattern
    monkeypatch.setattr(report, "write_report", lambda results, out: None)
    rows = runner.run()["rows"]
    assert timed == [{"s2+dense_tail": "s2"}]
    assert [r["bar"] for r in rows] == ["s2-seed0: train", "s2-seed1: train", "s2+dense_tail-seed0: train",
                                        "s2+dense_tail-seed1: train", "vanilla: ppl"]
