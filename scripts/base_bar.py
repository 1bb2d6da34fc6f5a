"""Issue 33's bar for one pretrained base, checked on its own measurements.

    python scripts/base_bar.py BASE RULER.json PASSKEY.json [--more-ruler MORE.json ...] [--label NAME]

BASE is the checkpoint (its ``pretrain_stats.json`` gives the validation PPL), RULER.json is
``sparse-ft eval ruler --model BASE --lengths C --samples 20`` and PASSKEY.json is ``sparse-ft
eval passkey --model BASE --lengths 512,768,C-8 --depths 0,0.05,0.1,0.2,0.3,0.5,0.8,1 --trials
10``. It prints one markdown row of the seeds table in docs/experiment.md, then each criterion
met or not, and exits 1 when one is not: passkey >= 0.95 at every depth and length with the
answer inside C; niah_single_1/2 and niah_multikey_1 >= 0.9 at C; every other RULER task above
zero at C. A RULER or passkey file of another model, or one without a row at C, is refused by
name: a bar checked on the wrong measurements would say nothing.

``--more-ruler`` adds RULER files of the same base with more samples or other ``--seed``s (say
``--tasks niah_multikey_1 --samples 60 --seed 1``): 20 samples read a base that answers 93 %
under 0.9 about one time in six. A task's score at C is then pooled over every distinct sample: a
seed's first n samples are the same whatever ``--samples`` says, so of the files of one seed only
the one with the most samples of that task counts, and the seeds' scores are averaged weighted by
their samples.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

PASSKEY_MIN = 0.95
STRONG = {"niah_single_1": 90.0, "niah_single_2": 90.0, "niah_multikey_1": 90.0}  # RULER scores are percentages


def load(path: Path, command: str) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise SystemExit(f"{path}: not readable as JSON ({err})") from None
    if data.get("sparse_ft_output") != command:
        raise SystemExit(f"{path} is not the output of {command!r} (it says {data.get('sparse_ft_output')!r})")
    return data


def pooled(rulers: list[dict], context: int) -> tuple[dict[str, float], dict[str, int]]:
    """Each task's score at ``context`` over the distinct samples of ``rulers``, and their count."""
    largest: dict[tuple[str, int], dict] = {}  # (task, seed) -> the row with the most samples
    for ruler in rulers:
        for row in ruler["results"]:
            key = (row["task"], ruler["config"]["seed"])
            if row["length"] == context and row["samples"] > largest.get(key, {"samples": 0})["samples"]:
                largest[key] = row
    scores: dict[str, float] = {}
    samples: dict[str, int] = {}
    for (task, _), row in largest.items():
        scores[task] = scores.get(task, 0.0) + row["score"] * row["samples"]
        samples[task] = samples.get(task, 0) + row["samples"]
    return {task: total / samples[task] for task, total in scores.items()}, samples


def check(base: Path, rulers: list[dict], passkey: dict) -> tuple[dict, list[tuple[str, bool]]]:
    """The row's numbers and each criterion with whether it is met; ``rulers[0]`` is the file of
    every task, the others add samples (``--more-ruler``)."""
    stats = json.loads((base / "pretrain_stats.json").read_text())
    context = json.loads((base / "config.json").read_text())["max_position_embeddings"]
    for name, data in [("RULER", r) for r in rulers] + [("passkey", passkey)]:
        if Path(data["config"]["model"]).resolve() != base.resolve():
            raise SystemExit(f"the {name} file measured {data['config']['model']}, not {base}")
    if not any(r["length"] == context for r in rulers[0]["results"]):
        raise SystemExit(f"the RULER file has no row at the base's context C = {context}")
    scores, samples = pooled(rulers, context)
    inside = [c for c in passkey["results"] if c["length"] <= context - 8]  # 8 tokens: the answer inside C
    if not inside:
        raise SystemExit(f"the passkey file has no length with the answer inside C = {context} (<= {context - 8})")
    worst = min(c["accuracy"] for c in inside)
    row = {"passkey_min": worst, "passkey_lengths": sorted({c["length"] for c in inside}), "scores": scores,
           "mean": sum(scores.values()) / len(scores), "val_ppl": stats["evaluation"]["val_ppl"]}
    criteria = [(f"passkey >= {PASSKEY_MIN} at every depth ({len(inside)} cells, worst {worst:.2f})", worst >= PASSKEY_MIN)]
    criteria += [(f"{task} >= {least / 100:.1f} ({scores.get(task, 0) / 100:.2f} over {samples.get(task, 0)} samples)",
                  scores.get(task, 0) >= least) for task, least in STRONG.items()]
    criteria += [(f"{task} above zero ({score / 100:.3f})", score > 0) for task, score in scores.items() if task not in STRONG]
    return row, criteria


def markdown_row(label: str, row: dict) -> str:
    s = {k: v / 100 for k, v in row["scores"].items()}

    def get(*tasks: str, digits: int = 2) -> str:
        return " / ".join(f"{s[t]:.{digits}f}" if t in s else "–" for t in tasks)

    return (f"| {label} | {row['passkey_min']:.2f} | {get('niah_single_1', 'niah_single_2', 'niah_single_3')} | "
            f"{get('niah_multikey_1', 'niah_multikey_2', 'niah_multikey_3')} | {get('niah_multivalue', 'niah_multiquery')} | "
            f"{get('vt', 'cwe', 'fwe', digits=3)} | {row['mean']:.1f} | {row['val_ppl']:.1f} |")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("base", type=Path)
    p.add_argument("ruler", type=Path)
    p.add_argument("passkey", type=Path)
    p.add_argument("--more-ruler", type=Path, action="append", default=[], metavar="MORE.json",
                   help="another RULER file of BASE whose samples are pooled with RULER.json's (repeatable)")
    p.add_argument("--label", default=None, help="the row's first cell (default: BASE's name)")
    args = p.parse_args(argv)
    if not (args.base / "pretrain_stats.json").is_file():
        raise SystemExit(f"{args.base} holds no pretrain_stats.json: not a checkpoint of sparse-ft pretrain")
    rulers = [load(path, "sparse-ft eval ruler") for path in [args.ruler, *args.more_ruler]]
    row, criteria = check(args.base, rulers, load(args.passkey, "sparse-ft eval passkey"))
    print("| base | passkey, worst cell | single_1 / 2 / 3 | multikey_1 / 2 / 3 | multivalue / multiquery | vt / cwe / fwe | "
          "mean | val PPL |")
    print("|---|---:|---|---|---|---|---:|---:|")
    print(markdown_row(args.label or args.base.name, row))
    for text, met in criteria:
        print(f"{'met' if met else 'NOT met'}: {text}")
    return 0 if all(met for _, met in criteria) else 1


if __name__ == "__main__":
    sys.exit(main())
