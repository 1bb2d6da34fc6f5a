"""``sparse-ft pretrain`` (``sparse_ft.experiment.pretrain``): a seeded run through the
trainer with its warm-up and decay writes a loadable safetensors checkpoint and lowers the
loss; bad settings name the key; the committed bases load with their stated shapes and
retrieve inside their windows."""

import json
from pathlib import Path
from typing import Optional

import pytest
import torch

from sparse_ft.config.paths import BPE_BASE_DIR
from sparse_ft.experiment.corpus import build_corpus, load_blocks
from sparse_ft.experiment.pretrain import ASSET_DIR, PretrainConfig, lr_at, pretrain, train
from sparse_ft.modeling.tiny import tiny_tokenizer

MICRO = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=8, num_key_value_heads=4,
             context=128, steps=3, batch_size=2, warmup_steps=1, log_every=1, eval_windows=2, passkey_trials=0)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    out = tmp_path_factory.mktemp("corpus")
    build_corpus(out, tiny_tokenizer(), context=128, retrieval_fraction=0.5, val_percent=50,
                 modules=("heapq", "textwrap", "bisect", "queue"))
    return out


def test_micro_pretrain_writes_a_loadable_safetensors_checkpoint(corpus, tmp_path):
    from transformers import AutoModelForCausalLM

    stats = pretrain(PretrainConfig(**MICRO), corpus, tmp_path / "base", progress=False)
    files = {p.name for p in (tmp_path / "base").iterdir()}
    assert {"config.json", "model.safetensors", "pretrain_stats.json", "tokenizer_config.json"} <= files
    assert not any(name.endswith((".bin", ".pt", ".pth")) for name in files)
    written = json.loads((tmp_path / "base" / "pretrain_stats.json").read_text())
    assert written["steps"] == 3 and written["tokens"] == 3 * 2 * 128 and len(written["loss_curve"]) == 3
    assert written["evaluation"]["val_ppl"] == pytest.approx(stats["evaluation"]["val_ppl"])
    assert 1 < written["evaluation"]["val_ppl"] < 1000
    copies = written["evaluation"]["copy"]
    assert [c["span"] for c in copies] == sorted(c["span"] for c in copies) and all(c["first"] > 0 < c["later"] for c in copies)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    assert model.config.max_position_embeddings == 128 and model.config.num_attention_heads == 8
    # a second phase continues from the checkpoint and keeps the first phase's record
    more = pretrain(PretrainConfig(**(MICRO | dict(steps=1))), corpus, tmp_path / "phase2", progress=False,
                    init_from=tmp_path / "base")
    assert more["previous_phase"]["steps"] == 3 and more["steps"] == 1
    # a phase at another RoPE base: the result says it, the checkpoint it came from is untouched
    pretrain(PretrainConfig(**(MICRO | dict(steps=1, rope_theta=5e5))), corpus, tmp_path / "rebased", progress=False,
             init_from=tmp_path / "base")
    rope = [json.loads((tmp_path / d / "config.json").read_text())["rope_parameters"] for d in ("base", "rebased")]
    assert rope == [{"rope_theta": 10000.0, "rope_type": "default"}, {"rope_theta": 5e5, "rope_type": "default"}]  # no stray keys
    # every phase's run directory (checkpoints, the rebased copy) went once its model was saved
    assert sorted(p.name for p in tmp_path.iterdir()) == ["base", "phase2", "rebased"]


def test_training_is_seeded_and_lowers_the_loss(corpus):
    blocks = load_blocks(corpus)
    cfg = PretrainConfig(**(MICRO | dict(steps=12, lr=1e-2)))
    a, stats = train(cfg, blocks, progress=False)
    b, _ = train(cfg, blocks, progress=False)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
    curve = [c["loss"] for c in stats["loss_curve"]]
    assert curve[-1] < curve[0] - 0.5


def killed_at(step: int):
    """A ``Trainer._step`` that dies (as a kill -9 would, with no save) before step ``step``."""
    from sparse_ft.train.trainer import Trainer

    def step_or_die(self, index: int, run=Trainer._step) -> dict:
        if index + 1 == step:
            raise MemoryError("killed")
        return run(self, index)
    return step_or_die


