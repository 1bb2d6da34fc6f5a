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
    for said in ("tiny (float32) extended to 512 tokens, RoPE linear", "attention scca_flow {chunks: 4}", "LoRA r=8",
                 "21 samples of 512 tokens", "8 steps", "output runs/x", "recipe.resolved.yaml"):
        assert any(said in line for line in lines), said


@pytest.mark.slow
def test_a_run_prints_its_summary_and_with_v_the_whole_recipe(tmp_path, capsys):
    """Without -v the YAML lines are not printed (``say`` at VERBOSE, tested below): a run's
    stdout is then the summary and the adapter's line."""
    argv = ["-v", "train", "recipe=tiny", "deepspeed=null", "train.max_steps=1", "train.report_to=[none]",
            f"train.output_dir={tmp_path / 'run'}", f"data.cache_dir={tmp_path / 'cache'}"]
    assert main(argv) == 0
    # DeepSpeed logs a line of its own to stdout when it is first imported in a process
    out = [line for line in capsys.readouterr().out.splitlines() if "[real_accelerator.py:" not in line]
    assert out[0].startswith("recipe tiny: tiny (float32) extended to 512 tokens") and out[-1].startswith("adapter saved to")
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
