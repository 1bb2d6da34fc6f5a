"""scripts/probe_drills.py, phase 4 of the BPE base's recipe: with --until it trains past --steps
until the first-digit share reaches the bar or --max-steps is spent, and records where it stopped;
without it, exactly --steps (the runs that made the committed bases). Bad bounds are refused."""

import json
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import probe_drills  # noqa: E402

BASE = str(ROOT / "assets" / "tiny-base-bpe")
SMALL = ["--batch-size", "1", "--length", "96", "--needles", "2"]


def _run(monkeypatch, base: str, out: Path, *flags: str, kinds: list | None = None) -> dict:
    # a few keys instead of the corpus's 90,000 words (reading the corpus takes seconds); ``kinds``
    # collects the kind of keys each call asked the corpus for
    def words(texts, keys):
        (kinds if kinds is not None else []).append(keys)
        return SimpleNamespace(keys=["apple", "river", "stone"])
    monkeypatch.setattr(probe_drills, "training_texts", lambda: [])
    monkeypatch.setattr(probe_drills, "training_words", words)
    monkeypatch.setattr(sys, "argv", ["probe_drills.py", base, str(out), *SMALL, *flags])
    probe_drills.main()
    return json.loads((out / "probe.json").read_text())


def test_until_unreached_runs_to_max_steps_and_checks_at_both_ends(monkeypatch, tmp_path):
    # random weights match no key: the bar is never met, so it trains on to --max-steps
    fresh = tmp_path / "fresh"
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(BASE)).save_pretrained(fresh)
    AutoTokenizer.from_pretrained(BASE).save_pretrained(fresh)
    probe = _run(monkeypatch, str(fresh), tmp_path / "p", "--steps", "1", "--until", "0.99", "--max-steps", "3")
    assert probe["steps"] == 3
    assert [point["step"] for point in probe["curve"]] == [0, 1, 3]  # the check at --steps decides going on
    assert (tmp_path / "p" / "model.safetensors").is_file()


def test_until_task_decides_by_the_held_out_score(monkeypatch, tmp_path):
    # fresh weights pick no needle of four: the held-out score stays 0, under --until 0.5, so the
    # run goes on to --max-steps, each point recording the drills' shares beside it
    from sparse_ft.data.stdlib_text import iter_stdlib_documents

    fresh = tmp_path / "fresh"
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(BASE)).save_pretrained(fresh)
    AutoTokenizer.from_pretrained(BASE).save_pretrained(fresh)
    texts = list(iter_stdlib_documents(("heapq", "textwrap", "string", "fractions", "queue", "bisect")))
    monkeypatch.setattr(probe_drills, "training_texts", lambda: texts)
    monkeypatch.setattr(sys, "argv", ["probe_drills.py", str(fresh), str(tmp_path / "p"), *SMALL, "--steps", "1",
                                      "--until", "0.5", "--max-steps", "2", "--until-task", "niah_multikey_1",
                                      "--until-samples", "1"])
    probe_drills.main()
    probe = json.loads((tmp_path / "p" / "probe.json").read_text())
    assert probe["steps"] == 2 and [point["step"] for point in probe["curve"]] == [0, 1, 2]
    assert all(point["niah_multikey_1"] == 0.0 and "first_digit" in point for point in probe["curve"])


def test_until_reached_stops_at_steps(monkeypatch, tmp_path):
    # the committed base already matches keys: a bar of 0.01 is met at --steps, as seed 3's 0.95 was
    # at 400, so that base is made by the same 400 steps as before --until existed
    probe = _run(monkeypatch, BASE, tmp_path / "p", "--steps", "2", "--until", "0.01")
    assert probe["steps"] == 2 and probe["curve"][-1]["first_digit"] >= 0.01


@pytest.mark.parametrize("flags, kind", [([], "frequent"), (["--keys", "rare"], "rare")])
def test_the_drills_take_the_keys_they_are_asked_for(monkeypatch, tmp_path, flags, kind):
    # SPARSE_FT_KEYS=rare passes --keys rare: the needles are then the gate's rare keys
    kinds: list = []
    probe = _run(monkeypatch, BASE, tmp_path / "p", "--steps", "1", *flags, kinds=kinds)
    assert kinds == [kind] and probe["args"]["keys"] == kind


@pytest.mark.parametrize("flags, message", [
    (["--until", "0"], r"--until 0.0: must be a share in \(0, 1\]"),
    (["--until", "1.5"], r"--until 1.5: must be a share"),
    (["--steps", "5", "--until", "0.9", "--max-steps", "3"], r"--max-steps 3: must be at least --steps 5"),
    (["--max-steps", "900"], r"--max-steps 900: only with --until"),
    (["--until-task", "niah_multikey_1"], r"--until-task niah_multikey_1: only with --until"),
    (["--until", "0.9", "--until-task", "passkey"], r"--until-task passkey: not a RULER task; one of niah_single_1, "),
    (["--until", "0.9", "--until-task", "niah_multikey_1", "--until-samples", "0"], r"--until-samples 0: must be >= 1"),
])
def test_bad_bounds_are_refused(monkeypatch, tmp_path, capsys, flags, message):
    monkeypatch.setattr(sys, "argv", ["probe_drills.py", BASE, str(tmp_path / "p"), *flags])
    with pytest.raises(SystemExit):
        probe_drills.main()
    assert re.search(message, capsys.readouterr().err)
    assert not (tmp_path / "p").exists()
