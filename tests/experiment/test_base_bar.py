"""scripts/base_bar.py checks issue 33's bar on one base's measurements: met when every passkey
cell inside C reaches 0.95, the strong needles 0.9 and every other task is above zero; not met,
exit 1, naming the criterion, when one falls short; and a file of another model is refused."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
from base_bar import main  # noqa: E402

TASKS = ["niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "vt", "cwe"]


def _files(tmp_path: Path, scores: dict, passkey: list[float], model: str = "") -> list[str]:
    base = tmp_path / "base"
    base.mkdir(exist_ok=True)
    (base / "config.json").write_text(json.dumps({"max_position_embeddings": 1024}))
    (base / "pretrain_stats.json").write_text(json.dumps({"evaluation": {"val_ppl": 48.25}}))
    config = {"model": model or str(base), "seed": 0}
    ruler = {"sparse_ft_output": "sparse-ft eval ruler", "config": config,
             "results": [{"task": t, "length": n, "score": s, "samples": 20} for t, s in scores.items() for n in (1024, 2048)]}
    cells = [{"length": n, "depth": d, "accuracy": a} for n in (512, 1016) for d, a in enumerate(passkey)]
    cells.append({"length": 1024, "depth": 0, "accuracy": 0.0})  # the answer past C: not part of the bar
    keys = {"sparse_ft_output": "sparse-ft eval passkey", "config": config, "results": cells}
    (tmp_path / "r.json").write_text(json.dumps(ruler))
    (tmp_path / "p.json").write_text(json.dumps(keys))
    return [str(base), str(tmp_path / "r.json"), str(tmp_path / "p.json"), "--label", "seed 9"]


def test_a_base_that_meets_the_bar(tmp_path, capsys):
    scores = dict(zip(TASKS, [100.0, 95.0, 40.0, 90.0, 5.0, 0.5]))
    assert main(_files(tmp_path, scores, [1.0, 0.95])) == 0
    out = capsys.readouterr().out
    assert "| seed 9 | 0.95 | 1.00 / 0.95 / 0.40 | 0.90 / – / – | – / – | 0.050 / 0.005 / – | 55.1 | 48.2 |" in out
    assert "NOT met" not in out and out.count("met: ") == len(TASKS) + 1


@pytest.mark.parametrize("task, score, passkey, says", [
    ("niah_multikey_1", 85.0, [1.0], "NOT met: niah_multikey_1 >= 0.9 (0.85 over 20 samples)"),
    ("cwe", 0.0, [1.0], "NOT met: cwe above zero (0.000)"),
    ("vt", 5.0, [1.0, 0.9], "NOT met: passkey >= 0.95 at every depth (4 cells, worst 0.90)"),
])
def test_a_criterion_short_of_the_bar_is_named(tmp_path, capsys, task, score, passkey, says):
    scores = dict(zip(TASKS, [100.0, 100.0, 40.0, 95.0, 5.0, 1.0])) | {task: score}
    assert main(_files(tmp_path, scores, passkey)) == 1
    assert says in capsys.readouterr().out


def test_measurements_of_another_model_are_refused(tmp_path):
    with pytest.raises(SystemExit, match=r"the RULER file measured /elsewhere, not .*base$"):
        main(_files(tmp_path, dict.fromkeys(TASKS, 100.0), [1.0], model="/elsewhere"))


def _more(tmp_path: Path, name: str, seed: int, samples: int, score: float) -> str:
    config = {"model": str(tmp_path / "base"), "seed": seed}
    rows = [{"task": "niah_multikey_1", "length": 1024, "score": score, "samples": samples}]
    (tmp_path / name).write_text(json.dumps({"sparse_ft_output": "sparse-ft eval ruler", "config": config, "results": rows}))
    return str(tmp_path / name)


def test_more_samples_are_pooled_once_per_seed(tmp_path, capsys):
    # seed 1's 20-sample reading (0.80) under the bar; seed 0's 60 samples hold the same first 20, so
    # only they count for seed 0; seed 1's 60 add: (0.85 x 60 + 0.95 x 60) / 120 = 0.90
    scores = dict(zip(TASKS, [100.0, 100.0, 40.0, 80.0, 5.0, 1.0]))
    args = _files(tmp_path, scores, [1.0]) + ["--more-ruler", _more(tmp_path, "s0.json", 0, 60, 85.0),
                                              "--more-ruler", _more(tmp_path, "s1.json", 1, 60, 95.0)]
    assert main(args) == 0
    assert "met: niah_multikey_1 >= 0.9 (0.90 over 120 samples)" in capsys.readouterr().out


def test_more_samples_of_another_model_are_refused(tmp_path):
    other = _more(tmp_path, "s1.json", 1, 60, 95.0)
    data = json.loads(Path(other).read_text())
    data["config"]["model"] = "/elsewhere"
    Path(other).write_text(json.dumps(data))
    with pytest.raises(SystemExit, match=r"the RULER file measured /elsewhere"):
        main(_files(tmp_path, dict.fromkeys(TASKS, 100.0), [1.0]) + ["--more-ruler", other])
