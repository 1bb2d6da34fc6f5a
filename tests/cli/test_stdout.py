"""stdout holds a command's results only (``sparse-ft eval ppl ... > table.md``): no library
log line reaches it. DeepSpeed logs "Setting accelerator to CPU" to stdout when it is first
imported in a process, so the verbs run in a fresh process, each between markers, and the
first one that imports DeepSpeed is the one whose section would hold the line."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MARK = "=== verb: "
LOG_LINE = re.compile(r"^\[\d{4}-\d\d-\d\d |\[(WARNING|INFO|DEBUG)\]|Setting accelerator")
DRIVER = f"""
import sys
from sparse_ft.cli import main
for argv in [a.split("\\x1f") for a in sys.argv[1:]]:
    print({MARK!r} + argv[0], flush=True)
    assert main(argv) == 0, argv
    sys.stdout.flush()
"""


def test_every_verb_prints_results_only_on_stdout(tmp_path):
    run, data = tmp_path / "run", str(ROOT / "data" / "tiny" / "train.jsonl")
    verbs = [
        ["plan", "recipe=tiny", "--patterns", "full"],
        ["eval", "ppl", "--model", "tiny", "--data", data, "--lengths", "64", "--num-windows", "1"],
        ["train", "recipe=tiny", "deepspeed=null", "train.max_steps=1", "train.report_to=[none]", "data.max_documents=8",
         f"train.output_dir={run}", f"data.cache_dir={tmp_path / 'cache'}"],
        ["generate", "--model", "tiny", "--max-new-tokens", "2", "hello"],
        ["merge", "--adapter", str(run / "adapter"), "--output", str(tmp_path / "merged")],
    ]
    done = subprocess.run([sys.executable, "-c", DRIVER, *("\x1f".join(v) for v in verbs)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    sections = dict(part.split("\n", 1) for part in done.stdout.split(MARK)[1:])
    assert list(sections) == [v[0] for v in verbs]
    for verb, out in sections.items():
        logged = [line for line in out.splitlines() if LOG_LINE.search(line)]
        assert not logged, (verb, logged)
    import torch

    # DeepSpeed was imported; its notice of no accelerator is dropped where torch has no GPU build
    assert ("Setting accelerator" in done.stderr) == (torch.version.cuda is not None)
    # the built-in model says it has random weights in the results and in the run's summary
    assert "| full on tiny (random weights) | 64 |" in sections["eval"]
    assert sections["train"].startswith("recipe tiny: tiny (random weights) (float32)")


def test_a_library_logger_that_prints_on_stdout_prints_on_stderr(capsys):
    import logging

    from sparse_ft import console

    console.library_logs_to_stderr()
    logging.getLogger(console.STDOUT_LOGGERS[0]).warning("a library's line")
    out, err = capsys.readouterr()
    assert out == "" and "a library's line" in err