def test_a_killed_pretraining_resumes_where_it_stopped_and_ends_where_an_unbroken_one_does(corpus, tmp_path, monkeypatch):
    """The six-phase base takes two hours: a kill must not cost more than ``save_minutes``
    (here: every step)."""
    from sparse_ft.train.trainer import Trainer

    blocks = load_blocks(corpus)
    cfg = PretrainConfig(**(MICRO | dict(steps=5, save_minutes=1e-9)))
    unbroken, _ = train(cfg, blocks, progress=False)
    with monkeypatch.context() as patch:
        patch.setattr(Trainer, "_step", killed_at(4))
        with pytest.raises(MemoryError):
            train(cfg, blocks, progress=False, run_dir=tmp_path / "run")
    assert [p.name for p in (tmp_path / "run" / "train").glob("checkpoint-*")] == ["checkpoint-3"]
    with pytest.raises(ValueError, match=r"train\.lr: 0\.003 then, 0\.002 now.*name another --run-dir, or remove"):
        train(PretrainConfig(**(MICRO | dict(steps=5, save_minutes=1e-9, lr=2e-3))), blocks, progress=False,
              run_dir=tmp_path / "run")
    resumed, stats = train(cfg, blocks, progress=False, run_dir=tmp_path / "run")
    assert stats["resumed_from_step"] == 3 and [c["step"] for c in stats["loss_curve"]] == [1, 2, 3, 4, 5]
    for p, q in zip(unbroken.parameters(), resumed.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)


def test_a_stop_signal_saves_a_checkpoint_to_resume_and_a_saved_model_removes_its_run(corpus, tmp_path, monkeypatch):
    import os
    import signal

    from sparse_ft.train.stopping import Preempted
    from sparse_ft.train.trainer import Trainer

    def step_then_term(self, index: int, run=Trainer._step) -> dict:
        if index == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return run(self, index)
    with monkeypatch.context() as patch:
        patch.setattr(Trainer, "_step", step_then_term)
        with pytest.raises(Preempted, match="at step 2: saved checkpoint-2; resume with the same command"):
            pretrain(PretrainConfig(**MICRO), corpus, tmp_path / "base", progress=False)
    assert (tmp_path / "base.run" / "train" / "checkpoint-2" / "meta.json").is_file() and not (tmp_path / "base").exists()
    (tmp_path / "base.run" / "notes.txt").write_text("mine")
    assert pretrain(PretrainConfig(**MICRO), corpus, tmp_path / "base", progress=False)["resumed_from_step"] == 2
    assert sorted(p.name for p in (tmp_path / "base.run").iterdir()) == [".sparse-ft-output", "notes.txt"]  # the user's stays


def test_a_run_directory_continues_only_the_checkpoint_and_base_it_began_with(corpus, tmp_path):
    from sparse_ft.experiment.pretrain import rebased

    pretrain(PretrainConfig(**(MICRO | dict(steps=1))), corpus, tmp_path / "base", progress=False)
    into = tmp_path / "run" / "rebased-base"
    assert rebased(tmp_path / "base", 5e5, into) == into == rebased(tmp_path / "base", 5e5, into)  # written once
    with pytest.raises(ValueError, match=rf"--run-dir {tmp_path / 'run'} holds a run that continued .*'rope_theta': 500000"
                                         r".*this one continues .*'rope_theta': 1000000.0\}: name another --run-dir"):
        rebased(tmp_path / "base", 1e6, into)
    with pytest.raises(ValueError, match=r"--run-dir \S+/run overlaps --corpus \S+; write the output outside it"):
        pretrain(PretrainConfig(**MICRO), corpus, tmp_path / "out", progress=False, run_dir=corpus / "run")


def test_pretraining_runs_through_the_trainer_with_its_schedule(corpus, monkeypatch):
    """No loop or schedule of its own: the trainer's run, logging the lr of lr_at."""
    from sparse_ft.train.trainer import Trainer

    runs = []
    monkeypatch.setattr(Trainer, "train", lambda self, run=Trainer.train: runs.append(self) or run(self))
    cfg = PretrainConfig(**(MICRO | dict(steps=4, warmup_steps=2)))
    _, stats = train(cfg, load_blocks(corpus), progress=False)
    assert len(runs) == 1 and runs[0].recipe.train.weight_decay_on == "matrices"
    assert [c["lr"] for c in stats["loss_curve"]] == [lr_at(c["step"] - 1, cfg) for c in stats["loss_curve"]]


