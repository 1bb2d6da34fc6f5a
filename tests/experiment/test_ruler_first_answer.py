"""scripts/ruler_first_answer.py credits only an output that opens with the asked value: a base
that lists other keys' values after a wrong first one is scored right by RULER, wrong here."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
from ruler_first_answer import first_answer  # noqa: E402


def test_first_answer_counts_only_the_opening_value(tmp_path):
    result = {"task": "niah_multikey_1", "length": 1024, "score": 75.0, "answers": [["123"], ["456"], ["789"], ["42"]],
              "outputs": [" 123.", " 999. The special magic number for x is 456.", "123 789", " 4 2"]}
    assert first_answer(result) == 0.25
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"results": [result, {**result, "task": "vt"}]}))
    table = subprocess.run([sys.executable, str(ROOT / "scripts" / "ruler_first_answer.py"), str(path)],
                           capture_output=True, text=True, check=True).stdout
    assert "| r.json | niah_multikey_1 | 1024 | 0.75 | 0.25 |" in table and "vt" not in table
    missing = subprocess.run([sys.executable, str(ROOT / "scripts" / "ruler_first_answer.py"), str(tmp_path / "none.json")],
                             capture_output=True, text=True)
    assert missing.returncode == 1 and missing.stderr.count("\n") == 1 and "none.json: not the JSON" in missing.stderr
