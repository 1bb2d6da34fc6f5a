"""A base's held-out RULER scores at its context C (``sparse_ft.experiment.heldout``), as JSON.

    python scripts/heldout_check.py BASE [--tasks niah_multikey_1] [--samples 60] [--keys rare] [--threads 1]

The score ``scripts/probe_drills.py --until-task`` trains toward, on its own: training words and
text, a seed space neither RULER's evaluation nor the corpus draws, so a phase may be tuned on it
and RULER's samples stay unseen. docs/experiment.md sets it beside RULER's on the same bases.
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from sparse_ft.evaluation.tasks.generation import registered_ruler_tasks
from sparse_ft.experiment.heldout import TASKS, HeldOut
from sparse_ft.modeling.rope import original_context


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("base")
    p.add_argument("--tasks", default=",".join(TASKS), help=f"RULER tasks, comma-separated (default {','.join(TASKS)})")
    p.add_argument("--samples", type=int, default=60, help="prompts per task (default 60)")
    p.add_argument("--keys", choices=("rare", "frequent"), default="rare",
                   help="the needles' keys: rare training words, as many BPE pieces as the evaluation's keys, or frequent "
                        "ones (shorter; seed 2's base reads 0.98 on them where RULER reads 0.79); default rare")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    args = p.parse_args()
    names = [n for n in args.tasks.split(",") if n]
    known = registered_ruler_tasks()
    for name in names:
        if name not in known:
            p.error(f"--tasks {name}: not a RULER task; one of {', '.join(known)}")
    if args.samples < 1:
        p.error(f"--samples {args.samples}: must be >= 1")
    if not Path(args.base, "config.json").is_file():
        p.error(f"BASE {args.base}: no checkpoint there (no config.json)")
    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(args.base)
    model = AutoModelForCausalLM.from_pretrained(args.base)
    context = original_context(model.config)
    began = time.perf_counter()
    scores = HeldOut(tokenizer, names, length=context, samples=args.samples, keys=args.keys).scores(model)
    print(f"{args.base}: {scores} in {time.perf_counter() - began:.0f} s", file=sys.stderr)
    print(json.dumps({"base": args.base, "length": context, "samples": args.samples, "keys": args.keys, "scores": scores}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