def test_schedule_warms_up_then_decays_to_the_floor():
    cfg = PretrainConfig(steps=100, warmup_steps=10, lr=1.0, min_lr_ratio=0.1)
    assert lr_at(0, cfg) == pytest.approx(0.1) and lr_at(9, cfg) == pytest.approx(1.0)
    assert lr_at(10, cfg) > lr_at(50, cfg) > lr_at(99, cfg) >= 0.1


def test_a_first_phase_sets_the_window_a_second_trains_in_without_scaling(tmp_path):
    from sparse_ft.experiment.pretrain import recipe_for

    def window(**kw) -> int:
        return recipe_for(PretrainConfig(**kw), tmp_path / "out", source=str(tmp_path / "train.bin")).model.tiny["max_position_embeddings"]

    assert window(context=128) == 128 and window(context=128, max_positions=512) == 512
    with pytest.raises(ValueError, match="--max-positions 512 sets a fresh model's window; with --init-from"):
        pretrain(PretrainConfig(context=128, max_positions=512), tmp_path / "c", tmp_path / "o", init_from=tmp_path / "ckpt")


def test_constant_schedule_holds_the_peak_after_warmup():
    """The copy-head phase: no decay, whatever min_lr_ratio says (it is cosine's floor)."""
    cfg = PretrainConfig(steps=100, warmup_steps=10, lr=1.0, min_lr_ratio=0.1, scheduler="constant")
    assert lr_at(0, cfg) == pytest.approx(0.1) and [lr_at(s, cfg) for s in (9, 50, 99)] == [1.0, 1.0, 1.0]


def test_bad_config_names_the_key(corpus):
    with pytest.raises(ValueError, match="save_dtype='int8'"):
        PretrainConfig(save_dtype="int8").validate()
    with pytest.raises(ValueError, match="scheduler='linear' is unknown; allowed: constant, cosine"):
        PretrainConfig(scheduler="linear").validate()
    with pytest.raises(ValueError, match=r"rope_theta=0.5 must be 0 \(keep the model's\) or > 1"):
        PretrainConfig(rope_theta=0.5).validate()
    with pytest.raises(ValueError, match=r"max_positions=100 must be 0 \(the context\) or >= context=256"):
        PretrainConfig(max_positions=100).validate()
    with pytest.raises(ValueError, match="context=64"):
        train(PretrainConfig(**(MICRO | dict(context=64))), load_blocks(corpus), progress=False)


@pytest.mark.parametrize("asset, vocab, most", [(ASSET_DIR, 384, 4.0), (BPE_BASE_DIR, 4096, 6.0)], ids=["byte", "bpe"])
def test_committed_checkpoint_loads_with_the_stated_shapes(asset, vocab, most):
    """Both committed bases: the byte base (the unit tests' quick model) and the BPE base (the
    experiment's); each loss far below uniform over its ids (ln 384 = 5.95, ln 4,096 = 8.32)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert (asset / "model.safetensors").stat().st_size <= 20 * 2**20
    stats = json.loads((asset / "pretrain_stats.json").read_text())
    cfg = stats["config"]
    model = AutoModelForCausalLM.from_pretrained(asset)
    c = model.config
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.max_position_embeddings) == \
        (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["context"])
    assert c.num_attention_heads >= 8 and c.vocab_size == vocab
    assert sum(p.numel() for p in model.parameters()) == stats["parameters"]
    tok = AutoTokenizer.from_pretrained(asset)
    ids = torch.tensor([tok("def main():\n    return", add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids).loss
    assert torch.isfinite(loss) and loss < most


def test_the_experiments_base_retrieves_at_every_depth_of_its_window():
    """What issue 33's base promises and the experiment's retrieval columns rely on: passkeys at
    depths 0, 0.5 and 1 of a 1,016-token prompt, and RULER's single needles and the needle of
    four to pick by its key at C = 1,024 (docs/experiment.md: scripts/pretrain_bpe_base.sh 3)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sparse_ft import methods
    from sparse_ft.evaluation.tasks.passkey import Passkey
    from sparse_ft.evaluation.tasks.ruler import Ruler

    model = AutoModelForCausalLM.from_pretrained(BPE_BASE_DIR).eval()
    tok = AutoTokenizer.from_pretrained(BPE_BASE_DIR)
    assert model.config.max_position_embeddings == 1024
    cells = Passkey([1016], [0.0, 0.5, 1.0], trials=3, seed=1).evaluate(model, tok, methods.get("full"))
    assert all(c["accuracy"] == 1.0 for c in cells), [c["outputs"] for c in cells]
    ruler = Ruler([1024], ["niah_single_1", "niah_single_2"], samples=3, seed=1)
    ruler.prepare(tok)
    rows = ruler.evaluate(model, tok, methods.get("full"))
    assert all(r["score"] == 100.0 for r in rows), [r["outputs"] for r in rows]
    # one needle of four by its key: 0.9 over 20 samples, so at least 5 of 6 (a pick at random: 1 in 4)
    ruler = Ruler([1024], ["niah_multikey_1"], samples=6, seed=1)
    ruler.prepare(tok)
    (row,) = ruler.evaluate(model, tok, methods.get("full"))
    assert sum(row["scores"]) >= 5, row["outputs"]


def test_committed_checkpoint_retrieves_a_passkey_inside_its_window():
    """What the experiment's passkey columns rely on: the base finds the key when the whole
    prompt and the answer fit in its 256 tokens: every key with the needle next to the
    question, most of them elsewhere (docs/experiment.md, the committed checkpoint)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sparse_ft import methods
    from sparse_ft.evaluation.tasks.passkey import Passkey

    model = AutoModelForCausalLM.from_pretrained(ASSET_DIR).eval()
    tok = AutoTokenizer.from_pretrained(ASSET_DIR)
    cells = Passkey([248], [0.0, 0.5, 1.0], trials=3, seed=1).evaluate(model, tok, methods.get("full"))
    assert cells[-1]["depth"] == 1.0 and cells[-1]["accuracy"] == 1.0, cells[-1]["outputs"]
    assert sum(c["accuracy"] for c in cells) / len(cells) >= 0.7, [c["outputs"] for c in cells]


def test_copy_probe_sees_the_base_copy_the_key():
    """scripts/copy_probe.py, behind the README's statement that PI fine-tuning breaks copying."""
    import importlib.util

    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = importlib.util.spec_from_file_location("copy_probe", ASSET_DIR.parent.parent / "scripts" / "copy_probe.py")
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    model = AutoModelForCausalLM.from_pretrained(ASSET_DIR).eval()
    acc = probe.copy_accuracy(model, AutoTokenizer.from_pretrained(ASSET_DIR), 256, keys=2, depth=1.0)
    assert acc["needle repeat"] == 1.0 and acc["answer"] >= 0.75 and acc["needle"] < 0.5, acc


@pytest.mark.parametrize("phases", ["3", "two"])
def test_the_base_script_refuses_an_unknown_recipe_in_one_line_before_it_writes(tmp_path, phases):
    """``SPARSE_FT_PHASES`` picks the six-phase recipe, the four-phase one before it or the
    two-phase base's; anything else would otherwise run half an hour of phase 1 and then
    whichever branch it fell into."""
    import subprocess

    from sparse_ft.config.paths import REPO_ROOT

    done = subprocess.run(["bash", str(REPO_ROOT / "scripts" / "pretrain_bpe_base.sh"), "1", str(tmp_path / "out")],
                          env={"PATH": "/usr/bin:/bin", "SPARSE_FT_PHASES": phases}, capture_output=True, text=True)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == (f"SPARSE_FT_PHASES={phases}: must be 6 (the recipe), 4 (the recipe before it) or 2 (the base of "
                           "2026-11-27)\n")
    assert list(tmp_path.iterdir()) == []


FAKE_PRETRAIN = """#!/usr/bin/env bash
# records its flags and writes the stats a phase's output holds
echo "$*" >> "$CALLS"
while [ $# -gt 0 ]; do case $1 in --output) out=$2;; --steps) steps=$2;; --seed) seed=$2;; esac; shift; done
mkdir -p "$out" && echo "{\\"config\\": {\\"seed\\": $seed}, \\"steps\\": $steps}" > "$out/pretrain_stats.json"
"""
# writes its flags where the phase's end is read
FAKE_DRILLS = ("import json, pathlib, sys; out = pathlib.Path(sys.argv[2]); out.mkdir(); "
               "(out / 'probe.json').write_text(json.dumps(sys.argv[3:]))\n")
# the held-out score SCORES gives the checkpoint's name (a missing name: the check fails)
FAKE_HELDOUT = """import json, os, pathlib, sys
score = json.loads(os.environ["SCORES"])[pathlib.Path(sys.argv[1]).name]
samples = int(sys.argv[sys.argv.index("--samples") + 1])
print(json.dumps({"base": sys.argv[1], "keys": "rare", "samples": samples, "scores": {"niah_multikey_1": score}}))
"""


def test_the_base_script_run_again_keeps_the_phases_it_finished(tmp_path):
    """A rerun after a kill (the six phases take two hours) starts from the phase in progress:
    a phase's output of this seed and step count is kept; one of another seed is not."""
    import subprocess
    import sys

    from sparse_ft.config.paths import REPO_ROOT

    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "sparse-ft").write_text(FAKE_PRETRAIN)
    (fake / "sparse-ft").chmod(0o755)
    env = {"PATH": f"{fake}:{Path(sys.executable).parent}:/usr/bin:/bin", "SPARSE_FT_PHASES": "2", "CALLS": str(tmp_path / "calls")}

    def run(seed: int) -> list[str]:
        (tmp_path / "calls").write_text("")
        done = subprocess.run(["bash", str(REPO_ROOT / "scripts" / "pretrain_bpe_base.sh"), str(seed), str(tmp_path / "out"),
                               str(tmp_path / "work")], env=env, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        return [line.split("--output ")[1].split()[0] for line in (tmp_path / "calls").read_text().splitlines()]

    assert run(3) == [str(tmp_path / "work" / "phase1"), str(tmp_path / "out")]
    (tmp_path / "out" / "pretrain_stats.json").unlink()  # killed in the last phase
    assert run(3) == [str(tmp_path / "out")]
    assert run(4) == [str(tmp_path / "work" / "phase1"), str(tmp_path / "out")]  # another seed's phases are not this one's


def gated_run(tmp_path: Path, seed: int, scores: dict, keys: Optional[str] = None) -> tuple[int, list[str], str]:
    """The six-phase script with its commands faked, SPARSE_FT_KEYS set to ``keys`` unless None:
    (exit code, each phase's --output, stderr)."""
    import shutil
    import subprocess
    import sys

    from sparse_ft.config.paths import REPO_ROOT

    scripts, fake = tmp_path / "scripts", tmp_path / "bin"
    if not scripts.exists():
        scripts.mkdir()
        fake.mkdir()
        shutil.copy(REPO_ROOT / "scripts" / "pretrain_bpe_base.sh", scripts)
        (scripts / "probe_drills.py").write_text(FAKE_DRILLS)
        (scripts / "heldout_check.py").write_text(FAKE_HELDOUT)
        (fake / "sparse-ft").write_text(FAKE_PRETRAIN)
        (fake / "sparse-ft").chmod(0o755)
    (tmp_path / "calls").write_text("")
    env = {"PATH": f"{fake}:{Path(sys.executable).parent}:/usr/bin:/bin", "CALLS": str(tmp_path / "calls"),
           "SCORES": json.dumps(scores), **({} if keys is None else {"SPARSE_FT_KEYS": keys})}
    done = subprocess.run(["bash", str(scripts / "pretrain_bpe_base.sh"), str(seed), str(tmp_path / "out"),
                           str(tmp_path / "work")], env=env, capture_output=True, text=True)
    calls = [line.split("--output ")[1].split()[0].rsplit("/", 1)[1] + " seed " + line.rsplit("--seed ", 1)[1]
             for line in (tmp_path / "calls").read_text().splitlines()]
    return done.returncode, calls, done.stderr


def test_the_gate_keeps_a_base_that_passes_the_held_out_check_as_phase_6_left_it(tmp_path):
    """Seed 3's base reads 0.95, the gate itself: the recipe's output must be phase 6, so the
    committed base is what the gated recipe makes."""
    code, calls, err = gated_run(tmp_path, 3, {"phase6": 0.95})
    assert code == 0, err
    assert calls == [f"{name} seed 3" for name in ("phase1", "phase2", "phase3", "phase5", "phase6")]
    assert (tmp_path / "out" / "pretrain_stats.json").read_text() == (tmp_path / "work" / "phase6" / "pretrain_stats.json").read_text()
    assert not (tmp_path / "out.partial").exists()


def test_the_gate_trains_spans_of_fresh_documents_until_the_check_passes_and_resumes(tmp_path):
    code, calls, err = gated_run(tmp_path, 2, {"phase6": 0.79, "phase7-1": 0.9, "phase7-2": 0.95})
    assert code == 0, err
    assert calls[-2:] == ["phase7-1 seed 201", "phase7-2 seed 202"]
    assert json.loads((tmp_path / "out" / "pretrain_stats.json").read_text())["config"]["seed"] == 202
    assert "phase7-2: held-out niah_multikey_1 0.95 (gate 0.95)" in err
    code, calls, err = gated_run(tmp_path, 2, {})  # run again: every phase, check and the output kept
    assert code == 0 and calls == [], err
    assert "holds" in err.splitlines()[-1]


def test_the_gate_stops_after_six_spans_with_the_last(tmp_path):
    code, calls, err = gated_run(tmp_path, 2, {"phase6": 0.5, **{f"phase7-{k}": 0.8 for k in range(1, 7)}})
    assert code == 0, err
    assert calls[-1] == "phase7-6 seed 206" and len([c for c in calls if c.startswith("phase7")]) == 6
    assert json.loads((tmp_path / "out" / "pretrain_stats.json").read_text())["config"]["seed"] == 206


def test_a_failed_check_stops_the_script_without_an_output_and_is_run_again(tmp_path):
    code, _, err = gated_run(tmp_path, 2, {})  # the check of phase 6 fails (KeyError)
    assert code != 0 and not (tmp_path / "out").exists()
    assert not (tmp_path / "work" / "phase6.heldout.json").exists()  # no half-written score read next time
    code, calls, err = gated_run(tmp_path, 2, {"phase6": 0.96})
    assert code == 0 and calls == [], err
    held = tmp_path / "work" / "phase6.heldout.json"  # a score of the frequent keys is not the gate's
    held.write_text(held.read_text().replace('"rare"', '"frequent"'))
    (tmp_path / "out" / "pretrain_stats.json").unlink()
    code, _, err = gated_run(tmp_path, 2, {})
    assert code == 1 and err.splitlines()[-1] == f"{held}: a score on frequent keys, the gate reads rare ones; move it away"
    held.write_text(held.read_text().replace('"frequent"', '"rare"').replace('"samples": 120', '"samples": 60'))
    code, _, err = gated_run(tmp_path, 2, {})  # nor one of fewer prompts (60 let seed 2 through, RULER 0.89)
    assert code == 1 and err.splitlines()[-1] == f"{held}: a score on 60 prompts, the gate reads 120; move it away"


def test_rare_keys_reach_the_drills_and_every_phase_from_the_third_and_hold_their_work_directory(tmp_path):
    code, _, err = gated_run(tmp_path, 3, {"phase6": 0.95}, keys="rare")
    assert code == 0, err
    flags = {line.split("--output ")[1].split()[0].rsplit("/", 1)[1]: "--keys rare" in line
             for line in (tmp_path / "calls").read_text().splitlines()}
    assert flags == {"phase1": False, "phase2": False, "phase3": True, "phase5": True, "phase6": True}
    assert json.loads((tmp_path / "work" / "phase4" / "probe.json").read_text())[-2:] == ["--keys", "rare"]
    code, calls, err = gated_run(tmp_path, 3, {"phase6": 0.95})  # the default, frequent keys, on the same WORK
    assert code == 2 and calls == []
    assert err.splitlines()[-1] == (f"SPARSE_FT_KEYS=frequent: WORK {tmp_path / 'work'} holds phases of rare keys; "
                                    "name another WORK")


def test_the_script_refuses_keys_it_does_not_know(tmp_path):
    code, calls, err = gated_run(tmp_path, 3, {}, keys="long")
    assert code == 2 and calls == [] and not (tmp_path / "work").exists()
    assert err.splitlines()[-1] == "SPARSE_FT_KEYS=long: must be frequent (the recipe) or rare (the gate's keys from phase 3 on)"


def test_the_gate_refuses_an_output_that_holds_another_model(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "pretrain_stats.json").write_text('{"config": {"seed": 9}, "steps": 1}')
    code, _, err = gated_run(tmp_path, 3, {"phase6": 0.967})
    assert code == 1
    assert err.splitlines()[-1] == (f"OUTPUT {tmp_path / 'out'} holds another model than the one the gate chose "
                                    f"({tmp_path / 'work' / 'phase6'}): move it away and run again")
